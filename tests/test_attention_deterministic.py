"""attention(..., deterministic=True): the backward adds into each dQ tile in
one order (K/V block by K/V block, counted on per-tile counters in global
memory), so dq is the same bits on every run.

Without a GPU: the kernel in the interpreter (float64 reference, the same
bits on other grids and schedules, no race, no deadlock; a task table out of
order is the deadlock the interpreter reports), the task tables' order, the
PTX, the plumbing through the custom op and the argument check. With one
(`-m gpu`): the gradients twice, bitwise, eagerly, under torch.compile and in
a CUDA graph, and against float64.
"""
from __future__ import annotations

import math
import re

import pytest

import tk_mlir as tk
from test_attention import compile_backward

torch = pytest.importorskip("torch")
gpu = pytest.mark.gpu


def _reference_grads(q, k, v, do, causal, scale):
    """dq, dk, dv of the float64 softmax (bottom-right causal; a row that sees
    no key outputs 0)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    n, n_kv = s.shape[-2:]
    visible = torch.ones(n, n_kv, dtype=torch.bool, device=s.device)
    if causal:
        visible = torch.arange(n_kv, device=s.device)[None, :] <= \
            torch.arange(n, device=s.device)[:, None] + (n_kv - n)
    p = torch.softmax(s.masked_fill(~visible, -1e300), -1) * visible.any(-1, keepdim=True)
    (p @ v.repeat_interleave(group, 1)).backward(do.double())
    return q.grad, k.grad, v.grad


def _relative_error(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------ in the interpreter

def _interpret(q, k, v, do, causal, grid, deterministic, **constexprs):
    """The forward, then the backward as flash_attention.attention_backward
    launches it (constexprs over its configuration), in the interpreter on
    `grid` blocks; (dq, dk, dv), dq in f32."""
    from tk_mlir.kernels import flash_attention as fa
    B, H, N, D = q.shape
    scale, n4 = 1 / math.sqrt(D), -(-N // 4) * 4
    cfg = fa._config(D)
    o, lse = torch.empty_like(q), torch.empty(B, H, n4)
    fa.attention_kernel.interpret[(grid,)](
        q, k, v, o, lse, fa.tasks(q, k, causal, grid), scale * fa.LOG2E, D=D, CAUSAL=causal,
        num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    shift, neg_delta = torch.empty(B, H, n4), torch.empty(B, H, n4)
    dq = torch.full((B, H, N, D), float("nan"))
    fa.attention_backward_prep_kernel.interpret[(tk.cdiv(N, 64), H, B)](
        o, do, lse, neg_delta, neg_delta, shift, dq, math.log(scale), 1 / scale, D=D)  # (no dLSE)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    fa.attention_backward_kernel.interpret[(grid,)](
        q, k, v, do, shift, neg_delta, dq, dk, dv,
        fa.backward_tasks(q, k, causal, grid, deterministic),
        scale * fa.LOG2E, 1 / scale, D=D, CAUSAL=causal, DETERMINISTIC=deterministic,
        **{**fa._backward_config(D), **constexprs})
    return dq, dk, dv


def _inputs(b, h, h_kv, n, n_kv, d, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    q, do = (torch.randn(b, h, n, d, generator=g, device=device).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, h_kv, n_kv, d, generator=g, device=device).bfloat16()
            for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("b, h, h_kv, n, n_kv, d, causal", [
    (1, 2, 1, 200, 300, 64, True),       # GQA, ragged, N < N_kv
    (1, 2, 2, 130, 250, 128, False),     # D=128: each warpgroup adds half the columns
    (1, 4, 2, 150, 100, 128, True),      # N > N_kv: the first rows see no key
    (2, 1, 1, 64, 200, 64, False),
])
def test_deterministic_backward_in_the_interpreter(b, h, h_kv, n, n_kv, d, causal, monkeypatch):
    """The float64 gradients, and the same bits from another grid (another
    task table) under another interleaving; the interpreter's race and
    deadlock checks pass."""
    from tk_mlir import interpreter
    q, k, v, do = _inputs(b, h, h_kv, n, n_kv, d, seed=n + n_kv + d + causal)
    grads = _interpret(q, k, v, do, causal, 3, True)
    for name, got, ref in zip(("dq", "dk", "dv"), grads,
                              _reference_grads(q, k, v, do, causal, 1 / math.sqrt(d))):
        assert not got.isnan().any(), name
        assert _relative_error(got, ref) < 1e-2, name
    monkeypatch.setattr(interpreter, "SEED", 1)
    for name, a, b in zip(("dq", "dk", "dv"), grads, _interpret(q, k, v, do, causal, 2, True)):
        assert torch.equal(a, b), name


def test_a_task_table_out_of_order_deadlocks_in_the_interpreter(monkeypatch):
    """Why the table must list a head's K/V blocks in order: one block running
    K/V block 1 before block 0 waits for a turn that never comes."""
    import numpy as np
    from tk_mlir.interpreter import InterpretError
    from tk_mlir.kernels import flash_attention as fa
    from tk_mlir.kernels import schedule
    q, k, v, do = _inputs(1, 1, 1, 64, 256, 64, seed=5)
    table = torch.from_numpy(schedule.table(np.array([1, 0]), np.ones(2), 1))
    monkeypatch.setattr(fa, "backward_tasks", lambda q, k, causal, grid, deterministic: torch.cat(
        (table, torch.zeros(fa.dq_counters(1, 1, 64), dtype=torch.int32))))
    with pytest.raises(InterpretError, match="deadlock"):
        _interpret(q, k, v, do, False, 1, True)


def _topological_order_exists(table, grid, n_tasks, kv_blocks) -> bool:
    """Is there one order of all tasks in which every block's tasks come in
    its order and every head's K/V blocks come in increasing order? (Then a
    task waits only on tasks before it in that order: no deadlock.)"""
    offsets = table[:grid + 1]
    after = {t: [] for t in range(n_tasks)}
    for blk in range(grid):
        tasks = table[offsets[blk]:offsets[blk + 1]].tolist()
        for a, b in zip(tasks, tasks[1:]):
            after[a].append(b)
    for t in range(n_tasks):
        if (t + 1) % kv_blocks:
            after[t].append(t + 1)          # (head, kvb) before (head, kvb + 1)
    waiting = {t: 0 for t in range(n_tasks)}
    for t in after:
        for u in after[t]:
            waiting[u] += 1
    ready = [t for t in range(n_tasks) if waiting[t] == 0]
    seen = 0
    while ready:
        t = ready.pop()
        seen += 1
        for u in after[t]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return seen == n_tasks


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, h, h_kv, n, n_kv, d, grid", [
    (2, 8, 2, 1000, 777, 64, 132), (4, 16, 16, 4096, 4096, 128, 132),
    (1, 3, 1, 100, 5000, 128, 7), (8, 32, 32, 1024, 1024, 128, 132)])
def test_backward_task_tables_keep_each_heads_kv_blocks_in_order(causal, b, h, h_kv, n, n_kv,
                                                                 d, grid):
    from tk_mlir.kernels.flash_attention import _backward_task_table
    kv_blocks = tk.cdiv(n_kv, 128)
    table = _backward_task_table(b * h_kv, h // h_kv, n, n_kv, d, causal, grid)
    assert _topological_order_exists(table, grid, b * h_kv * kv_blocks, kv_blocks)


# ------------------------------------------------------------------- PTX

def _compile_backward(d, causal, deterministic):
    return compile_backward(d, causal, DETERMINISTIC=deterministic)


@pytest.mark.parametrize("d, causal", [(64, False), (64, True), (128, False), (128, True)])
def test_deterministic_ptx_waits_and_counts_and_the_default_does_not(d, causal):
    det = _compile_backward(d, causal, True)
    ptx = det.asm["ptx"]
    assert "ld.acquire.gpu.global.u32" in ptx             # the wait for the tile's turn
    assert "red.release.gpu.global.add.u32" in ptx        # the count after the add ...
    default = _compile_backward(d, causal, False).asm["ptx"]
    completed = r"cp\.async\.bulk\.wait_group\s+0;"      # ... completed (not only read)
    assert len(re.findall(completed, ptx)) > len(re.findall(completed, default))
    assert "ld.acquire" not in default and "red.release" not in default
    # No wgmma serialized by the waits (they sit where no MMA is in flight).
    assert not re.search(r"C75(14|18|19)", det.ptxas_log), det.ptxas_log
    # A few registers spill at D=128 (the default kernel spills there too),
    # in the step loop only when causal (14 LDL/STL a step; BENCHMARKS.md).
    assert det.info["spill stores (bytes)"] <= (32 if d == 64 else 128), det.ptxas_log
    from test_attention import _step_loop
    spills = sum(i.startswith(("LDL", "STL")) for i in _step_loop(det.asm["sass"]))
    assert spills <= (16 if d == 128 and causal else 0), spills


# ---------------------------------------------------------------- plumbing

def test_deterministic_must_be_a_bool():
    from tk_mlir.kernels import attention
    q = torch.randn(1, 2, 64, 64).bfloat16()
    for bad in ("True", 1, None):
        with pytest.raises(TypeError, match=f"deterministic must be a bool, got {bad!r}"):
            attention(q, q, q, deterministic=bad)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_op_hands_deterministic_to_its_backward(deterministic, monkeypatch):
    """Autograd of torch.ops.tk_mlir.attention (what torch.compile traces)
    passes deterministic on to the backward op; on meta tensors."""
    from tk_mlir.kernels import custom_ops
    calls = []

    def record(do, q, k, v, o, lse, causal, scale, deterministic=False):
        calls.append(deterministic)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    monkeypatch.setattr(custom_ops, "attention_backward", record)
    q, k, v = (torch.empty(*shape, dtype=torch.bfloat16, device="meta").requires_grad_()
               for shape in ((1, 4, 128, 64), (1, 2, 96, 64), (1, 2, 96, 64)))
    o, _ = torch.ops.tk_mlir.attention(q, k, v, True, 0.3, deterministic)
    dq, dk, dv = torch.autograd.grad(o.sum(), (q, k, v))
    assert calls == [deterministic]
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ------------------------------------------------------------- on the GPU

SHAPES = [(2, 4, 2, 1000, 777, 64, True), (2, 4, 2, 1000, 777, 128, False),
          (1, 3, 1, 333, 700, 128, True), (1, 8, 8, 2049, 2049, 64, False),
          (2, 16, 4, 1500, 1500, 128, True)]


def _grads(q, k, v, do, causal, attend=None):
    from tk_mlir.kernels import attention
    attend = attend or (lambda q, k, v: attention(q, k, v, causal=causal, deterministic=True))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    attend(q, k, v).backward(do)
    return q.grad, k.grad, v.grad


@gpu
@pytest.mark.parametrize("b, h, h_kv, n, n_kv, d, causal", SHAPES)
def test_deterministic_gradients_are_the_same_bits_twice(b, h, h_kv, n, n_kv, d, causal):
    q, k, v, do = _inputs(b, h, h_kv, n, n_kv, d, seed=b * h + n + d + causal, device="cuda")
    first = _grads(q, k, v, do, causal)
    second = _grads(q, k, v, do, causal)
    torch.cuda.synchronize()
    for name, a, c in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, c), name
    refs = _reference_grads(q, k, v, do, causal, 1 / math.sqrt(d))
    for name, got, ref in zip(("dq", "dk", "dv"), first, refs):
        assert got.dtype == q.dtype and not got.isnan().any(), name
        assert _relative_error(got, ref) < 2e-2, name


@gpu
def test_deterministic_under_torch_compile_matches_eager_bitwise():
    from tk_mlir.kernels import attention
    q, k, v, do = _inputs(2, 4, 2, 1000, 777, 128, seed=9, device="cuda")

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return attention(q, k, v, causal=True, deterministic=True)

    compiled = _grads(q, k, v, do, True, attend)
    again = _grads(q, k, v, do, True, attend)
    eager = _grads(q, k, v, do, True)
    for name, a, c, e in zip(("dq", "dk", "dv"), compiled, again, eager):
        assert torch.equal(a, c) and torch.equal(a, e), name


@gpu
def test_deterministic_backward_replays_in_a_cuda_graph():
    """The counters are zeroed for each launch, so a captured backward gives
    the same bits on every replay."""
    from tk_mlir.kernels import flash_attention as fa
    q, k, v, do = _inputs(1, 4, 2, 700, 900, 64, seed=4, device="cuda")
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    eager = fa.attention_backward(do, q, k, v, o, lse, True, 0.125, deterministic=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            grads = fa.attention_backward(do, q, k, v, o, lse, True, 0.125, deterministic=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        for g in grads:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, a, e in zip(("dq", "dk", "dv"), grads, eager):
            assert torch.equal(a, e), name
