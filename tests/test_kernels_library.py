"""The kernel library without a GPU: `tk_mlir.kernels` imports cheaply, keeps
its public names bound to the kernels, its wrappers reject bad arguments
with errors that name the argument and the rule before anything reaches the
GPU (so CPU tensors show them), and the teaching examples that call it
compile without a GPU. The kernels' PTX and SASS are checked in test_ptx.py
(norms) and test_hopper.py (GEMM); their numerics on the GPU in
test_examples_gpu.py and test_gemm_gpu.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

IMPORT_COST = """\
import json, sys
import tk_mlir.kernels as k
from tk_mlir.kernels import attention, matmul, rms_norm, layer_norm, scaled_matmul
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "mlir", "numpy"))))
"""


def test_importing_the_library_loads_neither_torch_nor_mlir(tmp_path):
    """Even resolving the names imports only the kernels' modules: torch
    comes with the first call, MLIR with the first compile."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path),
           "TK_MLIR_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", IMPORT_COST], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_names_stay_bound_to_the_kernels_after_importing_their_modules():
    import tk_mlir.kernels.flash_attention  # noqa: F401  modules bind nothing over the functions
    import tk_mlir.kernels.gemm             # noqa: F401
    import tk_mlir.kernels.norms            # noqa: F401
    import tk_mlir.kernels.scaled_gemm      # noqa: F401
    import tk_mlir.kernels.all_reduce_kernels  # noqa: F401
    import tk_mlir.kernels.gemm_rs          # noqa: F401
    import tk_mlir.kernels.ag_gemm          # noqa: F401
    from tk_mlir import kernels
    from tk_mlir.kernels import (all_reduce, attention, layer_norm, matmul,
                                 matmul_reduce_scatter, rms_norm, scaled_matmul)
    functions = (matmul, rms_norm, layer_norm, attention, scaled_matmul, all_reduce,
                 matmul_reduce_scatter)
    assert [f.__name__ for f in functions] == \
        ["matmul", "rms_norm", "layer_norm", "attention", "scaled_matmul", "all_reduce",
         "matmul_reduce_scatter"]
    assert kernels.matmul is matmul and sorted(kernels.__all__) == \
        ["all_gather_matmul", "all_reduce", "attention", "attention_varlen",
         "attention_with_kvcache", "cross_entropy", "fused_add_layer_norm",
         "fused_add_rms_norm", "grouped_matmul", "grouped_mm", "layer_norm", "linear_attention",
         "linear_attention_step", "linear_cross_entropy", "matmul",
         "matmul_reduce_scatter",
         "rms_norm", "rotary_embedding", "rotary_embedding_qk", "scaled_matmul", "ssd",
         "swiglu"]
    assert {"matmul", "rms_norm", "layer_norm", "attention", "scaled_matmul"} <= set(dir(kernels))
    with pytest.raises(AttributeError, match="no attribute 'softmax'"):
        kernels.softmax


TEACHING = ["gemm", "rmsnorm", "layernorm", "attention"]     # the examples that call the library


