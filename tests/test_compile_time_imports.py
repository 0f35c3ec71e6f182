"""A first compile imports MLIR's bindings without numpy (tk_mlir/mlir_import.py):
numpy costs a third of a small kernel's cold compile and MLIR needs it only
for four attribute builders, which stay available (importing numpy on use)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""\
    import json, sys
    import tk_mlir as tk
    from tk_mlir import f32

    @tk.kernel
    def copy(X: tk.gl[f32], Y: tk.gl[f32]):
        tk.store(Y, tk.load(X, (tk.block_id(0), 0), (16, 64)), (tk.block_id(0), 0))

    x = tk.spec((64, 64), "f32")
    compiled = copy.compile(x, x)
    report = {"numpy after compile": "numpy" in sys.modules, "ptx": ".entry copy" in compiled.asm["ptx"]}
    from mlir import ir
    with ir.Context() as ctx:
        attr = ir.AttrBuilder.get("F64ElementsAttr")([1.5, 2.0], ctx)
    report["builder"] = str(attr)
    report["numpy after builder"] = "numpy" in sys.modules
    print(json.dumps(report))
""")


def test_first_compile_does_not_import_numpy(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
           "TK_MLIR_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"numpy after compile": False, "ptx": True,
                      "builder": "dense<[1.500000e+00, 2.000000e+00]> : tensor<2xf64>",
                      "numpy after builder": True}
