"""Without cuda-bindings, ptxas and nvdisasm (a macOS machine: none of them has
wheels there) tk_mlir still imports, compiles, and shows every stage up to
PTX; what needs them (SASS, ptxas's numbers, the cubin, launching, tensor
maps) raises one error saying what is missing and how to get it, and a
kernel compiled to PTX only leaves nothing in the disk cache.

The child process hides them itself: a meta-path finder, installed before
tk_mlir is imported, refuses `cuda` (cuda-bindings) and the packages
toolchain.find_tool looks in (`nvidia`: the nvcc/nvdisasm wheels; `triton`:
its bundled ptxas), and PATH is an empty folder."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""\
    import importlib.abc, json, sys

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.partition(".")[0] in ("cuda", "nvidia", "triton"):
                raise ImportError(f"No module named {fullname!r} (hidden by the test)")
            return None

    sys.meta_path.insert(0, Hide())

    import numpy as np
    import tk_mlir as tk
    from tk_mlir import f32
    from tk_mlir.toolchain import find_tool

    @tk.kernel(num_warps=4)
    def softmax(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.constexpr, N: tk.constexpr):
        i = tk.block_id(0)
        x = tk.load(X, (i, 0), (ROWS, N), fill=float("-inf"))
        e = x.sub_row(x.row_max()).exp()
        tk.store(Y, e.div_row(e.row_sum()), (i, 0))

    def error(action):
        try:
            action()
        except Exception as e:
            return {"type": type(e).__name__, "message": str(e),
                    "import_error": isinstance(e, ImportError),
                    "chained": e.__cause__ is not None or
                               (e.__context__ is not None and not e.__suppress_context__)}
        return None

    report = {"ptxas": find_tool("ptxas"), "nvdisasm": find_tool("nvdisasm")}
    x = tk.spec((64, 512), f32)
    compiled = softmax.compile(x, x, ROWS=4, N=512)
    asm = compiled.asm
    report["stages"] = list(asm)
    report["read"] = {name: len(asm[name]) > 0 for name in asm}
    report["ptx"] = ".entry softmax" in asm["ptx"]
    report["sass in asm"] = "sass" in asm
    report["repr"] = repr(compiled)
    report["sass"] = error(lambda: asm["sass"])
    report["ptxas log"] = error(lambda: asm["ptxas"])
    report["info"] = error(lambda: compiled.info)
    report["summary"] = compiled.summary()
    report["page stages"] = compiled._repr_html_().count("<details")
    report["cubin"] = error(lambda: compiled.cubin)
    a = np.zeros((64, 512), np.float32)
    report["launch"] = error(lambda: softmax[(16,)](a, a, ROWS=4, N=512))
    report["launch again"] = error(lambda: softmax[(16,)](a, a, ROWS=4, N=512))
    report["tensor maps"] = error(lambda: __import__("tk_mlir.runtime.tensor_maps"))
    # What the errors advise instead: the interpreter, which needs no cuda-bindings.
    x = np.random.default_rng().standard_normal((64, 512)).astype(np.float32) * 3
    y = np.full_like(x, np.nan)
    report["interpret"] = error(lambda: softmax.interpret[(16,)](x, y, ROWS=4, N=512))
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    ref = e / e.sum(1, keepdims=True)
    report["interpret error"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    report["cuda imported"] = any(m == "cuda" or m.startswith("cuda.") for m in sys.modules)
    print(json.dumps(report))
""")


def _run_child(tmp_path) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    env = {"PATH": str(empty), "PYTHONPATH": str(REPO), "HOME": str(tmp_path),
           "TK_MLIR_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compiles_to_ptx_and_says_what_is_missing(tmp_path):
    report = _run_child(tmp_path)
    assert report["ptxas"] is None and report["nvdisasm"] is None     # hidden indeed

    # Every stage up to PTX reads; the ones made from the cubin are not listed.
    stages = report["stages"]
    assert stages[:2] == ["python", "tk"] and stages[-2:] == ["llvm", "ptx"], stages
    assert len(stages) > 4                                    # the passes' stages
    assert all(report["read"].values()) and report["ptx"]
    assert not report["sass in asm"]
    assert "not assembled" in report["repr"]
    # The summary and the notebook page say what they can without ptxas.
    assert report["summary"] == {"threads": 128, "dynamic shared memory (bytes)": 0,
                                 "note": "PTX only (no ptxas here): no registers, SASS or "
                                         "occupancy"}
    assert report["page stages"] == len(stages)

    # What needs ptxas names it and its package, and what asked for it.
    for key, what in (("sass", "reading SASS"), ("ptxas log", "reading the ptxas stage"),
                      ("info", "ptxas's numbers"), ("cubin", "the cubin")):
        e = report[key]
        assert e is not None and e["type"] == "ToolNotFound", (key, e)
        assert e["message"].startswith(f"{what}") and "needs ptxas from the nvidia-cuda-nvcc " \
            "package" in e["message"] and "pip install nvidia-cuda-nvcc" in e["message"], e

    # Launching and tensor maps need cuda-bindings: one error, not an ImportError
    # from inside tk_mlir, every time it is asked.
    for key in ("launch", "launch again", "tensor maps"):
        e = report[key]
        assert e is not None and e["type"] == "CudaUnavailable", (key, e)
        assert not e["import_error"] and not e["chained"], e
        assert "needs cuda-bindings" in e["message"] and "pip install cuda-bindings" in \
            e["message"], e
    # The interpreter runs the kernel here, without cuda-bindings.
    assert report["interpret"] is None and report["interpret error"] < 1e-6, report
    assert not report["cuda imported"]


def test_ptx_only_kernels_stay_out_of_the_disk_cache(tmp_path):
    # A machine with ptxas sharing this cache must never read a kernel without
    # its cubin as a whole one: nothing is written at all.
    _run_child(tmp_path)
    cache = tmp_path / "cache"
    written = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert written == []