@pytest.mark.parametrize("example", TEACHING)
def test_teaching_examples_compile_without_a_gpu(example, capsys):
    """Each shows its kernel's compile and says that it stopped there (with a
    GPU, test_examples_gpu.py runs them whole)."""
    import runpy
    from tk_mlir.runtime.driver import has_gpu
    if has_gpu():
        pytest.skip("a GPU is present: the examples run whole in test_examples_gpu.py")
    runpy.run_path(str(ROOT / "examples" / f"{example}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "'spill stores (bytes)': 0" in out and "no GPU here: compiled only" in out


# ------------------------------------------------------- argument checks

torch = pytest.importorskip("torch")
from tk_mlir.kernels import (grouped_matmul, layer_norm, matmul, rms_norm,  # noqa: E402
                             scaled_matmul)

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def cpu(*shape, dtype=bf16):
    return torch.zeros(*shape, dtype=dtype)


# Each case: the call, the error type, a pattern of its message. The device
# rule comes last, so CPU tensors reach every other rule.
REJECTED = {
    "matmul: b_layout": (
        lambda: matmul(cpu(8, 8), cpu(8, 8), b_layout="mk"), ValueError,
        r"matmul: b_layout must be 'nk' \(b is N x K\) or 'kn'.*'mk'"),
    # rules about autograd before the device's too
    "matmul: c with an input requiring grad": (
        lambda: matmul(cpu(8, 8).requires_grad_(), cpu(8, 8), c=cpu(8, 8)), RuntimeError,
        r"matmul: c \(the output to write into\) does not take part in autograd"),
    "rms_norm: out= with an input requiring grad": (
        lambda: rms_norm(cpu(4, 64).requires_grad_(), cpu(64), out=cpu(4, 64)), RuntimeError,
        r"rms_norm: out= does not take part in autograd"),
    "scaled_matmul: an input requiring grad": (
        lambda: scaled_matmul(cpu(16, 32, dtype=torch.float8_e4m3fn),
                              cpu(16, 32, dtype=torch.float8_e4m3fn).t(),
                              torch.ones((), requires_grad=True), torch.ones(())),
        RuntimeError, r"scaled_matmul: not differentiable"),
    "matmul: a sparse": (
        lambda: matmul(cpu(8, 8).to_sparse(), cpu(8, 8)), TypeError,
        r"matmul: a must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    "rms_norm: x nested": (
        lambda: rms_norm(torch.nested.nested_tensor([cpu(3, 64), cpu(2, 64)]), cpu(64)),
        TypeError, r"rms_norm: x must be a dense \(strided\) tensor, got a nested tensor"),
    "matmul: a not a tensor": (
        lambda: matmul([[1.0]], cpu(8, 8)), TypeError,
        r"matmul: a must be a torch.Tensor, got list"),
    "matmul: a 4-D": (
        lambda: matmul(cpu(2, 2, 8, 8), cpu(8, 8)), ValueError,
        r"matmul: a must be 2-D \(M x K\) or 3-D \(G x M x K, a batch\), got shape "
        r"\(2, 2, 8, 8\)"),
    "matmul: a batch, b not": (
        lambda: matmul(cpu(2, 8, 8), cpu(8, 8)), ValueError,
        r"matmul: b must be 3-D, got shape \(8, 8\)"),
    "matmul: batch sizes differ": (
        lambda: matmul(cpu(2, 8, 8), cpu(3, 8, 8)), ValueError,
        r"matmul: a and b must have one batch size: a is \(2, 8, 8\), b is \(3, 8, 8\)"),
    "grouped_matmul: a 2-D": (
        lambda: grouped_matmul(cpu(8, 8), cpu(8, 8), None), ValueError,
        r"grouped_matmul: a must be 3-D \(G x M x K\), got shape \(8, 8\)"),
    "grouped_matmul: sizes": (
        lambda: grouped_matmul(cpu(2, 8, 8), cpu(2, 8, 8), torch.tensor([1.0, 2.0])), ValueError,
        r"grouped_matmul: sizes must be a 1-D int32 or int64 tensor of G=2 row counts on cpu, "
        r"got shape \(2,\) torch.float32 on cpu"),
    "matmul: batched c's shape": (
        lambda: matmul(cpu(2, 8, 16), cpu(2, 4, 16), cpu(2, 4, 8)), ValueError,
        r"matmul: c must have shape \(2, 8, 4\) \(G x M x N\), got \(2, 4, 8\)"),
    "matmul: a f32": (
        lambda: matmul(cpu(8, 8, dtype=f32), cpu(8, 8)), TypeError,
        r"matmul: a must be torch.bfloat16 or torch.float16, got torch.float32"),
    "matmul: dtypes differ": (
        lambda: matmul(cpu(8, 8), cpu(8, 8, dtype=f16)), TypeError,
        r"matmul: b must have a's dtype torch.bfloat16, got torch.float16"),
    "matmul: inner dims, nk": (
        lambda: matmul(cpu(8, 16), cpu(8, 32)), ValueError,
        r"matmul: inner dimensions differ: a is \(8, 16\) \(M x K\), "
        r"b is \(8, 32\) \(N x K, b_layout='nk'\)"),
    "matmul: inner dims, kn": (
        lambda: matmul(cpu(8, 16), cpu(8, 16), b_layout="kn"), ValueError,
        r"b is \(8, 16\) \(K x N, b_layout='kn'\)"),
    "matmul: c's shape": (
        lambda: matmul(cpu(8, 16), cpu(4, 16), cpu(4, 8)), ValueError,
        r"matmul: c must have shape \(8, 4\) \(M x N\), got \(4, 8\)"),
    "matmul: c f64": (
        lambda: matmul(cpu(8, 16), cpu(4, 16), cpu(8, 4, dtype=torch.float64)), TypeError,
        r"matmul: c must be torch.bfloat16, torch.float16 or torch.float32"),
    "matmul: on the CPU": (
        lambda: matmul(cpu(8, 16), cpu(4, 16), cpu(8, 4, dtype=f32)), ValueError,
        r"matmul: a must be on a CUDA device, got cpu \(the kernel runs on the GPU\)"),
    "rms_norm: x 0-D": (
        lambda: rms_norm(cpu(8)[0], cpu(8)), ValueError,
        r"rms_norm: x must be at least 1-D \(D, or rows x D\), got shape \(\)"),
    "layer_norm: x f32": (
        lambda: layer_norm(cpu(4, 8, dtype=torch.float32), cpu(8), cpu(8)), TypeError,
        r"layer_norm: x must be torch.bfloat16 or torch.float16, got torch.float32"),
    "layer_norm: weight f16, x bf16": (
        lambda: layer_norm(cpu(4, 8), cpu(8, dtype=f16), cpu(8)), TypeError,
        r"layer_norm: weight must be torch.bfloat16, got torch.float16"),
    "rms_norm: no columns": (
        lambda: rms_norm(cpu(4, 0), cpu(0)), ValueError,
        r"rms_norm: x's last dim D must be a positive multiple of 8 .* got shape \(4, 0\)"),
    "rms_norm: D not a multiple of 8": (
        lambda: rms_norm(cpu(2, 100), cpu(100)), ValueError,
        r"rms_norm: x's last dim D must be a positive multiple of 8 \(rows of whole 16-byte"),
    "rms_norm: D past a block's registers": (
        lambda: rms_norm(cpu(2, 32776), cpu(32776)), ValueError,
        r"rms_norm: x's last dim D must be at most 32768 \(a row, rounded up to a power of two"),
    "matmul: an expanded c": (
        lambda: matmul(cpu(8, 16), cpu(4, 16), cpu(1, 4).expand(8, 4)), ValueError,
        r"matmul: c is written in place and must not have elements that share memory .* "
        r"strides \(0, 1\)"),
    "matmul: rows of c overlapping": (
        lambda: matmul(cpu(8, 16), cpu(4, 16), cpu(40).as_strided((8, 4), (2, 1))), ValueError,
        r"matmul: c is written in place and must not have elements that share memory"),
    "matmul: c is a": (
        lambda: (lambda a: matmul(a, cpu(16, 16), a))(cpu(16, 16)), ValueError,
        r"matmul: c is written while a is read and must not share memory with it"),
    "matmul: c inside b": (
        lambda: (lambda t: matmul(cpu(8, 16), t[:8], t[4:12, :8]))(cpu(16, 16)), ValueError,
        r"matmul: c is written while b is read and must not share memory with it"),
    "grouped_matmul: c is a": (
        lambda: (lambda a: grouped_matmul(a, cpu(2, 16, 16), [3, 5], a))(cpu(2, 16, 16)),
        ValueError, r"grouped_matmul: c is written while a is read"),
    "rms_norm: an overlapping out": (
        lambda: rms_norm(cpu(3, 64), cpu(64), out=cpu(1, 64).expand(3, 64)), ValueError,
        r"rms_norm: out is written in place and must not have elements that share memory"),
    "rms_norm: a transposed out": (
        lambda: rms_norm(cpu(64, 64), cpu(64), out=cpu(64, 64).T), ValueError,
        r"rms_norm: out must have a contiguous last dim, got strides \(1, 64\)"),
    "rms_norm: eps NaN": (
        lambda: rms_norm(cpu(3, 64), cpu(64), float("nan")), ValueError,
        r"rms_norm: eps must be a finite number >= 0, got nan"),
    "layer_norm: eps < 0": (
        lambda: layer_norm(cpu(3, 64), cpu(64), cpu(64), -1.0), ValueError,
        r"layer_norm: eps must be a finite number >= 0, got -1.0"),
    "rms_norm: weight not a tensor": (
        lambda: rms_norm(cpu(4, 8), 1.0), TypeError,
        r"rms_norm: weight must be a torch.Tensor, got float"),
    "rms_norm: weight's length": (
        lambda: rms_norm(cpu(4, 8), cpu(16)), ValueError,
        r"rms_norm: weight must have shape \(8,\) \(one value per column of x\)"),
    "layer_norm: bias f32": (
        lambda: layer_norm(cpu(4, 8), cpu(8), cpu(8, dtype=f32)), TypeError,
        r"layer_norm: bias must be torch.bfloat16, got torch.float32"),
    "layer_norm: bias 2-D": (
        lambda: layer_norm(cpu(4, 8), cpu(8), cpu(1, 8)), ValueError,
        r"layer_norm: bias must be 1-D, got shape \(1, 8\)"),
    "layer_norm: out's shape": (
        lambda: layer_norm(cpu(4, 8), cpu(8), cpu(8), out=cpu(8, 4)), ValueError,
        r"layer_norm: out must have shape \(4, 8\) \(x's shape\), got \(8, 4\)"),
    "rms_norm: eps a string": (
        lambda: rms_norm(cpu(4, 8), cpu(8), "1e-6"), TypeError,
        r"rms_norm: eps must be a real number \(an int or a float\), got str"),
    "layer_norm: on the CPU": (
        lambda: layer_norm(cpu(4, 8), cpu(8), cpu(8), 1e-5), ValueError,
        r"layer_norm: x must be on a CUDA device, got cpu"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_wrappers_reject_bad_arguments_before_the_gpu(case):
    call, error, pattern = REJECTED[case]
    with pytest.raises(error, match=pattern):
        call()


def test_an_output_aliasing_an_input_is_refused_on_a_signature_seen_before(interpret):
    """The eager path checks a signature once; c's memory against a's and b's
    is checked on every call (a later call of the same shapes may alias)."""
    a, b = (torch.rand(64, 64).to(torch.bfloat16) for _ in range(2))
    c = torch.full((64, 64), float("nan")).to(torch.bfloat16)
    assert matmul(a, b, c) is c and not c.isnan().any()
    with pytest.raises(ValueError, match=r"matmul: c is written while a is read"):
        matmul(a, b, a)
    g = torch.full((2, 64, 64), float("nan")).to(torch.bfloat16)
    ga, gb = torch.rand(2, 64, 64).to(torch.bfloat16), torch.rand(2, 64, 64).to(torch.bfloat16)
    assert grouped_matmul(ga, gb, [64, 64], g) is g
    with pytest.raises(ValueError, match=r"grouped_matmul: c is written while b is read"):
        grouped_matmul(ga, gb, [64, 64], gb)


def test_numpy_scalars_are_numbers(interpret):
    """eps and scale as numpy scalars, as torch's functions take them."""
    import numpy as np
    from tk_mlir.kernels import attention
    x, w = torch.rand(4, 64).to(torch.bfloat16), torch.rand(64).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, np.float32(1e-6)), rms_norm(x, w, 1e-6))
    q = torch.rand(1, 2, 16, 64).to(torch.bfloat16)
    assert torch.equal(attention(q, q, q, scale=np.float32(0.125)), attention(q, q, q, scale=0.125))
