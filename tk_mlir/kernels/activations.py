"""Gated activations on torch tensors: swiglu, forward and backward.

    from tk_mlir.kernels import swiglu
    h = swiglu(gate, up)                   # silu(gate) * up, as a Llama MLP's

Elementwise kernels over BM x BN tiles of the inputs seen as (rows, D) (their
leading dims flattened: a view for the usual cases, e.g. the halves of a
fused gate/up projection, `gate_up.chunk(2, -1)`); tiles past the edges are
masked. Math in f32, inputs and outputs bf16 or f16.
"""
from __future__ import annotations

import math

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks, eager
from tk_mlir.runtime.arguments import contiguous_strides


# The tile of a block: 16 x 256 with 8 warps (16 elements a thread) ran the
# backward 10% faster than 32 x 256 with 4 and the forward as fast (H200,
# BENCHMARKS.md, issue 25).
BM, BN = 16, 256


@tk.func
def tile_of_block(NJ):
    """(row tile, column tile) of this block in a one-dimensional grid of
    row tiles x NJ column tiles, columns first: blocks that run together
    stream whole rows (4.5% faster than rows first, H100, BENCHMARKS.md)."""
    b = tk.block_id(0)
    return b // NJ, b % NJ


@tk.kernel(num_warps=8)
def swiglu_kernel(G: tk.gl, U: tk.gl, Y: tk.gl, NJ: int, BM: tk.constexpr = BM,
                  BN: tk.constexpr = BN):
    """Y = silu(G) * U = G / (1 + exp(-G)) * U, one BM x BN tile per block
    (tile_of_block: NJ column tiles)."""
    i, j = tile_of_block(NJ)
    g = tk.load(G, (i, j), (BM, BN)).to(f32)
    u = tk.load(U, (i, j), (BM, BN)).to(f32)
    tk.store(Y, (g * sigmoid(g) * u).to(Y.dtype), (i, j))


@tk.kernel(num_warps=8)
def swiglu_backward_kernel(G: tk.gl, U: tk.gl, DY: tk.gl, DG: tk.gl, DU: tk.gl, NJ: int,
                           BM: tk.constexpr = BM, BN: tk.constexpr = BN):
    """With s = sigmoid(G): DU = DY * G * s and DG = DY * U * s * (1 + G * (1 - s))
    (silu's derivative), one BM x BN tile per block (tile_of_block)."""
    i, j = tile_of_block(NJ)
    g = tk.load(G, (i, j), (BM, BN)).to(f32)
    u = tk.load(U, (i, j), (BM, BN)).to(f32)
    dy = tk.load(DY, (i, j), (BM, BN)).to(f32)
    s = sigmoid(g)
    tk.store(DU, (dy * g * s).to(DU.dtype), (i, j))
    tk.store(DG, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype), (i, j))


@tk.func
def sigmoid(x):
    """1 / (1 + exp(-x)): 0 where exp(-x) overflows to inf, never NaN."""
    return (1.0 + (-x).exp()).rcp()


def swiglu(gate, up):
    """silu(gate) * up = gate * sigmoid(gate) * up, elementwise, into a new
    tensor of gate's shape (contiguous).

    gate, up: bf16 or f16 CUDA tensors of one shape, dtype and device, any
    rank and strides (the halves of a fused projection are read as they
    lie; a view the kernel cannot read so, e.g. a strided last dim, is
    copied first), the last dim a multiple of 8. Differentiable in both.
    Under torch.compile it runs as the custom op torch.ops.tk_mlir.swiglu;
    eager calls launch directly."""
    import torch
    if torch.compiler.is_compiling():
        _check(gate, up)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        return torch.ops.tk_mlir.swiglu(gate, up)
    # eager: a signature seen before was checked then (eager.py)
    key = (eager.tensor_key(gate), eager.tensor_key(up), torch.is_grad_enabled())
    return _SWIGLU.call(key, lambda: _prepare(gate, up), gate, up)


# Eager calls by signature (eager.py).
_SWIGLU = eager.Prepared()


def _prepare(gate, up):
    """After checking an eager call, `run(gate, up)` for calls like it:
    through autograd when it records them."""
    import torch
    _check(gate, up)
    run = planned(gate, up, same_signature=True)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        from tk_mlir.kernels import custom_ops
        back = eager.per_layout(lambda gate, up: planned_backward(gate, up, same_signature=True),
                                2)
        return lambda gate, up: custom_ops.EagerSwiglu.apply(gate, up, run, back)
    return run


