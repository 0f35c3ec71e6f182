"""The compilation cache seen from a kernel: in memory per Kernel object, on
disk per machine, shared between processes, and never in the way.

A kernel's source lives in a file under tmp_path and is imported under a new
module name each time, which makes a new Kernel object (an empty in-memory
cache) over the same disk cache. `compile_specialization` is the one entry
into MLIR: a disk hit must not call it.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir import compiler, toolchain
from tk_mlir.toolchain import find_tool

pytestmark = pytest.mark.usefixtures("cache_root")     # (conftest.py) every test

SOURCE = textwrap.dedent("""\
    import tk_mlir as tk
    from tk_mlir import f32


    def rows(n):
        return 16


    @tk.kernel
    def scale(X: tk.gl[f32], Y: tk.gl[f32], N: tk.constexpr):
        i = tk.block_id(0)
        x = tk.load(X, (i, 0), (rows(N), N))
        tk.store(Y, x * 2.0, (i, 0))
""")

X = tk.spec((64, 64), "f32")

# Run in a fresh interpreter: import tk_mlir and the kernel file, compile, and
# report what was loaded and what came back.
CHILD = textwrap.dedent("""\
    import hashlib, importlib.util, json, sys
    import tk_mlir as tk
    spec = importlib.util.spec_from_file_location("child_kernels", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = tk.spec((64, 64), "f32")
    compiled = module.scale.compile(x, x, N=64)
    report = {"mlir": "mlir" in sys.modules,
              "frontend": "tk_mlir.frontend" in sys.modules,
              "stored_stages": list(compiled.stages),
              "cubin": hashlib.sha256(compiled.cubin).hexdigest(),
              "tk": compiled.stages.get("tk"),
              "asm": list(compiled.asm)}
    print(json.dumps(report))
""")


@pytest.fixture
def kernel_file(tmp_path):
    path = tmp_path / "kernels.py"
    path.write_text(SOURCE)
    return path


_imports = 0


def load(path: Path):
    """Import `path` under a module name never used before: a new Kernel object."""
    global _imports
    _imports += 1
    name = f"kernel_cache_{_imports}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def forbid_compiling(monkeypatch):
    def refuse(spec, *args):
        raise AssertionError(f"compiled {spec.name} although it should be cached")
    monkeypatch.setattr(compiler, "compile_specialization", refuse)


def entries(root: Path) -> list[Path]:
    """Published entries (not temp or trash directories)."""
    if not root.is_dir():
        return []
    return [p for p in root.glob("*/*") if p.is_dir() and re.fullmatch(r"[0-9a-f]{64}", p.name)]


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith((".tmp-", ".trash-"))]


def tile_rows(compiled) -> set[int]:
    return {int(m) for m in re.findall(r"!tk\.rt<f32, (\d+)", compiled.stages["tk"])}


def run_child(script: Path, kernel: Path, root: Path) -> dict:
    proc = subprocess.run([sys.executable, str(script), str(kernel)], capture_output=True,
                          text=True, timeout=300, env=child_env(root), cwd=script.parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_env(root: Path) -> dict:
    env = dict(os.environ, TK_MLIR_CACHE_DIR=str(root))
    env.pop("TK_MLIR_ALWAYS_COMPILE", None)
    env.pop("TK_MLIR_DUMP_DIR", None)
    return env


# ------------------------------------------------------------- in memory

def test_same_arguments_same_object_from_memory(kernel_file, cache_root, compiles,
                                                monkeypatch):
    kernels = load(kernel_file)
    first = kernels.scale.compile(X, X, N=64)
    assert len(compiles) == 1
    forbid_compiling(monkeypatch)
    # The disk is not consulted either: the object comes from the kernel.
    for entry in entries(cache_root):
        for f in entry.iterdir():
            f.unlink()
        entry.rmdir()
    assert kernels.scale.compile(X, X, N=64) is first
    # Dynamic dims are not part of the specialization.
    assert kernels.scale.compile(tk.spec((1000, 512), "f32"), tk.spec((8, 64), "f32"),
                                 N=64) is first


# ----------------------------------------------------------------- on disk

def test_new_kernel_object_hits_the_disk(kernel_file, cache_root, compiles, monkeypatch):
    first = load(kernel_file).scale.compile(X, X, N=64)
    assert len(compiles) == 1 and len(entries(cache_root)) == 1
    stored_stages = dict(first.stages)

    forbid_compiling(monkeypatch)
    other = load(kernel_file)
    hit = other.scale.compile(X, X, N=64)
    assert hit is not first
    assert hit.cubin == first.cubin
    assert hit.params == first.params
    assert (hit.name, hit.num_warps, hit.smem_bytes) == (first.name, first.num_warps,
                                                        first.smem_bytes)
    assert hit.stages == stored_stages
    assert hit.ptxas_log == first.ptxas_log
    assert hit.info == first.info
    assert other.scale.compile(X, X, N=64) is hit      # and memory from then on


def test_source_change_misses(kernel_file, cache_root, compiles):
    before = load(kernel_file).scale.compile(X, X, N=64)
    edit(kernel_file, "x * 2.0", "x * 3.0")
    after = load(kernel_file).scale.compile(X, X, N=64)
    assert len(compiles) == 2
    assert len(entries(cache_root)) == 2
    assert "x * 3.0" in after.stages["python"] and "x * 3.0" not in before.stages["python"]
    assert after.cubin != before.cubin


def test_constexpr_change_misses(kernel_file, cache_root, compiles):
    kernels = load(kernel_file)
    a = kernels.scale.compile(X, X, N=64)
    b = load(kernel_file).scale.compile(X, X, N=128)
    assert len(compiles) == 2 and len(entries(cache_root)) == 2
    assert tile_rows(a) == tile_rows(b) == {16}
    assert "!tk.rt<f32, 16 : i64, 64 : i64" in a.stages["tk"]
    assert "!tk.rt<f32, 16 : i64, 128 : i64" in b.stages["tk"]
    # Each is then a hit of its own.
    assert load(kernel_file).scale.compile(X, X, N=128).cubin == b.cubin
    assert len(compiles) == 2


def test_num_warps_change_misses(kernel_file, cache_root, compiles):
    a = load(kernel_file).scale.compile(X, X, N=64)
    b = load(kernel_file).scale.compile(X, X, N=64, num_warps=8)
    assert len(compiles) == 2 and len(entries(cache_root)) == 2
    assert (a.num_threads, b.num_threads) == (128, 256)


def test_helper_function_change_misses(kernel_file, cache_root, compiles):
    assert tile_rows(load(kernel_file).scale.compile(X, X, N=64)) == {16}
    edit(kernel_file, "return 16", "return 32")
    assert tile_rows(load(kernel_file).scale.compile(X, X, N=64)) == {32}


def test_file_edited_after_decoration_compiles_what_was_decorated(kernel_file, cache_root):
    kernels = load(kernel_file)
    edit(kernel_file, "(rows(N), N)", "(32, N)")
    compiled = kernels.scale.compile(X, X, N=64)
    assert "(rows(N), N)" in compiled.stages["python"]
    assert tile_rows(compiled) == {16}


def test_damaged_entry_is_recompiled(kernel_file, cache_root, compiles):
    first = load(kernel_file).scale.compile(X, X, N=64)
    (entry,) = entries(cache_root)
    (entry / "cubin").write_bytes(b"\x7fELF truncated")
    with pytest.warns(RuntimeWarning, match="dropped a damaged compilation cache entry") as got:
        again = load(kernel_file).scale.compile(X, X, N=64)
    assert len(got) == 1 and len(compiles) == 2
    assert again.cubin == first.cubin
    (entry,) = entries(cache_root)
    assert (entry / "cubin").read_bytes() == first.cubin      # republished


# ---------------------------------------------------------- always compile

def test_always_compile_bypasses_the_cache(kernel_file, cache_root, compiles, monkeypatch):
    cached = load(kernel_file).scale.compile(X, X, N=64)
    assert len(compiles) == 1
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    again = load(kernel_file).scale.compile(X, X, N=64)
    assert len(compiles) == 2               # the entry on disk was not read
    assert again.cubin == cached.cubin
    # ...nor written: a new specialization leaves the disk as it was.
    load(kernel_file).scale.compile(X, X, N=128)
    assert len(compiles) == 3
    assert len(entries(cache_root)) == 1


# ------------------------------------------------------- other processes

def test_hit_in_a_new_process_loads_no_mlir(kernel_file, cache_root, tmp_path):
    parent = load(kernel_file).scale.compile(X, X, N=64)
    stored = [s for s in parent.stages if s != "sass"]
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    report = run_child(script, kernel_file, cache_root)
    assert report["mlir"] is False, "a disk hit imported MLIR"
    assert report["frontend"] is False
    assert report["stored_stages"] == stored            # the entry carries every stage
    assert report["tk"] == parent.stages["tk"]
    assert report["cubin"] == __import__("hashlib").sha256(parent.cubin).hexdigest()
    assert report["asm"] == stored + (["sass"] if find_tool("nvdisasm") else [])


def test_two_processes_compile_at_once(kernel_file, cache_root, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    assert not entries(cache_root)
    procs = [subprocess.Popen([sys.executable, str(script), str(kernel_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env(cache_root), cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert reports[0]["cubin"] == reports[1]["cubin"]
    (entry,) = entries(cache_root)               # one complete entry, nothing half-made
    manifest = json.loads((entry / ".manifest.json").read_text())
    assert sorted(manifest["files"]) == ["cubin", "meta.json", "stages.json"]
    assert not leftovers(cache_root)
    third = run_child(script, kernel_file, cache_root)
    assert third["mlir"] is False
    assert third["cubin"] == reports[0]["cubin"]


# ---------------------------------------------------------- unusable cache

def test_unwritable_cache_dir_still_compiles_with_a_warning(kernel_file, tmp_path,
                                                             monkeypatch, compiles):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match=r"cannot write to the compilation cache at "
                      r".*not-a-dir/cache .*continuing without it") as caught:
        compiled = load(kernel_file).scale.compile(X, X, N=64)
    assert compiled.cubin and len(compiles) == 1
    assert caught[0].filename == __file__       # the user's line, not tk_mlir's
    assert blocker.read_text() == "a regular file"
    # Once per directory and process: the next compile is quiet (and compiles).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(kernel_file).scale.compile(X, X, N=128)
    assert len(compiles) == 2


def test_the_sass_listing_is_kept_in_the_cache(kernel_file, cache_root, monkeypatch):
    if not find_tool("nvdisasm"):
        pytest.skip("no nvdisasm")
    first = load(kernel_file).scale.compile(X, X, N=64)
    sass = first.asm["sass"]                        # made once, by nvdisasm
    assert "EXIT" in sass
    def no_nvdisasm(cubin):
        raise AssertionError("nvdisasm ran although the cache holds the listing")
    monkeypatch.setattr(toolchain, "disassemble", no_nvdisasm)
    again = load(kernel_file).scale.compile(X, X, N=64)    # a new Kernel: a disk hit
    assert again is not first and again.asm["sass"] == sass


def test_moving_the_last_used_to_the_front_survives_racing_threads():
    import sys
    import threading
    from tk_mlir.kernel import _to_front
    items = [object() for _ in range(8)]
    pool, originals, errors = list(items), set(map(id, items)), []

    def churn(seed):
        try:
            for n in range(20000):
                _to_front(items, pool[(seed * 7 + n) % len(pool)])
        except Exception as e:       # an IndexError escaping would reach a launch
            errors.append(e)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and items and set(map(id, items)) <= originals


# ------------------------------------------------------- bounded in memory

def signature(kernel, *args, **kwargs):
    from tk_mlir.runtime.arguments import describe
    values, num_warps = kernel.params.bind(args, kwargs)
    return kernel.params.key(values, num_warps, describe)


MAX_CODES = 64     # kernel.py's _MAX_CODES, the bound these tests hold it to


def held(table) -> int:
    return sum(len(entries) for entries in table.values())


def test_many_signatures_keep_a_bounded_number_of_codes(kernel_file, monkeypatch):
    """300 specializations (compile-only; the compile itself stubbed) keep at
    most 64 codes, the least recently used dropped: one used all along stays."""
    import random
    monkeypatch.setattr(compiler, "compile_cached", lambda spec, *a: ((), object()))
    scale = load(kernel_file).scale
    sizes = random.sample(range(1, 4096), 300)
    favourite = scale.compile(X, X, N=sizes[0])
    for n in sizes[1:]:
        scale.compile(X, X, N=n)
        assert scale.compile(X, X, N=sizes[0]) is favourite      # used again: kept
        assert held(scale._compiled) <= MAX_CODES
    assert len(scale._compiled) == MAX_CODES
    kept = [sig[2][1] for sig in scale._compiled]     # (sig[2]: N, the constexpr)
    assert kept[-1] == sizes[0] and kept[:-1] == sizes[-63:]


def test_many_signatures_keep_a_bounded_number_of_interpreter_programs(kernel_file,
                                                                        monkeypatch):
    from tk_mlir.interpreter import program
    monkeypatch.setattr(program, "build_module", lambda spec, fn, globals_: ())
    monkeypatch.setattr(program, "Program", lambda: object())
    scale = load(kernel_file).scale
    for n in range(1, 301):
        scale.interpreted(signature(scale, X, X, N=n))
    assert held(scale._programs) == MAX_CODES
    sig = signature(scale, X, X, N=300)
    assert scale.interpreted(sig) is scale._programs[sig][0][1]
