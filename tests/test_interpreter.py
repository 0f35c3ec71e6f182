"""The CPU interpreter (tk_mlir/interpreter): kernels run on numpy arrays and
CPU torch tensors against float64 numpy references (fresh random inputs,
outputs poisoned with NaN), and what it refuses or finds is reported at the
user's line. Small shapes: the whole file runs in seconds."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.interpreter import InterpretError
from tk_mlir.interpreter.program import Program

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "examples"))


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(got).any(), "an output element was not written"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def line_of(text: str) -> int:
    """The line of this file that holds `text` (a marker comment)."""
    return next(i for i, l in enumerate(HERE.read_text().splitlines(), 1) if text in l)


def softmax_ref(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


# ----------------------------------------------------------------- kernels

def test_quickstart_softmax_on_numpy():
    from quickstart import softmax
    rng = np.random.default_rng()
    m, n, rows = 37, 64, 4                    # a ragged last block: masked rows
    x = (rng.standard_normal((m, n)) * 4).astype(np.float32)
    y = np.full_like(x, np.nan)
    softmax.interpret[(tk.cdiv(m, rows),)](x, y, ROWS=rows, N=n)
    assert rel_err(y, softmax_ref(x.astype(np.float64))) < 1e-6


SOFTMAX_UNDER_THE_ENVIRONMENT = """\
import sys
import numpy as np, torch
sys.path.insert(0, {examples!r})
import softmax as example
x = torch.randn(9, 40) * 3
y = torch.full_like(x, float("nan"))
example.softmax(x, out=y)
ref = torch.softmax(x.double(), -1)
print(((y.double() - ref).norm() / ref.norm()).item())
"""


def test_readme_softmax_through_the_environment(tmp_path):
    """TK_MLIR_INTERPRET=1 (read at a process's first launch): the example's
    launch (kernel[grid]) interprets, on CPU torch tensors, written in place;
    a ragged row (-inf fill)."""
    script = SOFTMAX_UNDER_THE_ENVIRONMENT.format(examples=str(ROOT / "examples"))
    assert under_the_environment(script, tmp_path) < 1e-6


def under_the_environment(script: str, tmp_path) -> float:
    """Run `script` in a child process under TK_MLIR_INTERPRET=1 (read once per
    process); the number its last line prints."""
    import os
    import subprocess
    path = tmp_path / "run.py"
    path.write_text(script)
    env = {**os.environ, "TK_MLIR_INTERPRET": "1", "PYTHONPATH": str(ROOT),
           "TK_MLIR_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


def test_fused_elementwise_example_swiglu():
    from fused_elementwise import swiglu_kernel
    m, n = 45, 264                              # ragged tiles on both axes
    a, b = (torch.randn(m, n).to(torch.bfloat16) for _ in range(2))
    y = torch.full_like(a, float("nan"))
    swiglu_kernel.interpret[(tk.cdiv(m, 32), tk.cdiv(n, 256))](a, b, y)
    af, bf = _bf16(a), _bf16(b)
    assert rel_err(_bf16(y), af / (1 + np.exp(-af)) * bf) < 8e-3


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def test_rms_norm_bf16():
    from tk_mlir.kernels.norms import _block, rmsnorm_kernel
    rows, d, eps = 5, 200, 1e-6               # d < BLOCK: zero fill, masked columns
    x, w = torch.randn(rows, d).to(torch.bfloat16), torch.randn(d).to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    rmsnorm_kernel.interpret[(rows,)](x, w, y, eps, BLOCK=_block(d))
    xf, wf = _bf16(x), _bf16(w)
    ref = xf / np.sqrt((xf * xf).mean(1, keepdims=True) + eps) * wf
    assert rel_err(_bf16(y), ref) < 8e-3      # bf16 output: ~2^-9 relative per element


def test_layer_norm_bf16_persistent_loop():
    from tk_mlir.kernels.norms import _block, layernorm_kernel
    rows, d, eps = 7, 96, 1e-5
    x = (torch.randn(rows, d) * 2 + 1).to(torch.bfloat16)
    w, b = torch.randn(d).to(torch.bfloat16), torch.randn(d).to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    # 3 blocks for 7 rows: each walks rows first, first + 3, ... (an scf.for)
    layernorm_kernel.interpret[(3,)](x, w, b, y, eps, BLOCK=_block(d))
    xf = _bf16(x)
    mean, var = xf.mean(1, keepdims=True), xf.var(1, keepdims=True)
    ref = (xf - mean) / np.sqrt(var + eps) * _bf16(w) + _bf16(b)
    assert rel_err(_bf16(y), ref) < 8e-3


@tk.kernel(num_warps=4)
def causal_mask(X: tk.gl[f32], Y: tk.gl[f32], T: tk.constexpr):
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (T, T), layout="row")
    upper = x.col_indices() > x.row_indices()
    edge = (x.col_indices() == 0) | (x.row_indices() == T - 1)
    y = tk.where(upper, float("-inf"), x)
    tk.store(Y, tk.where(edge, y * 2.0, y), (i, 0))


def test_masks_and_where():
    t, blocks = 64, 2
    x = np.random.default_rng().standard_normal((blocks * t, t)).astype(np.float32)
    y = np.full_like(x, np.nan)
    causal_mask.interpret[(blocks,)](x, y, T=t)
    r, c = np.indices((t, t))
    tile_r = np.tile(r, (blocks, 1))
    tile_c = np.tile(c, (blocks, 1))
    ref = np.where(tile_c > tile_r, -np.inf, x)
    ref = np.where((tile_c == 0) | (tile_r == t - 1), ref * 2, ref)
    assert np.array_equal(y, ref)


@tk.kernel(num_warps=4)
def per_warp(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    """Each warp its own 16-row tile; even warps double, odd warps add the row
    count (a condition that varies by warp: each warp runs one branch)."""
    w = tk.warp_id()
    row = tk.block_id(0) * 4 + w
    x = tk.load(X, (row, 0), (16, 32), scope="warp")
    s = 0.0
    if tk.lane_id() < 7:                      # lanes disagree: both branches, masked
        s = 1.0
    if w % 2 == 0:
        y = x * 2.0
    else:
        y = x + float(n)
    tk.store(Y, y, (row, 0))


def test_thread_varying_if():
    m, n = 16 * 4 * 2 - 5, 32
    x = np.random.default_rng().standard_normal((m, n)).astype(np.float32)
    y = np.full_like(x, np.nan)
    per_warp.interpret[(2,)](x, y, m)
    warp = np.arange(m) // 16 % 4
    ref = np.where((warp % 2 == 0)[:, None], x * 2, x + m)
    assert np.array_equal(y, ref)


@tk.kernel(num_warps=4)
def through_shared(X: tk.gl[f32], Y: tk.gl[f32]):
    s = tk.shared_tile(f32, (16, 64))
    tk.copy(s, X, (tk.block_id(0), 0))
    tk.store(Y, tk.load(s) * 2.0, (tk.block_id(0), 0))


def test_copy_through_a_shared_tile():
    x = np.random.default_rng().standard_normal((48, 64)).astype(np.float32)
    y = np.full_like(x, np.nan)
    through_shared.interpret[(3,)](x, y)
    assert np.array_equal(y, 2 * x)


# The warp-specialized kernels: a producer warpgroup's TMA loads into rings of
# shared tiles, consumers' wgmma, semaphores, named barriers, persistent grids
# (fewer blocks than tasks).

@pytest.mark.parametrize("m, n, k, b_kn, out", [
    (256, 256, 256, False, torch.bfloat16),      # TMA-store epilogue
    (200, 136, 120, False, torch.float32),       # ragged edges, register epilogue
    (256, 264, 192, True, torch.bfloat16),       # B given as K x N
])
def test_warp_specialized_gemm(m, n, k, b_kn, out):
    from tk_mlir.kernels.gemm import gemm_kernel
    a = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(k, n).to(torch.bfloat16) if b_kn else torch.randn(n, k).to(torch.bfloat16)
    c = torch.full((m, n), float("nan"), dtype=out)
    gemm_kernel.kernel.interpret[(2,)](a, b, c, B_KN=b_kn, BN=256, STAGES=4)
    ref = a.double() @ (b.double() if b_kn else b.double().T)
    assert rel_err(c.double().numpy(), ref.numpy()) < 8e-3


@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.integers(1, 300), n=st.integers(1, 40).map(lambda x: 8 * x),
       k=st.integers(1, 30).map(lambda x: 8 * x), bn=st.sampled_from([128, 256]),
       stages=st.integers(2, 4), blocks=st.integers(1, 3), b_kn=st.booleans(),
       seed=st.integers(0, 2**16))
def test_gemm_shapes_tiles_and_schedules(m, n, k, bn, stages, blocks, b_kn, seed):
    """Drawn shapes (16-byte rows, as TMA needs), tile widths, ring depths,
    persistent grids and interleavings (interpreter.SEED)."""
    import tk_mlir.interpreter as interpreter
    from tk_mlir.kernels.gemm import gemm_kernel
    a = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(k, n).to(torch.bfloat16) if b_kn else torch.randn(n, k).to(torch.bfloat16)
    c = torch.full((m, n), float("nan"))
    interpreter.SEED = seed
    try:
        gemm_kernel.kernel.interpret[(blocks,)](a, b, c, B_KN=b_kn, BN=bn, STAGES=stages)
    finally:
        interpreter.SEED = 0
    ref = a.double() @ (b.double() if b_kn else b.double().T)
    assert rel_err(c.double().numpy(), ref.numpy()) < 1e-5     # f32 out: accumulation order


@pytest.mark.parametrize("causal", [False, True])
def test_warp_specialized_attention_gqa(causal):
    import math
    from tk_mlir.kernels.flash_attention import _config, attention_kernel, tasks
    B, H, H_KV, N, D = 1, 4, 2, 200, 64
    q = torch.randn(B, H, N, D).to(torch.bfloat16)
    k, v = (torch.randn(B, H_KV, N, D).to(torch.bfloat16) for _ in range(2))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, 208), float("nan"))
    cfg, scale = _config(D), 1 / math.sqrt(D)
    attention_kernel.interpret[(3,)](q, k, v, o, lse, tasks(q, k, causal, 3),
                                     scale * math.log2(math.e), D=D,
                                     CAUSAL=causal, num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    kk, vv = (t.double().repeat_interleave(H // H_KV, 1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(N, N).triu(1).bool(), float("-inf"))
    assert rel_err(o.double().numpy(), (torch.softmax(s, -1) @ vv).numpy()) < 8e-3
    assert rel_err(lse[..., :N].double().numpy(), torch.logsumexp(s, -1).numpy()) < 1e-5


LIBRARY_UNDER_THE_ENVIRONMENT = """\
import math, torch
from tk_mlir.kernels import attention, matmul
a, b = torch.randn(200, 136).bfloat16(), torch.randn(264, 136).bfloat16()
ref = a.double() @ b.double().T
errors = [(matmul(a, b).double() - ref).norm() / ref.norm()]
q = torch.randn(1, 4, 130, 64).bfloat16().requires_grad_()
k, v = (torch.randn(1, 2, 130, 64).bfloat16().requires_grad_() for _ in range(2))
o = attention(q, k, v, causal=True)
o.backward(torch.ones_like(o))
qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
s = qd @ kd.repeat_interleave(2, 1).transpose(-1, -2) / 8
s = s.masked_fill(torch.ones(130, 130).triu(1).bool(), float("-inf"))
od = torch.softmax(s, -1) @ vd.repeat_interleave(2, 1)
od.backward(torch.ones_like(od))
for x, y in ((o, od), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
    errors.append((x.double() - y).norm() / y.norm())
print(max(float(e) for e in errors))
"""


def test_library_matmul_and_attention_with_backward_on_cpu_tensors(tmp_path):
    """Under TK_MLIR_INTERPRET=1 the library's wrappers take CPU tensors: the
    persistent kernels get a grid of interpreter.SMS simulated SMs; the
    autotuned GEMM runs its first config; attention's backward (dQ by TMA
    reduce-adds) runs through autograd."""
    assert under_the_environment(LIBRARY_UNDER_THE_ENVIRONMENT, tmp_path) < 8e-3


EAGER_CALLS_IMPORT_NO_COMPILER = """\
import sys, torch
from tk_mlir.kernels import (attention, grouped_matmul, layer_norm, matmul, rms_norm,
                             scaled_matmul)
x, w = torch.randn(64, 256).bfloat16(), torch.randn(256).bfloat16()
rms_norm(x, w), layer_norm(x, w, w), matmul(x, x)
grouped_matmul(x.view(2, 32, 256), x.view(2, 32, 256), [32, 5])
f8, one = x.to(torch.float8_e4m3fn), torch.ones(())
scaled_matmul(f8, f8.t(), one, one)
q = torch.randn(1, 2, 64, 64).bfloat16().requires_grad_()
attention(q, q, q, causal=True).sum().backward()
from tk_mlir.kernels import (attention_varlen, attention_with_kvcache, cross_entropy,
                             fused_add_rms_norm, linear_attention, linear_cross_entropy,
                             rotary_embedding, ssd, swiglu)
g = lambda *shape: torch.randn(*shape).bfloat16().requires_grad_()
q, cu = g(40, 2, 64), torch.tensor([0, 15, 40], dtype=torch.int32)
attention_varlen(q, q, q, cu, cu, 25, 25, causal=True).sum().backward()
kc = torch.randn(2, 64, 1, 64).bfloat16()
attention_with_kvcache(g(2, 1, 2, 64).detach(), kc, kc, torch.tensor([5, 9], dtype=torch.int32))
swiglu(g(16, 64), g(16, 64)).sum().backward()
rotary_embedding(g(1, 16, 2, 64), torch.randn(16, 32), torch.randn(16, 32)).sum().backward()
cross_entropy(g(8, 128), torch.randint(0, 128, (8,))).backward()
linear_cross_entropy(g(8, 64), g(128, 64), torch.randint(0, 128, (8,))).backward()
y, r = fused_add_rms_norm(g(8, 64), g(8, 64), g(64))
(y.sum() + r.sum()).backward()
rms_norm(g(8, 64), g(64)).sum().backward()
matmul(g(32, 64), g(48, 64)).sum().backward()
la = g(1, 64, 2, 64)
linear_attention(la, la, la).sum().backward()
xs, bc = g(1, 64, 2, 64), g(1, 64, 1, 64)
ssd(xs, torch.rand(1, 64, 2).requires_grad_(), -torch.rand(2), bc, bc).sum().backward()
print(float(not {"torch._dynamo", "torch._inductor"} & sys.modules.keys()))
"""


def test_eager_library_calls_import_no_compiler(tmp_path):
    """Eager calls of the library's functions (GEMMs, norms, attention in its
    three forms, the training kernels, linear attention, SSD), backwards
    included, launch without the custom ops' dispatch, whose first call
    imports torch._dynamo (seconds)."""
    assert under_the_environment(EAGER_CALLS_IMPORT_NO_COMPILER, tmp_path) == 1.0


@pytest.mark.gpu
def test_interpreter_matches_the_gpu_on_the_same_inputs():
    """The numerics contract (tk_mlir/interpreter/__init__.py) against the GPU:
    the GEMM with f32 output to accumulation order, attention to one bf16
    rounding of the output and f32 transcendentals in the LSE."""
    import math
    from tk_mlir.kernels.flash_attention import _config, attention_kernel, tasks
    from tk_mlir.kernels.gemm import gemm_kernel
    a, b = torch.randn(200, 136).to(torch.bfloat16), torch.randn(264, 136).to(torch.bfloat16)
    outs = []
    for device in ("cuda", "cpu"):
        c = torch.full((200, 264), float("nan"), device=device)
        launch = gemm_kernel.kernel if device == "cuda" else gemm_kernel.kernel.interpret
        launch[(2,)](a.to(device), b.to(device), c, BN=256, STAGES=4)
        outs.append(c.cpu().double())
    assert rel_err(outs[1].numpy(), outs[0].numpy()) < 1e-5

    q = torch.randn(1, 4, 200, 64).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 200, 64).to(torch.bfloat16) for _ in range(2))
    cfg = _config(64)
    outs = []
    for device in ("cuda", "cpu"):
        o = torch.full((1, 4, 200, 64), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((1, 4, 200), float("nan"), device=device)
        launch = attention_kernel if device == "cuda" else attention_kernel.interpret
        launch[(3,)](q.to(device), k.to(device), v.to(device), o, lse,
                     tasks(o, k.to(device), True, 3), math.log2(math.e) / 8, D=64, CAUSAL=True,
                     num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
        outs.append((o.cpu().double(), lse.cpu().double()))
    assert rel_err(outs[1][0].numpy(), outs[0][0].numpy()) < 8e-3
    assert rel_err(outs[1][1].numpy(), outs[0][1].numpy()) < 1e-5


# ------------------------------------------------------------ arguments

def test_arguments_are_checked_as_for_the_gpu():
    from quickstart import softmax
    x = np.zeros((8, 64), np.float16)
    with pytest.raises(tk.ArgumentError, match="dtype f16.*wants f32"):
        softmax.interpret[(2,)](x, x, ROWS=4, N=64)
    with pytest.raises(tk.CompilationError, match="needs 0 coordinates for a rank-0 tensor"):
        softmax.interpret[(2,)](np.zeros((), np.float32), x.astype(np.float32), ROWS=4, N=64)
    with pytest.raises(tk.ArgumentError, match="numpy arrays or CPU torch tensors"):
        softmax.interpret[(2,)]([1.0], [1.0], ROWS=4, N=64)


# ------------------------------------------------------------- memory

@tk.kernel(num_warps=8)
def staged(A: tk.gl, C: tk.gl[f32], SCALE: tk.constexpr):
    """A's 64-row tiles (two: one per stage) in by TMA (semaphores, a loop,
    an if per warpgroup), scaled, out by threads: ops of every kind of rule."""
    st = tk.shared_tiles(A.dtype, (64, 64), 2, swizzle=128)
    full = tk.semaphores(2)
    tiles = tk.cdiv(A.shape[0], 64)
    if tk.warpgroup_id() == 1:
        if tk.elect_leader("warpgroup"):
            for i in range(tiles):
                tk.tma.expect(full[i % 2], st[i % 2])
                tk.tma.load_async(st[i % 2], A, (i, 0), full[i % 2])
    else:
        for i in range(tiles):
            tk.wait(full[i % 2], (i // 2) & 1)
            x = tk.load(st[i % 2], layout="row", scope="warpgroup").to(f32)
            tk.store(C, x * SCALE, (i, 0))


def _mlir_objects(root) -> list:
    """The objects of MLIR's Python bindings that `root` reaches: through
    attributes, containers and closures (not through modules, classes or a
    function's globals, which every function reaches)."""
    import gc
    import types
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        if type(obj).__module__.split(".")[0] in ("mlir", "_mlir"):
            found.append(obj)
            continue
        if isinstance(obj, types.FunctionType):
            todo += [c.cell_contents for c in obj.__closure__ or () if c.cell_contents
                     is not obj] + list(obj.__defaults__ or ())
            continue
        if isinstance(obj, dict) and "__builtins__" in obj:
            continue                                   # a module's globals
        todo += gc.get_referents(obj)
    return found


def test_programs_hold_no_mlir_objects_and_free_their_contexts():
    """A compiled Program is plain data (op locations as file/line/col, what
    each rule needs): the MLIR module and context it was built from are
    freed, however many specializations are kept."""
    import gc
    from mlir import ir
    a = torch.randn(128, 64).to(torch.bfloat16)
    gc.collect()
    live = ir.Context._get_live_count()
    for k in range(12):                         # 12 specializations, each kept
        c = torch.full((128, 64), float("nan"))
        staged.interpret[(1,)](a, c, SCALE=k + 0.5)
        assert rel_err(c.numpy(), a.double().numpy() * (k + 0.5)) < 1e-6
    programs = [p for entries in staged._programs.values() for _, p in entries]
    assert len(programs) == 12
    assert _mlir_objects(programs) == []
    gc.collect()
    assert ir.Context._get_live_count() == live


# ----------------------------------------------------------------- errors

@tk.kernel(num_warps=4)
def in_a_cluster(X: tk.gl[f32]):
    """Block b adds 1 to its rows, and 1 more in rank 1 of its cluster, once
    both blocks of the cluster have read them (tk.cluster_sync)."""
    tk.use_cluster(2)
    b = tk.block_id(0)
    x = tk.load(X, (b, 0), (16, 64))
    tk.cluster_sync()
    if tk.cluster_rank() == 1:
        x = x + 1.0
    tk.store(X, x + 1.0, (b, 0))


def test_clusters_run_their_blocks_together():
    x = np.ones((64, 64), np.float32)
    in_a_cluster.interpret[(4,)](x)
    assert (x.reshape(4, 16, 64)[:, 0, 0] == [2, 3, 2, 3]).all()
    with pytest.raises(InterpretError, match=r"runs in clusters of 2 blocks along x "
                                             r"\(tk.use_cluster\), but the grid is \(3, 1, 1\)"):
        in_a_cluster.interpret[(3,)](np.ones((48, 64), np.float32))


def test_a_cluster_gemm_shares_b_by_multicast():
    """The library GEMM with CLUSTER=2: each block loads half of the B tile
    and multicasts it to both (remote arrivals free the stages)."""
    from tk_mlir.kernels.gemm import gemm_kernel
    torch.manual_seed(0)
    a, b = torch.randn(300, 200).bfloat16(), torch.randn(264, 200).bfloat16()
    c = torch.full((300, 264), float("nan")).bfloat16()
    gemm_kernel.kernel.interpret[(4,)](a, b, c, CLUSTER=2, BN=128, STAGES=4)
    assert rel_err(c.double().numpy(), (a.double() @ b.double().T).numpy()) < 1e-2


@tk.kernel(num_warps=4)
def short_of_bytes(A: tk.gl[f32], CLUSTER: tk.constexpr):
    tk.use_cluster(CLUSTER)
    a = tk.shared_tile(f32, (16, 64))
    s = tk.semaphore(1)
    if tk.warp_id() == 0:
        if tk.elect_leader():
            tk.tma.expect_bytes(s, 2 * 16 * 64 * 4)      # twice what the load brings
            tk.tma.load_async(a, A, (0, 0), s)
    tk.wait(s, 0)


@pytest.mark.parametrize("cluster", [1, 2])
def test_a_semaphore_short_of_bytes_is_named_in_a_cluster_too(cluster):
    """A wait in a cluster steps aside for the other blocks, but when every
    block waits the missing bytes are still the report."""
    with pytest.raises(InterpretError, match=r"transaction-byte mismatch .* armed the phase with "
                                             r"8192 byte\(s\), but the 1 TMA load\(s\) .* add "
                                             r"up to 4096"):
        short_of_bytes.interpret[(cluster,)](np.zeros((16, 64), np.float32), CLUSTER=cluster)


@tk.kernel(num_warps=4)
def load_without_expect(A: tk.gl[f32]):
    a = tk.shared_tile(f32, (16, 64))
    s = tk.semaphore(1)
    if tk.thread_id() == 0:
        tk.tma.load_async(a, A, (0, 0), s)          # no tk.tma.expect: nothing arms the phase
    tk.wait(s, 0)


def test_a_load_no_expect_announced_names_the_missing_expect():
    """The bytes arrive, but the phase waits for the arrival expect makes:
    the report says so, not only the negative byte count."""
    with pytest.raises(InterpretError, match=r"4096 byte\(s\) of the 1 TMA load\(s\) at .* but "
                                             r"no tk.tma.expect armed its phase"):
        load_without_expect.interpret[(1,)](np.zeros((16, 64), np.float32))


@tk.kernel(num_warps=8)
def released_twice(A: tk.gl[f32]):
    s = tk.semaphore(2)                             # two warpgroups release it
    t = tk.semaphore(1)                             # (warpgroup 1 releases after 0's two)
    if tk.elect_leader("warpgroup"):
        if tk.warpgroup_id() == 0:
            tk.arrive(s)
            tk.arrive(s)                            # mistake: warpgroup 0 again
            tk.arrive(t)
        else:
            tk.wait(t, 0)
            tk.arrive(s)
    tk.wait(s, 0)


def test_a_warp_arriving_twice_in_one_phase_is_named():
    """A ring stage released twice by one consumer completes the phase before
    the other consumer is done: named at the second arrival (it was a deadlock
    or a TMA race elsewhere, depending on the schedule)."""
    for seed in range(4):
        with pytest.raises(InterpretError, match=r"warp 0 arrives on semaphore.*again in one "
                                                 r"phase.*a stage released twice"):
            _interpret_seeded(released_twice, seed)


@tk.kernel(num_warps=4)
def arrives_for_two(A: tk.gl[f32]):
    s = tk.semaphore(2)
    if tk.thread_id() == 0:
        for i in tk.static_range(2):                # one line counting two arrivals
            tk.arrive(s)
    tk.wait(s, 0)


def test_one_line_arriving_in_a_loop_may_count_several():
    arrives_for_two.interpret[(1,)](np.zeros((4, 4), np.float32))


def _interpret_seeded(kernel, seed):
    from tk_mlir import interpreter
    old, interpreter.SEED = interpreter.SEED, seed
    try:
        kernel.interpret[(1,)](np.zeros((4, 4), np.float32))
    finally:
        interpreter.SEED = old


@tk.kernel(num_warps=4)
def into_an_ended_block(A: tk.gl[f32]):
    """Block 1 tells block 0 to go on and ends; block 0 then multicasts into it."""
    tk.use_cluster(2)
    a = tk.shared_tile(f32, (16, 64))
    loaded, go = tk.semaphore(1), tk.semaphore(1)
    tk.cluster_sync()
    if tk.cluster_rank() == 1:
        if tk.warp_id() == 0:
            if tk.elect_leader():
                tk.arrive(go, cta=0)
    else:
        tk.wait(go, 0)
        if tk.warp_id() == 0:
            if tk.elect_leader():
                tk.tma.expect(loaded, a)
                tk.tma.load_async(a, A, (0, 0), loaded, multicast=3)   # MARK: into ended
        tk.wait(loaded, 0)


def test_reaching_a_block_of_the_cluster_that_has_ended_is_reported():
    with pytest.raises(InterpretError, match=r"this multicast TMA load acts on block \(1, 0, 0\) "
                                             r"of the cluster, which has already ended") as e:
        into_an_ended_block.interpret[(2,)](np.random.rand(16, 64).astype(np.float32))
    assert e.value.line == line_of("MARK: into ended")


@tk.kernel(num_warps=4)
def store_in_divergent_lanes(X: tk.gl[f32]):
    t = tk.load(X, (0, 0), (16, 64))
    if tk.lane_id() < 16:
        tk.store(X, t + 1.0, (0, 0))          # MARK: divergent store


def test_tile_op_under_lane_divergence_is_reported():
    """(tk-lint also warns of it when the kernel compiles for a GPU:
    tests/test_lint.py)"""
    x = np.zeros((16, 64), np.float32)
    with pytest.raises(InterpretError, match="only lanes .*0, 1,.* active") as e:
        store_in_divergent_lanes.interpret[(1,)](x)
    assert e.value.line == line_of("MARK: divergent store")


@tk.kernel(num_warps=4)
def barrier_in_warp_0():
    if tk.warp_id() == 0:
        tk.barrier()                          # MARK: partial barrier


def test_partial_barrier_is_refused_by_tk_verify_at_its_line():
    """tk-verify refuses it before anything runs (the interpreter runs the IR
    after the tk passes)."""
    with pytest.raises(tk.CompilationError, match="synchronises the whole block") as e:
        barrier_in_warp_0.interpret[(1,)]()
    assert e.value.line == line_of("MARK: partial barrier")


@tk.kernel(num_warps=8)
def named_barrier_under(HOW: tk.constexpr):
    if HOW == "warp leader":
        if tk.elect_leader():
            tk.named_barrier(1, warps=4)      # MARK: lanes apart
    elif HOW == "lane":
        if tk.lane_id() < 16:
            tk.named_barrier(1, warps=8)      # MARK: half a warp
    else:                                     # a warpgroup's own barrier: fine
        if tk.warpgroup_id() == 1:
            tk.named_barrier(1, warps=4)


@pytest.mark.parametrize("how, mark", [("warp leader", "lanes apart"), ("lane", "half a warp")])
def test_a_named_barrier_under_a_lane_branch_is_refused_at_its_line(how, mark):
    """bar.sync / bar.arrive take whole warps: under control flow that splits
    a warp's lanes (an elect, the lane id) tk-verify refuses them; under a
    warp or warpgroup branch they stay allowed."""
    with pytest.raises(tk.CompilationError, match="lanes of one warp") as e:
        named_barrier_under.interpret[(1,)](HOW=how)
    assert e.value.line == line_of(f"MARK: {mark}")
    named_barrier_under.interpret[(1,)](HOW="warpgroup")


# The same kernel's IR, past tk-verify (as if the check had missed it): the
# interpreter's rendezvous finds warps 1-3 returned while warp 0 waits.
PARTIAL_BARRIER_IR = """
module {
  func.func @k() attributes {tk.num_warps = 4 : i64, tk.smem_bytes = 0 : i64} {
    %w = "tk.warp_id"() : () -> i32 loc("kernel.py":3:8)
    %c0 = arith.constant 0 : i32 loc("kernel.py":3:8)
    %is0 = arith.cmpi eq, %w, %c0 : i32 loc("kernel.py":3:8)
    scf.if %is0 {
      "tk.barrier"() : () -> () loc("kernel.py":4:9)
    } loc("kernel.py":3:5)
    return loc("kernel.py":1:1)
  } loc("kernel.py":1:1)
}
"""


def test_barrier_reached_by_some_warps_is_reported_at_its_line():
    from mlir import ir
    from tk_mlir.dialects import tk as tk_dialect
    context = ir.Context()
    tk_dialect.load(context)
    with context:
        module = ir.Module.parse(PARTIAL_BARRIER_IR)
    program = Program(context, module)
    with pytest.raises(InterpretError, match=r"warp 0 of block \(0, 0, 0\) reached this "
                                             r"block-scope op, but warp 1 has returned") as e:
        program.run((1, 1, 1), [])
    assert (e.value.filename, e.value.line) == ("kernel.py", 4)


AUTOTUNED_UNDER_THE_ENVIRONMENT = """\\
import numpy as np
import tk_mlir as tk
from tk_mlir import f32


@tk.autotune(configs=[tk.Config(ROWS=4), tk.Config(ROWS=8)], key=["X"])
@tk.kernel(num_warps=4)
def double(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.constexpr = 4):
    x = tk.load(X, (tk.block_id(0), 0), (ROWS, 64))
    tk.store(Y, x + x, (tk.block_id(0), 0))


x = np.random.rand(16, 64).astype(np.float32)
y = np.full_like(x, np.nan)
double[(4,)](x, y)          # the first config (ROWS=4): 4 blocks cover 16 rows
print(float(np.abs(y - 2 * x).max()))
"""


def test_autotuned_kernels_interpret_with_their_first_config(tmp_path):
    """Under TK_MLIR_INTERPRET=1 an autotuned kernel runs its first config on
    the CPU, untimed (no GPU, no tuning)."""
    assert under_the_environment(AUTOTUNED_UNDER_THE_ENVIRONMENT, tmp_path) == 0.0


@tk.kernel(num_warps=4)
def replicated_store(X: tk.gl[bf16], Y: tk.gl[bf16], R: tk.constexpr, C: tk.constexpr):
    a = tk.shared_tile(bf16, (R, C), swizzle=32)
    t = tk.load(X, (0, 0), (R, C)).to(f32)
    tk.store(a, (t * 2.0).to(bf16))
    tk.barrier()
    tk.copy(Y, a, (0, 0))


@pytest.mark.parametrize("r, c", [(16, 16), (48, 16), (16, 64)])
def test_a_tile_replicated_across_warps_is_stored_by_its_first_replica_only(r, c):
    """A block tile too small for its warps (16x16 over 4: every warp holds it
    all) is written to shared memory by warp 0 only, as the GPU does
    (is_first_replica): not a race between the copies."""
    x = torch.rand(r, c).bfloat16()
    y = torch.full_like(x, float("nan"))
    replicated_store.interpret[(1,)](x, y, R=r, C=c)
    assert torch.equal(y, (x.float() * 2).bfloat16())


@tk.kernel(num_warps=4)
def counts_entries(T: tk.gl["i32"], Y: tk.gl[f32]):
    tk.store(Y, tk.full((16,), 1.0) * (T.shape[0] + T.shape[1]), (0,))


def test_an_i32_tensors_shape_is_readable():
    """X.shape of an i32 tensor (counters, a table) is a run-time extent like
    any other; only tile loads, stores, TMA and MMA refuse i32 tensors."""
    t = torch.randint(0, 9, (37, 12), dtype=torch.int32)
    y = torch.full((16,), float("nan"))
    counts_entries.interpret[(1,)](t, y)
    assert torch.equal(y, torch.full((16,), 49.0))
    ptx = counts_entries.compile(tk.spec((37, 12), "i32"), tk.spec((16,), f32)).asm["ptx"]
    assert "st.global" in ptx


@tk.kernel(num_warps=4)
def absolute_values(X: tk.gl[tk.f32], N: tk.gl[tk.i32], Y: tk.gl[tk.f32], Z: tk.gl[tk.i32],
                    W: tk.gl[tk.f32]):
    tk.store(Y, abs(tk.load(X, (0,), (128,))), (0,))
    tk.store(Z, tk.zeros((128,), tk.f32).indices() * 0 + abs(tk.load(N, (0,))), (0,))
    tk.store(W, tk.zeros((128,), tk.f32) + abs(tk.load(X, (1,))), (0,))


def test_abs_of_tiles_and_scalars():
    """The builtin abs() as max() and min() are: a tile's .abs(), a scalar's
    absolute value (i32 and f32); compiled and interpreted."""
    x = (np.random.default_rng(0).standard_normal(128) * 3).astype(np.float32)
    x[1] = -2.5
    y, w = np.full(128, np.nan, np.float32), np.full(128, np.nan, np.float32)
    z = np.zeros(128, np.int32)
    absolute_values.interpret[(1,)](x, np.array([-7, 0, 0, 0], np.int32), y, z, w)
    assert np.array_equal(y, np.abs(x)) and (z == 7).all() and (w == 2.5).all()
    absolute_values.compile(tk.spec((128,), tk.f32), tk.spec((4,), "i32"),
                            tk.spec((128,), tk.f32), tk.spec((128,), "i32"),
                            tk.spec((128,), tk.f32))


@tk.kernel(num_warps=4)
def counting_down(N: tk.gl[tk.i32], Y: tk.gl[tk.i32]):
    s = 0
    for i in range(7, -1, -3):                   # 7, 4, 1
        s = s * 10 + i
    t = 0
    for i in range(tk.load(N, (0,)) - 1, -1, -2):   # run-time bounds: 4, 2, 0 for N=5
        t = t * 10 + i
    u = 0
    for i in range(0, tk.load(N, (0,)), -1):        # no iteration
        u = u + 1
    row = tk.zeros((128,), f32).indices()
    tk.store(Y, tk.where(row == 0, row * 0 + s, tk.where(row == 1, row * 0 + t, row * 0 + u)),
             (0,))


def test_a_range_with_a_negative_step_counts_down():
    y = np.full(128, -1, np.int32)
    counting_down.interpret[(1,)](np.array([5, 0, 0, 0], np.int32), y)
    assert y[:3].tolist() == [741, 420, 0]
    counting_down.compile(tk.spec((4,), "i32"), tk.spec((128,), "i32"))


@tk.kernel(num_warps=4)
def _divided_by_powers_of_two(OUT: tk.gl[f32], OFFSET: int):
    """Row b: floor division and modulo of the run-time int b + OFFSET by
    4, 1, 64 and 3 (the last not a power of two), as floats."""
    b = tk.block_id(0)
    i = b + OFFSET
    for c, v in enumerate((i // 4, i % 4, i // 1, i % 1, i // 64, i % 64, i // 3, i % 3)):
        tk.store(OUT, tk.zeros((1, 16), f32) + float(v), (b, c))


def test_division_by_a_power_of_two_keeps_python_semantics_as_a_shift_and_a_mask():
    """By 2**k, // and % of a run-time int are an arithmetic shift and a mask
    (no floordivsi or remsi in the IR: one instruction each, where a ring's
    slot and phase are computed every step), and equal Python's for
    negative values too."""
    n, offset = 200, -137
    out = np.full((n, 8 * 16), np.nan, np.float32)
    _divided_by_powers_of_two.interpret[(n,)](out, offset)
    i = np.arange(n) + offset
    want = np.stack([i // 4, i % 4, i // 1, i % 1, i // 64, i % 64, i // 3, i % 3], 1)
    assert np.array_equal(out.reshape(n, 8, 16), np.repeat(want[:, :, None], 16, 2))
    ir_text = _divided_by_powers_of_two.compile(
        tk.spec((n, 8 * 16), tk.f32), offset).asm["tk"]
    assert ir_text.count("arith.floordivsi") == 1 and ir_text.count("arith.remsi") == 1
    assert "arith.shrsi" in ir_text


@tk.kernel(num_warps=1)
def count_by(Y: tk.gl[f32], start: int, step: int):
    acc = tk.zeros((16,), f32, scope="warp")
    for i in range(start, 0, step):
        acc = acc + 1.0
    tk.store(Y, acc, (0,))


@pytest.mark.parametrize("start, step, gpu", [(4, -1, "run no iterations"),
                                              (-4, -1, "never end"), (-4, 0, "never end"),
                                              (4, 0, "run no iterations")])
def test_a_run_time_step_that_is_not_positive_is_refused(start, step, gpu):
    """scf.for steps forward: with a run-time step of 0, or a negative one
    and a start off the stop, the GPU's loop differs from Python's range, so
    the interpreter refuses it at the loop (a compile-time negative step
    counts down, as Python's)."""
    y = torch.full((16,), float("nan"))
    with pytest.raises(InterpretError, match=rf"the range's step is {step} at run time: .* "
                                             rf"would {gpu}") as e:
        count_by.interpret[(1,)](y, start, step)
    assert e.value.line == count_by.fn.__code__.co_firstlineno + 3
    count_by.interpret[(1,)](y, -5, 2)
    assert (y == 3.0).all()
    count_by.interpret[(1,)](y, 0, -1)          # no iterations on either: allowed
    assert (y == 0.0).all()