def planned(gate, up, same_signature: bool = False):
    """`launch(gate, up)` for checked tensors shaped like gate and up: its
    grid chosen once, and, for (rows, D) operands the kernel reads as they
    lie, no view or copy per call. same_signature: every call's tensors are
    laid out as these (an eager signature's: launches that read the
    tensors' addresses alone, eager.launcher)."""
    shape, d = tuple(gate.shape), gate.shape[-1]
    rows = math.prod(shape[:-1])
    if rows * d == 0:
        return lambda gate, up: gate.new_empty(shape)
    grid, nj = _grid(rows, d)
    kernel = eager.launcher(swiglu_kernel, same_signature)(grid)
    if checks.rows_as_they_lie(gate) and checks.rows_as_they_lie(up):
        def launch_rows(gate, up):
            y = gate.new_empty(shape)
            kernel(gate, up, y, nj)
            return y
        return launch_rows

    def launch_any(gate, up):
        y = gate.new_empty(shape)
        kernel(checks.as_rows(gate), checks.as_rows(up), y.view(rows, d), nj)
        return y
    return launch_any


def launch(gate, up):
    """swiglu_kernel on checked tensors: a new output."""
    return planned(gate, up)(gate, up)


def swiglu_backward(dy, gate, up):
    """(dgate, dup) of swiglu(gate, up) given dy, each a new tensor."""
    return planned_backward(gate, up)(dy, gate, up)


def planned_backward(gate, up, same_signature: bool = False):
    """`run(dy, gate, up) -> (dgate, dup)`, new tensors, for checked tensors
    shaped like gate and up: its grid chosen once. same_signature: gate and
    up are laid out as these on every call (an eager signature's saved
    inputs) and the launch reads addresses alone (eager.launcher); dy, whose
    layout autograd chooses, is copied into a contiguous one of gate's dtype
    where it is not one."""
    import torch
    shape, d, dtype = tuple(gate.shape), gate.shape[-1], gate.dtype
    rows = math.prod(shape[:-1])
    if rows * d == 0:
        return lambda dy, gate, up: (gate.new_empty(shape), gate.new_empty(shape))
    grid, nj = _grid(rows, d)
    kernel = eager.launcher(swiglu_backward_kernel, same_signature)(grid)
    strides = contiguous_strides(shape)
    # (decided once: whether the kernel reads such gate and up as they lie)
    as_they_lie = same_signature and checks.rows_as_they_lie(gate) and \
        checks.rows_as_they_lie(up)

    def run(dy, gate, up):
        if not same_signature:
            dy = checks.as_rows(dy.to(dtype))
        else:
            dy = eager.laid_out(dy, shape, strides, dtype)
        dg, du = (torch.empty(shape, dtype=dtype, device=gate.device) for _ in range(2))
        if not as_they_lie:
            gate, up = checks.as_rows(gate), checks.as_rows(up)
        kernel(gate, up, dy.view(rows, d), dg.view(rows, d), du.view(rows, d), nj)
        return dg, du
    return run


def _grid(rows: int, d: int) -> tuple[tuple[int], int]:
    """The kernels' grid over (rows, d) and its column tiles (tile_of_block)."""
    nj = tk.cdiv(d, BN)
    return (tk.cdiv(rows, BM) * nj,), nj


def _check(gate, up, fn: str = "swiglu") -> None:
    """gate and up as swiglu (or `fn`, its backward op) takes them."""
    import torch
    checks.tensor(fn, "gate", gate, dtypes=(torch.bfloat16, torch.float16))
    if gate.dim() == 0:
        raise ValueError(f"{fn}: gate must have at least one dim, got a 0-d tensor")
    checks.tensor(fn, "up", up, dtypes=(torch.bfloat16, torch.float16))
    checks.like(fn, "up", up, "gate", gate)
    checks.shape(fn, "up", up, tuple(gate.shape), "gate's shape")
    if gate.shape[-1] % 8:
        raise ValueError(f"{fn}: the last dim must be a multiple of 8 (rows of whole "
                         f"16-byte vectors), got shape {tuple(gate.shape)}")
    checks.on_cuda(fn, "gate", gate)
