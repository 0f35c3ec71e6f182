"""Without a GPU the library examples point to the CPU interpreter, and under
TK_MLIR_INTERPRET=1 they run their library call on small CPU tensors there
and check it against torch (with a GPU, test_examples_gpu.py runs them)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ERROR = r"rel\. error vs float(?:32|64): (\S+)"


def run(example: str, **env) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{example}.py")],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("example", ["gemm", "rmsnorm", "layernorm", "attention",
                                     "paged_decode", "linear_attention", "blackwell"])
def test_library_example_in_the_interpreter(example):
    out = run(example, TK_MLIR_INTERPRET="1")
    last = out.rstrip().splitlines()[-1]
    assert " on cpu: " in last, last
    assert float(re.search(ERROR, last).group(1)) < 1e-2


def test_without_a_gpu_an_example_says_how_to_interpret_it():
    from tk_mlir.runtime.driver import has_gpu
    if has_gpu():
        pytest.skip("a GPU is here: the example runs on it")
    out = run("rmsnorm", TK_MLIR_INTERPRET="0")
    assert out.rstrip().endswith("or check it in the CPU interpreter:\n"
                                 "  TK_MLIR_INTERPRET=1 python examples/rmsnorm.py")
