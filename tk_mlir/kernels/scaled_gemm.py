"""scaled_matmul: an fp8 Hopper GEMM with scales, as torch._scaled_mm.

C = (A @ B) * scale_a * scale_b for A (M x K) and B (K x N) in fp8 (e4m3 or
e5m2), B given column-major (its transpose Bt, N x K, contiguous: the layout
of a Linear weight), f32 accumulation, bf16, f16 or f32 output. The scales are
per tensor (one value each) or per row of A (M) and per column of B (N).

The kernels are the bf16 GEMM's (gemm.gemm with SCALES: a TMA ring, a
consumer warpgroup on wgmma per 64 rows of a tile, a producer warpgroup, a
persistent grid in L2-friendly groups; the same plans, `plan`: the autotuned
128 x 256 tiles, smaller ones, or split-K for few rows) with 8-bit operands:
wgmma reads them K-major only, so A and Bt both arrive with
K along their 128-byte swizzled rows, BK = 128 elements deep per stage, and
k32 instructions, accumulating in wgmma's f32 accumulator only, as
torch._scaled_mm(use_fast_accum=True) does (wgmma adds fp8 products with
fewer bits than f32; torch's default promotes partial sums on the side).
The scales are applied to the f32 accumulator in the epilogue: the row scale
for the whole tile, the column scale EPI_N columns at a time as the tile
leaves (split-K: the whole tile, before its part is added), from plain vector
loads; per-tensor scales are read as they are (0-d tensors), so an eager call
with them launches the kernel and nothing else.
"""
from __future__ import annotations

import functools
from types import MappingProxyType

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import blackwell_gemm, checks, eager, gemm
from tk_mlir.kernels.device import is_blackwell, num_sms


@tk.autotune(configs=[tk.Config(BN=256, STAGES=4), tk.Config(BN=256, STAGES=4, GROUP_M=16),
                      tk.Config(BN=128, STAGES=6)],
             key=["A", "Bt", "C", "SA", "SB"])
@tk.kernel(num_warps=12)      # consumers: warpgroups 0 .. BM/64 - 1; the last one loads
def scaled_gemm_kernel(A: tk.gl, Bt: tk.gl, C: tk.gl, SA: tk.gl[f32], SB: tk.gl[f32],
                       BM: tk.constexpr = 128, BN: tk.constexpr = 256, BK: tk.constexpr = 128,
                       STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                       EPI_N: tk.constexpr = 128, EPI_BUFFERS: tk.constexpr = 1):
    """C = (A @ Bt.T) * SA * SB for fp8 A (M x K) and Bt (N x K) (`gemm` with
    SCALES). Each scale is one value (a 0-d tensor) or a vector: SA one per
    row of C (at least M values), SB one per column (at least N). BM=64
    takes num_warps=8."""
    gemm.gemm(A, Bt, C, False, BM, BN, BK, STAGES, GROUP_M, True, EPI_N, 1,
              EPI_BUFFERS=EPI_BUFFERS, SCALES=(SA, SB))


@tk.kernel(num_warps=8)
def scaled_split_k_kernel(A: tk.gl, Bt: tk.gl, C: tk.gl, SA: tk.gl[f32], SB: tk.gl[f32],
                          W: tk.gl[f32], F: tk.gl["i32"], SPLIT_K: tk.constexpr,
                          BM: tk.constexpr = 64, BN: tk.constexpr = 128, BK: tk.constexpr = 128,
                          STAGES: tk.constexpr = 8, GROUP_M: tk.constexpr = 8):
    """scaled_gemm_kernel with K cut into SPLIT_K slices, each part scaled
    before it is added (gemm.gemm_split_k_kernel's W and F: zeros, and left
    zeros). For few rows, where 128 x 256 tiles leave most SMs idle."""
    gemm.gemm(A, Bt, C, False, BM, BN, BK, STAGES, GROUP_M, False, 128, 1, SPLIT_K, W, F,
              SCALES=(SA, SB))


def scaled_matmul(a, b, scale_a, scale_b, out_dtype=None):
    """(a @ b) * scale_a * scale_b in f32, returned as out_dtype, as
    torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype) computes it
    (with use_fast_accum=True: the products accumulate in wgmma's f32), except
    that out_dtype=None means bf16 here (torch returns the fp8 input dtype,
    which this kernel does not produce).

    a: (M, K) row-major, b: (K, N) column-major (b = bt.t() for a contiguous
    (N, K) bt), each torch.float8_e4m3fn or torch.float8_e5m2 (any pair), on
    one CUDA device; K a multiple of 16. scale_a, scale_b: torch.float32
    tensors on that device (dequantization scales, multiplied in), each per
    tensor (shape (), (1,) or (1, 1)) or rowwise: per row of a (M, 1), per column of
    b (1, N) (torch._scaled_mm takes both per tensor or both rowwise).
    out_dtype: torch.bfloat16 (the default), torch.float16 or torch.float32;
    N a multiple of 8 (16-bit) or 4 (f32): rows of whole 16-byte vectors.
    Returns a new (M, N) tensor. `plan` picks the kernel per shape (the
    autotuned one picks its configuration on first use). Not differentiable:
    an input that requires grad
    (with grad mode on) is refused rather than cut from the graph.

    Under torch.compile it runs as the custom op torch.ops.tk_mlir.scaled_matmul
    (tk_mlir/kernels/custom_ops.py); eager calls launch directly."""
    import torch
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if torch.compiler.is_compiling():
        _checked_call(a, b, scale_a, scale_b, out_dtype)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        return torch.ops.tk_mlir.scaled_matmul(a, b, scale_a, scale_b, out_dtype)
    # eager: a signature seen before was checked then (eager.py)
    key = (eager.tensor_key(a), eager.tensor_key(b), eager.tensor_key(scale_a),
           eager.tensor_key(scale_b), eager.option_key(out_dtype), torch.is_grad_enabled())
    return _PREPARED.call(key, lambda: _prepare(a, b, scale_a, scale_b, out_dtype),
                          a, b, scale_a, scale_b)


