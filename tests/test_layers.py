"""The import layers hold: a module imports only from its own layer and the
layers before it (function-level imports count: they are dependencies too).

    foundation -> language -> frontend -> passes -> lowering -> compile -> runtime

A layer is the list of modules below; a module no layer names fails the
test, so a new one is placed on purpose. The top-level `dialects/`,
`passes/` and `lowering/` folders install as tk_mlir.dialects, ... and stay
where the repository's layout puts them."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"tk_mlir": "tk_mlir", "dialects": "tk_mlir.dialects", "passes": "tk_mlir.passes",
           "lowering": "tk_mlir.lowering"}

# Module name patterns (a trailing `.*`: the package and everything in it),
# in layer order.
LAYERS = {
    "foundation": ["dtypes", "errors", "knobs", "target", "mlir_import", "stage_diff",
                   "dialects.*"],
    "language": ["language", "source", "values", "ops", "sync", "tma", "mma", "tensor_memory",
                 "signals", "rings", "templates"],
    "frontend": ["frontend", "global_reads", "params"],
    "passes": ["passes.*"],
    "lowering": ["lowering.*", "stages"],       # (stages: the pipeline records into a StageStore)
    "compile": ["compiler", "cache", "source_map", "summary", "display", "toolchain",
                "compiled", "dumps", "ptxas_output", "specialization"],
    "runtime": ["runtime.*", "launcher", "kernel", "autotune", "interpreter.*", "benchmarking",
                "cli", "__main__", "kernels.*", "integrations.*", ""],
}


# Imports across the layers not yet undone, each with why it is there. A new
# one fails the test; undoing one means deleting its line here.
KNOWN = {
    ("tk_mlir.rings", "tk_mlir"): "tk.funcs written in the language read `tk.` as kernels do",
    ("tk_mlir.templates", "tk_mlir"): "tk.funcs written in the language read `tk.` as kernels do",
    ("tk_mlir.params", "tk_mlir.runtime.peers"):
        "the specialization key reads a tk.pgl argument with read_peers",
    ("tk_mlir.compiled", "tk_mlir.runtime.driver"):
        "CompiledKernel loads its CUDA function and asks the driver for its occupancy",
    ("tk_mlir.compiled", "tk_mlir.launcher"):
        "CompiledKernel.launch_values, the general launch path's values function",
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    name = module.removeprefix("tk_mlir").removeprefix(".")
    for i, patterns in enumerate(LAYERS.values()):
        for p in patterns:
            if name == p or (p.endswith(".*") and (name == p[:-2] or
                                                   name.startswith(p[:-1]))):
                return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: place it")


def imports(module: str) -> set[str]:
    """The project's modules `module` imports, at any depth of its code."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            named = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
            out.update(named or {base})
    return {m for m in out if m in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_those_before(module):
    mine = layer_of(module)
    names = list(LAYERS)
    later = sorted(f"{m} ({names[layer_of(m)]})" for m in imports(module)
                   if layer_of(m) > mine and (module, m) not in KNOWN)
    assert not later, f"{module} ({names[mine]}) imports from later layers: {', '.join(later)}"


def test_the_known_exceptions_are_still_there():
    gone = [pair for pair in KNOWN if pair[1] not in imports(pair[0])]
    assert not gone, f"undone, delete from KNOWN: {gone}"


def test_the_top_level_folders_stay():
    for folder in ("dialects", "passes", "lowering"):
        assert (REPO / folder / "__init__.py").is_file()
        assert not (REPO / "tk_mlir" / folder).exists()
