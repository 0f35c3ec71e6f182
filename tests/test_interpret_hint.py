"""Every error that says a kernel cannot launch here says how to run it on
this machine's CPU instead: the interpreter (kernel.interpret[grid](...) or
TK_MLIR_INTERPRET=1), in one wording, errors.INTERPRET_HINT."""
import pytest

from tk_mlir.errors import INTERPRET_HINT, ArgumentError, CudaUnavailable
from tk_mlir.runtime.arguments import TensorInfo, check_tensor


def test_the_hint_names_both_ways_to_interpret():
    assert "kernel.interpret[grid](...)" in INTERPRET_HINT
    assert "TK_MLIR_INTERPRET=1" in INTERPRET_HINT


def test_no_cuda_bindings_says_how_to_interpret():
    message = str(CudaUnavailable("No module named 'cuda'"))
    assert "(No module named 'cuda')" in message and "pip install cuda-bindings" in message
    assert message.endswith(f"need neither. To {INTERPRET_HINT}")


def test_a_cpu_tensor_says_how_to_interpret():
    cpu = TensorInfo(0x1000, (16,), (1,), "f32", "cpu", 4)
    with pytest.raises(ArgumentError) as caught:
        check_tensor(cpu, "x", dtype="f32", rank=1)
    assert str(caught.value).endswith(f"move it with .cuda(), or {INTERPRET_HINT}")