# Eager calls by signature (eager.py).
_PREPARED = eager.Prepared()


def _checked_call(a, b, scale_a, scale_b, out_dtype) -> None:
    """check, and the refusal of an input that requires grad."""
    import torch
    check(a, b, scale_a, scale_b, out_dtype, device=False)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (a, b, scale_a, scale_b)):
        raise RuntimeError("scaled_matmul: not differentiable (its gradients are not built); "
                           "an input requires grad: call it under torch.no_grad() or detach "
                           "the inputs")
    checks.on_cuda("scaled_matmul", "a", a)


def _prepare(a, b, scale_a, scale_b, out_dtype):
    """After checking an eager call, the function launching calls like it:
    where the kernels read a and b as they lie (kernel_operand would not
    copy them) and there is a product, a launch planned for this signature
    (gemm.plan_launcher's); else `launch`, which copies per call."""
    _checked_call(a, b, scale_a, scale_b, out_dtype)
    (M, K), N = a.shape, b.shape[1]
    bt = b.t()
    if is_blackwell(a.get_device()) or not (M and N and K) or \
            checks.kernel_operand(a) is not a or checks.kernel_operand(bt) is not bt:
        return lambda a, b, scale_a, scale_b: launch(a, b, scale_a, scale_b, out_dtype)
    product = _product(M, N, K, num_sms(a.get_device()), same_signature=True)
    # (0-d per-tensor scales are what the kernels read: no per-call views)
    scales = scale_operands if scale_a.dim() or scale_b.dim() else lambda sa, sb: (sa, sb)

    def run(a, b, scale_a, scale_b):
        c = a.new_empty((M, N), dtype=out_dtype)
        product(a, b.t(), c, *scales(scale_a, scale_b))
        return c
    return run


def check(a, b, scale_a, scale_b, out_dtype, *, device: bool = True) -> None:
    """The arguments of scaled_matmul, each rule with the argument that breaks it
    (with `device`, the CUDA device's last)."""
    import torch
    fn, fp8 = "scaled_matmul", (torch.float8_e4m3fn, torch.float8_e5m2)
    checks.tensor(fn, "a", a, ndim=2, dtypes=fp8)
    checks.tensor(fn, "b", b, ndim=2, dtypes=fp8)
    checks.like(fn, "b", b, "a", a, dtype=False)
    (M, K), (Kb, N) = a.shape, b.shape
    if Kb != K:
        raise ValueError(f"{fn}: inner dimensions differ: a is {tuple(a.shape)} (M x K), "
                         f"b is {tuple(b.shape)} (K x N)")
    # wgmma reads 8-bit operands with K along memory rows only (no transpose).
    if a.stride(1) != 1 and K > 1:
        raise ValueError(f"{fn}: a must be row-major (M x K, stride 1 along K), got strides "
                         f"{a.stride()}; pass a.contiguous()")
    if b.stride(0) != 1 and K > 1:
        raise ValueError(f"{fn}: b must be column-major (K x N, stride 1 along K: b = bt.t() "
                         f"for a contiguous N x K bt), got strides {b.stride()}; pass "
                         f"b.t().contiguous().t()")
    if K % 16:
        raise ValueError(f"{fn}: K (a.shape[1]) must be a multiple of 16, as torch._scaled_mm "
                         f"requires (TMA reads rows of whole 16-byte vectors), got {K}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{fn}: out_dtype must be torch.bfloat16, torch.float16 or "
                        f"torch.float32, got {out_dtype}")
    per_row = 4 if out_dtype == torch.float32 else 8
    if N % per_row:
        raise ValueError(f"{fn}: N (b.shape[1]) must be a multiple of {per_row} for "
                         f"out_dtype={out_dtype} (output rows of whole 16-byte vectors), "
                         f"got {N}")
    _scale(fn, "scale_a", scale_a, a, (M, 1), "M x 1: one per row of a")
    _scale(fn, "scale_b", scale_b, a, (1, N), "1 x N: one per column of b")
    if device:
        checks.on_cuda(fn, "a", a)


def _scale(fn: str, name: str, s, a, rowwise: tuple, what: str) -> None:
    """A scale is an f32 tensor on a's device, per tensor or rowwise."""
    import torch
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(s).__name__}")
    if s.dtype != torch.float32:
        raise TypeError(f"{fn}: {name} must be torch.float32, got {s.dtype}")
    checks.like(fn, name, s, "a", a, dtype=False)
    if tuple(s.shape) not in ((), (1,), (1, 1), rowwise):
        raise ValueError(f"{fn}: {name} must have shape (), (1,) or (1, 1) (per tensor) or "
                         f"{rowwise} ({what}), got {tuple(s.shape)}")


def output_shape(a, b) -> tuple[int, int]:
    """(M, N) of the result for checked a, b."""
    return a.shape[0], b.shape[1]


def launch(a, b, scale_a, scale_b, out_dtype):
    """scaled_gemm_kernel on checked tensors, into a new tensor (on Blackwell,
    blackwell_gemm's kernel)."""
    import torch
    if is_blackwell(a.get_device()):
        return blackwell_gemm.launch_scaled(a, b, scale_a, scale_b, out_dtype)
    (M, K), N = a.shape, b.shape[1]
    if not (M and N and K):
        return torch.zeros((M, N), dtype=out_dtype, device=a.device)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    # (a view whose rows are not 16-byte aligned, e.g. a column slice: an aligned copy)
    _launcher(M, N, K, num_sms(a.get_device()))(
        checks.kernel_operand(a), checks.kernel_operand(b.t()), c,
        *scale_operands(scale_a, scale_b))
    return c


def _product(M: int, N: int, K: int, sms: int, same_signature: bool = False):
    """`product(a, bt, c, sa, sb)`: the launch of `plan(M, N, K, sms)` on
    operands the kernels read (same_signature: an eager signature's, every
    call's tensors laid out as the first's: gemm.plan_launcher's)."""
    return gemm.plan_launcher(plan(M, N, K, sms), scaled_gemm_kernel, scaled_split_k_kernel, sms,
                              same_signature)


# `launch`'s, made once per shape and shared by its calls of any layout.
_launcher = functools.lru_cache(maxsize=256)(_product)


# Few rows (M <= SMALL_M) take 64 x 128 tiles, and K in slices only when
# those tiles fill at most a quarter of the SMs and K holds SPLIT_MIN_STEPS
# 128-deep steps per slice for at least 4 slices. Fitted to one sweep of
# every (tile, split) candidate at five shapes (H200, BENCHMARKS.md, "FP8
# GEMM with few rows"): unlike bf16, a split rarely paid there.
SMALL_M = 256
SPLIT_MIN_STEPS = 8


@functools.lru_cache(maxsize=1024)
def plan(M: int, N: int, K: int, sms: int) -> gemm.Plan:
    """The fp8 kernel for an M x N x K product: the autotuned 128 x 256 tiles
    when they keep the SMs busy; few rows: 64 x 128 tiles, split-K
    (scaled_split_k_kernel) when they leave most SMs idle and K is long;
    otherwise the bf16 GEMM's rules (gemm.rules_plan) on the same bytes (K
    steps of 128 one-byte elements)."""
    chosen = gemm.rules_plan(M, N, K, sms, bk=128)
    if chosen.kernel not in ("tiles", "split_k") or M > SMALL_M:
        return chosen
    tiles, steps = tk.cdiv(M, 64) * tk.cdiv(N, 128), tk.cdiv(K, 128)
    config = gemm.tile_config(64, 128)
    why = f"M={M} <= {SMALL_M} rows (fp8): {tiles} tiles of 64 x 128"
    parts = min(sms // tiles, steps // SPLIT_MIN_STEPS)
    if 4 * tiles <= sms and parts >= 4:
        return gemm.Plan("split_k", MappingProxyType({**config, "SPLIT_K": parts}),
                         f"{why} fill at most a quarter of {sms} SMs: K in {parts} slices")
    return gemm.Plan("tiles", MappingProxyType(config), why)


def scale_operands(scale_a, scale_b):
    """(SA, SB) as the kernels read checked scales: a per-tensor scale as a
    0-d tensor (itself, or a view of its one value), rowwise ones as vectors
    of M and N values (views when contiguous and 16-byte aligned, else
    copies), the rows' padded to a multiple of 4 (kernel vectors are rows of
    whole 16-byte vectors; N is one already). No arithmetic on the scales: a
    per-tensor pair is multiplied in the kernel."""
    import torch
    if scale_a.dim() == 2 and scale_a.numel() > 1:      # ((1, 1): one value, as () is)
        sa = scale_a.reshape(-1)
        sa = torch.nn.functional.pad(sa, (0, -len(sa) % 4)) if len(sa) % 4 else \
            checks.kernel_operand(sa)
    else:
        sa = scale_a.reshape(()) if scale_a.dim() else scale_a
    if scale_b.dim() == 2 and scale_b.numel() > 1:
        sb = checks.kernel_operand(scale_b.reshape(-1))
    else:
        sb = scale_b.reshape(()) if scale_b.dim() else scale_b
    return sa, sb
