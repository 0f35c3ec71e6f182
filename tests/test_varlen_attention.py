"""attention_varlen (tk_mlir/kernels/varlen_attention.py): attention over
packed variable-length sequences, forward and backward, by the dense kernels
with a side table of each query row's keys (packed_sequences.py).

Without a GPU: the kernels in the interpreter against float64 torch, one
sequence at a time, for empty and one-token sequences, sequences that share
a query tile and a key block, GQA, causal or not, windows that cut blocks,
softcap, and gradients; the side table against a brute-force reading of the
rule; the GPU-made schedule; torch.compile; the argument rules. With a GPU
(`-m gpu`): the same against float32 at training shapes, and under CUDA-graph
capture.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import attention_varlen, packed_sequences, schedule  # noqa: E402

from torch_reference import assert_compiled_matches_eager  # noqa: E402
from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu


def offsets(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def visible(len_q: int, len_k: int, causal: bool, window=(-1, -1)):
    """(len_q, len_k) bool: which keys each query of one sequence sees
    (bottom-right aligned, FlashAttention's rule)."""
    key, pos = torch.arange(len_k)[None], torch.arange(len_q)[:, None] + len_k - len_q
    left, right = window[0], 0 if causal else window[1]
    seen = torch.ones(len_q, len_k, dtype=torch.bool)
    if right >= 0:
        seen &= key <= pos + right
    if left >= 0:
        seen &= key >= pos - left
    return seen


def reference(q, k, v, cu_q, cu_k, causal, window=(-1, -1), softcap=0.0, scale=None):
    """float64 attention per sequence: (o (total_q, H, D), lse (H, total_q)),
    differentiable in q, k, v."""
    H, D = q.shape[1:]
    scale = 1 / math.sqrt(D) if scale is None else scale
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[int(cu_q[b]):int(cu_q[b + 1])].double()
        ks, vs = (t[int(cu_k[b]):int(cu_k[b + 1])].double().repeat_interleave(
            H // k.shape[1], 1) for t in (k, v))
        s = torch.einsum("nhd,khd->hnk", qs, ks) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible(qs.shape[0], ks.shape[0], causal, window), float("-inf"))
        lses.append(torch.logsumexp(s, -1) if ks.shape[0] else
                    torch.full(s.shape[:2], float("-inf"), dtype=torch.float64))
        outs.append(torch.einsum("hnk,khd->nhd", torch.softmax(s, -1).nan_to_num(), vs))
    return torch.cat(outs), torch.cat(lses, 1)


def _inputs(lens_q, lens_k, h, h_kv, d, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = (torch.rand(sum(lens_q), h, d, generator=g) * 2 - 1).to(bf16).to(device)
    k, v = ((torch.rand(sum(lens_k), h_kv, d, generator=g) * 2 - 1).to(bf16).to(device)
            for _ in range(2))
    return q, k, v, offsets(lens_q, device), offsets(lens_k, device)


def _check_against_reference(q, k, v, cu_q, cu_k, causal, window, softcap, tol):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()),
                              int((cu_k[1:] - cu_k[:-1]).max()), causal=causal, window=window,
                              softcap=softcap, return_lse=True)
    do = torch.rand_like(o) - 0.5
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ro, rlse = reference(*ref_in, cu_q.cpu(), cu_k.cpu(), causal, window, softcap)
    ref_grads = torch.autograd.grad(ro, ref_in, do.cpu().double())
    assert _rel(o.cpu(), ro) < tol
    assert torch.equal(lse.isinf().cpu(), rlse.isinf())        # rows that see no key
    finite = rlse.isfinite()
    assert (lse.cpu().double()[finite] - rlse[finite]).abs().max() < 1e-3
    assert not o.cpu()[rlse.isinf().T].any()                    # ... get output 0
    for got, want in zip(grads, ref_grads):
        assert _rel(got.cpu(), want) < tol


# Sequences: empty, one token, sharing query tiles and key blocks, longer
# than a key block; key lengths differ from query lengths (bottom-right).
LENS_Q = [0, 70, 1, 130, 5, 200]
LENS_K = [3, 70, 0, 260, 5, 140]


@pytest.mark.parametrize("d,causal,window,softcap,h,h_kv", [
    (64, True, (-1, -1), 0.0, 2, 1),
    (128, False, (-1, -1), 0.0, 2, 2),
    (64, False, (7, 3), 0.0, 4, 1),         # a window that cuts blocks mid-way
    (128, True, (20, -1), 5.0, 2, 1),       # causal, a left window, soft-capped
    (64, False, (-1, 0), 0.0, 2, 1),        # causal spelled as a window
    (64, True, (-1, -1), 0.0, 8, 1),        # GQA 8:1
])
def test_matches_float64_forward_and_backward(interpret, d, causal, window, softcap, h, h_kv):
    q, k, v, cu_q, cu_k = _inputs(LENS_Q, LENS_K, h, h_kv, d, seed=d + h)
    _check_against_reference(q, k, v, cu_q, cu_k, causal, window, softcap, tol=1e-2)


def test_no_keys_at_all_and_no_queries_at_all(interpret):
    q, k, v, cu_q, cu_k = _inputs([3, 0, 4], [0, 0, 0], 2, 1, 64, seed=1)
    q.requires_grad_()
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, 4, 0, return_lse=True)
    assert not o.any() and lse.isinf().all() and (lse < 0).all()
    (dq,) = torch.autograd.grad(o.float().sum(), q)
    assert not dq.any()
    q, k, v, cu_q, cu_k = _inputs([0, 0], [5, 2], 2, 1, 64, seed=2)
    o = attention_varlen(q, k, v, cu_q, cu_k, 0, 5)
    assert o.shape == (0, 2, 64)


def test_strided_views_and_gqa_as_a_fused_projection_gives_them(interpret):
    """q, k, v cut from one (total, (H + 2 H_kv) D) projection: strided views."""
    g = torch.Generator().manual_seed(3)
    lens = [33, 100, 64]
    qkv = (torch.rand(sum(lens), (4 + 2 * 2) * 64, generator=g) - 0.5).to(bf16)
    q, k, v = qkv.view(sum(lens), 8, 64).split([4, 2, 2], dim=1)
    cu = offsets(lens)
    _check_against_reference(q, k, v, cu, cu, True, (-1, -1), 0.0, tol=1e-2)


def test_the_table_gives_each_row_the_keys_the_rule_does(interpret):
    """sequence_bounds_kernel's klo/khi per query row, qlo/qhi per key, each
    tile's common keys and the ranges against a brute-force reading of the
    visibility rule."""
    S = packed_sequences.SLOT
    lens_q, lens_k = [0, 70, 1, 130, 5, 200, 3], [3, 70, 0, 260, 5, 140, 9]
    for causal, window in ((True, (-1, -1)), (False, (9, 4)), (False, (-1, -1)),
                           (True, (30, -1))):
        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        total_q, total_k = sum(lens_q), sum(lens_k)
        seen = torch.zeros(total_q, total_k, dtype=torch.bool)
        for b in range(len(lens_q)):
            seen[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = visible(
                lens_q[b], lens_k[b], causal, window)
        tail, costs = packed_sequences.tail(cu_q, cu_k, total_q, total_k, causal, window,
                                            forward_tasks=(128, 128))
        costs = costs()
        rows = -(-total_q // packed_sequences.ROW_ALIGN) * packed_sequences.ROW_ALIGN
        keys = -(-total_k // 128) * 128
        klo, khi = tail[:rows], tail[rows:2 * rows]
        tiles = tail[2 * rows:2 * rows + S * rows // 64].view(-1, S)
        qlo0 = 2 * rows + -(-(S * rows // 64) // 64) * 64
        qlo, qhi = tail[qlo0:qlo0 + keys], tail[qlo0 + keys:qlo0 + 2 * keys]
        ranges = tail[qlo0 + 2 * keys:].view(-1, S)
        j = torch.arange(total_k)
        for r in range(rows):
            want = seen[r] if r < total_q else torch.zeros(total_k, dtype=torch.bool)
            assert torch.equal((j >= klo[r]) & (j < khi[r]), want), (causal, window, r)
        i = torch.arange(total_q)
        for key in range(total_k):
            assert torch.equal((i >= qlo[key]) & (i < qhi[key]), seen[:, key])
        for t in range(rows // 64):
            lo, hi = int(tiles[t, 0]), int(tiles[t, 1])
            block = seen[64 * t:64 * t + 64]
            assert block[:, lo:max(hi, lo)].all()   # every row sees [lo_all, hi_all)
        if (causal, window) == (False, (-1, -1)):   # rows 128-191: all in sequence 3
            assert tiles[2, :2].tolist() == [int(cu_k[3]), int(cu_k[4])]
        assert len(costs) == -(-total_q // 128)    # one per task the kernel decodes
        for task in range(rows // 128):            # a task's keys, from its first row's first
            first, end = int(ranges[task, 0]), int(ranges[task, 1])
            assert end > first and (task >= len(costs) or costs[task] == -(-(end - first) // 128))
            cols = seen[128 * task:128 * task + 128].any(0).nonzero()
            if len(cols):                          # (first: its first row's first key)
                assert first <= cols.min() and cols.max() < end
            else:
                assert (first, end) == (0, 1)
        back, back_costs = packed_sequences.tail(cu_q, cu_k, total_q, total_k, causal, window)
        assert len(back_costs()) == keys // 128
        ranges = back[qlo0 + 2 * keys:].view(-1, S)
        for kvb in range(keys // 128):             # a K/V block's query tiles hold all its queries
            first, end = int(ranges[kvb, 0]), int(ranges[kvb, 1])
            assert 0 <= first < end <= -(-total_q // 64)
            qs = seen[:, 128 * kvb:128 * kvb + 128].any(1).nonzero()
            if len(qs):
                assert first * 64 <= qs.min() and qs.max() < end * 64


def test_the_gpu_made_schedule_runs_every_task_once_and_balances():
    costs = torch.tensor([5, 1, 9, 3, 3, 7, 2])
    heads, grid = 3, 4
    table = schedule.sorted_table(costs, heads, grid)
    offsets_, tasks = table[:grid + 1], table[grid + 1:]
    assert sorted(tasks.tolist()) == list(range(len(costs) * heads))
    loads = [sum(int(costs[t % len(costs)]) for t in tasks[offsets_[b] - grid - 1:
                                                             offsets_[b + 1] - grid - 1])
             for b in range(grid)]
    assert max(loads) - min(loads) <= int(costs.max())
    # each block's first task is one of the costliest
    assert all(costs[int(tasks[offsets_[b] - grid - 1]) % len(costs)] == 9 for b in range(3))
    # the deal is kept per (tasks, grid, device): made once
    assert schedule._dealt(21, 4, costs.device) is schedule._dealt(21, 4, costs.device)


def test_offsets_needing_padding_are_copied_by_one_launch():
    """checks.int32_vectors: kernel operands of 1-D int32 tables, those whose
    rows are not whole 16-byte vectors copied into one buffer (one cat), each
    on a 16-byte boundary, a table given twice copied once."""
    from tk_mlir.kernels import checks
    a = torch.randint(0, 99, (5,), dtype=torch.int32)
    b = torch.randint(0, 99, (8,), dtype=torch.int32)
    c = torch.randint(0, 99, (7,), dtype=torch.int32)[::2]           # strided, 4 entries
    d = torch.randint(0, 99, (3,), dtype=torch.int32)
    va, vb, va2, vc, vd = checks.int32_vectors(a, b, a, c, d)
    for t, v in ((a, va), (b, vb), (a, va2), (c, vc), (d, vd)):
        assert v.dim() == 1 and len(v) % 4 == 0 and v.stride() == (1,)
        assert v.data_ptr() % 16 == 0 and torch.equal(v[:len(t)], t)
    assert vb is b and va.data_ptr() == va2.data_ptr()
    assert va.untyped_storage().data_ptr() == vd.untyped_storage().data_ptr()
    assert checks.int32_vectors(b) == (b,)


def _parts(table, grid):
    offsets_, tasks = table[:grid + 1], table[grid + 1:]
    return [tasks[offsets_[b] - grid - 1:offsets_[b + 1] - grid - 1].tolist() for b in range(grid)]


def test_the_paired_schedule_deals_mirrored_tiles_of_one_sequence(monkeypatch):
    """Causal costs fall along each sequence: tile i goes with its mirror,
    the units by pair cost, then sequence, head, pair, in a snake."""
    cu = torch.tensor([0, 8 * 128, 12 * 128 - 5], dtype=torch.int32)   # a ragged last tile
    costs = torch.tensor([8, 7, 6, 5, 4, 3, 2, 1, 4, 3, 2, 1])
    assert schedule.paired_table(costs, 2, 3, cu, 128).tolist() == \
        schedule.sorted_table(costs, 2, 3).tolist()         # 8 tasks a block: too few to pair
    monkeypatch.setattr(schedule, "PAIRED_MIN_TASKS", 4)
    table = schedule.paired_table(costs, 2, 3, cu, 128)
    assert table.dtype == torch.int32
    assert _parts(table, 3) == [[0, 7, 13, 18, 14, 17, 21, 22],    # ids head·12 + tile
                                [1, 6, 12, 19, 15, 16, 20, 23],
                                [2, 5, 3, 4, 8, 11, 9, 10]]


@pytest.mark.parametrize("seed", range(6))
def test_the_paired_schedule_runs_every_task_once_whatever_the_offsets(monkeypatch, seed):
    """Every task once with consistent offsets, for random sequences, tiles
    straddling two sequences, empty ones, and offsets that are not sorted
    (the GPU cannot check them without a sync: the pairing degrades, the
    table stays whole)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 700, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
    cu = torch.cat((torch.zeros(1, dtype=torch.long), lens.cumsum(0))).int()
    if seed % 2:
        cu = cu[torch.randperm(len(cu), generator=g)]
    per, heads, grid = 128, int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    blocks = max(-(-int(cu.max()) // per), 1)
    costs = torch.randint(1, 9, (blocks,), generator=g)
    monkeypatch.setattr(schedule, "PAIRED_MIN_TASKS", 2)
    table = schedule.paired_table(costs, heads, grid, cu, per)
    assert int(table[0]) == grid + 1 and int(table[grid]) == len(table)
    assert sorted(sum(_parts(table, grid), [])) == list(range(heads * blocks))


@pytest.mark.parametrize("d", [64, 128])
def test_causal_calls_run_the_paired_schedule(interpret, monkeypatch, d):
    """Four tasks a simulated SM (the threshold lowered to it): the backward
    takes the paired table, and so does the forward above D=64 (at 64 its
    kernel gains nothing from it: the sorted table), against float64."""
    monkeypatch.setattr(schedule, "PAIRED_MIN_TASKS", 4)
    tables = []
    for name in ("paired_table", "sorted_table"):
        monkeypatch.setattr(schedule, name, lambda *a, _name=name, _make=getattr(schedule, name):
                            tables.append(_name) or _make(*a))
    q, k, v, cu_q, cu_k = _inputs(LENS_Q, LENS_Q, 4, 4, d, seed=11)
    _check_against_reference(q, k, v, cu_q, cu_k, True, (-1, -1), 0.0, tol=1e-2)
    assert tables == ["paired_table" if d > 64 else "sorted_table", "paired_table"]


def test_a_batchs_offsets_make_its_schedule_once(interpret, monkeypatch):
    """Calls with the same cu_seqlens tensors, unwritten since, reuse the
    schedule (a model's layers); a write torch sees (copy_) makes it anew; a
    write it cannot see (through numpy's view of the memory) keeps the old
    schedule, which costs balance only: every result matches float64."""
    made = []
    for name in ("paired_table", "sorted_table"):
        monkeypatch.setattr(schedule, name, lambda *a, _make=getattr(schedule, name):
                            made.append(1) or _make(*a))
    lens, other = [70, 1, 60, 5], [5, 60, 70, 1]
    q, k, v, cu_q, cu_k = _inputs(lens, lens, 1, 1, 64, seed=5)

    def check(now, tables):
        made.clear()
        with torch.no_grad():
            o = attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=True)
        ro, _ = reference(q, k, v, offsets(now), offsets(now), True)
        assert _rel(o, ro) < 1e-2 and len(made) == tables, now

    check(lens, 1)
    check(lens, 0)                              # the same tensors, unwritten: reused
    cu_q.copy_(offsets(other))
    cu_k.copy_(cu_q)
    check(other, 1)                             # written: made anew
    cu_q.numpy()[:] = offsets(lens).numpy()     # a write torch cannot see
    cu_k.numpy()[:] = offsets(lens).numpy()
    check(lens, 0)                              # the old schedule, a right result
    cu_k = cu_k.clone()                         # another tensor: made anew
    check(lens, 1)
    more = [70, 1, 60, 40]                      # another total, written unseen: the totals
    q, k, v, _, _ = _inputs(more, more, 1, 1, 64, seed=6)      # are in the key, made anew
    cu_q.numpy()[:] = offsets(more).numpy()
    cu_k.numpy()[:] = offsets(more).numpy()
    check(more, 1)


def test_a_remembered_call_reads_each_calls_offsets_and_lengths(interpret):
    """Eager calls are remembered per signature (eager.py): a repeat with other
    offsets of the same totals, other values and the output's gradient in
    another layout (y.sum()'s, expanded) computes its own results, and what
    the key does not hold (max_seqlen_*, the offsets' values, checked on CPU
    tensors) is checked on every call."""
    from tk_mlir.kernels import varlen_attention
    for seed, (lens_q, lens_k) in enumerate((([30, 0, 66], [40, 5, 70]),
                                             ([1, 64, 31], [70, 40, 5]))):
        q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 2, 1, 64, seed=20 + seed)
        _check_against_reference(q, k, v, cu_q, cu_k, True, (-1, -1), 0.0, tol=1e-2)
        q = q.clone().requires_grad_()
        (dq,) = torch.autograd.grad(
            attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=True).float().sum(), q)
        ref = q.detach().double().requires_grad_()
        (want,) = torch.autograd.grad(reference(ref, k, v, cu_q, cu_k, True)[0].sum(), ref)
        assert _rel(dq, want) < 1e-2
        with torch.no_grad():
            o = attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=True)
        assert _rel(o, reference(q, k, v, cu_q, cu_k, True)[0]) < 1e-2
    assert len(varlen_attention._PREPARED) == 3     # lse or not, grad or not: one shape
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 0"):
        attention_varlen(q, k, v, cu_q, cu_k, 70, -1, causal=True)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        attention_varlen(q, k, v, cu_q, cu_k, True, 70, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q must not decrease"):
        attention_varlen(q, k, v, torch.tensor([0, 60, 50, 96], dtype=torch.int32), cu_k, 70,
                         70, causal=True)


def test_compiled_matches_eager(interpret):
    q, k, v, cu_q, cu_k = _inputs([5, 70, 0, 40], [5, 90, 3, 40], 2, 1, 64, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return attention_varlen(q, k, v, cu_q, cu_k, 70, 90, causal=True, softcap=3.0)

    assert_compiled_matches_eager(f, q, k, v)


def test_flash_attentions_keyword_names_are_taken(interpret):
    """softmax_scale and window_size (flash_attn_varlen_func's names) as scale
    and window; both spellings of one option at once is an error."""
    q, k, v, cu_q, cu_k = _inputs([10, 20], [10, 20], 2, 1, 64, seed=8)
    ours = attention_varlen(q, k, v, cu_q, cu_k, 20, 20, causal=True, scale=0.1, window=(5, 0))
    theirs = attention_varlen(q, k, v, cu_q, cu_k, 20, 20, causal=True, softmax_scale=0.1,
                              window_size=(5, 0))
    assert torch.equal(ours, theirs)
    with pytest.raises(TypeError, match=r"softmax_scale is FlashAttention's name for scale; "
                                        r"give one of them"):
        attention_varlen(q, k, v, cu_q, cu_k, 20, 20, scale=0.2, softmax_scale=0.1)


def test_bad_arguments_are_refused_with_the_rule():
    q, k, v, cu_q, cu_k = _inputs([3, 4], [3, 4], 2, 1, 64, seed=5)
    cases = [
        ((q, k, v, cu_q.long(), cu_k, 4, 4), TypeError, r"cu_seqlens_q must be torch.int32"),
        ((q, k, v, cu_q, cu_k[:2], 4, 4), ValueError, r"must have one length \(B\+1\)"),
        ((q, k, v, cu_q[:1], cu_k[:1], 4, 4), ValueError, r"B\+1 >= 2 offsets"),
        ((q, k, v, cu_q, cu_k, 4.0, 4), TypeError, r"max_seqlen_q must be an int"),
        ((q, k, v, cu_q, cu_k, -1, 4), ValueError, r"max_seqlen_q must be >= 0"),
        ((q[..., :32], k[..., :32], v[..., :32], cu_q, cu_k, 4, 4), ValueError,
         r"head dim D must be 64, 128 or 256"),
        ((q, k[:, :, :32], v, cu_q, cu_k, 4, 4), ValueError, r"one shape"),
        ((q.unsqueeze(0), k, v, cu_q, cu_k, 4, 4), ValueError, r"q must be 3-D"),
        ((q[:, :1], k.repeat(1, 2, 1), v.repeat(1, 2, 1), cu_q, cu_k, 4, 4), ValueError,
         r"K/V heads H_kv=2 must divide the query heads H=1"),
        ((q, k, v, torch.tensor([0, 4, 3], dtype=torch.int32), cu_k, 4, 4), ValueError,
         r"cu_seqlens_q must start at 0 and end at the 7 packed tokens, got 0 \.\. 3"),
        ((q, k, v, cu_q, torch.tensor([1, 5, 7], dtype=torch.int32), 4, 4), ValueError,
         r"cu_seqlens_k must start at 0"),
        ((q, k, v, cu_q.to("meta"), cu_k, 4, 4), ValueError,
         r"cu_seqlens_q must be on q's device cpu, got meta"),
        ((q, k, v, cu_q, cu_k.to("meta"), 4, 4), ValueError,
         r"cu_seqlens_k must be on q's device cpu, got meta"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            attention_varlen(*args)
    with pytest.raises(ValueError, match=r"must not decrease, got cu_seqlens_q\[1\] = 5 > "
                                         r"cu_seqlens_q\[2\] = 3"):
        attention_varlen(q, k, v, torch.tensor([0, 5, 3, 7], dtype=torch.int32),
                         torch.tensor([0, 3, 5, 7], dtype=torch.int32), 4, 4)


# ------------------------------------------------------------------ GPU

@gpu
@pytest.mark.parametrize("d,causal,window,softcap", [
    (128, True, (-1, -1), 0.0), (64, False, (-1, -1), 0.0), (128, False, (300, 100), 0.0),
    (64, True, (-1, -1), 30.0)])
def test_gpu_matches_the_reference_at_training_shapes(d, causal, window, softcap):
    g = torch.Generator().manual_seed(d)
    lens = [int(x) for x in torch.randint(1, 1500, (12,), generator=g)] + [0, 1]
    lens_k = [n if causal else int(x) for n, x in zip(lens, torch.randint(0, 1500, (14,),
                                                                        generator=g))]
    q, k, v, cu_q, cu_k = _inputs(lens, lens_k, 8, 2, d, seed=d, device="cuda")
    _check_against_reference(q, k, v, cu_q, cu_k, causal, window, softcap, tol=1e-2)


_MANY = [200 + 7 * i % 190 for i in range(64)]         # 64 sequences, 18362 tokens


@gpu
@pytest.mark.parametrize("lens, again, h", [([300, 200, 12], [12, 0, 500], 4),
                                            (_MANY, _MANY[::-1], 16)])
def test_gpu_graph_capture_replays_new_lengths(lens, again, h):
    """No host synchronisation: a captured call replays with new offsets of
    the same totals (the second case has tasks enough for the paired
    schedule)."""
    from tk_mlir.kernels.device import num_sms
    q, k, v, cu_q, cu_k = _inputs(lens, lens, h, h, 128, seed=7, device="cuda")
    if h == 16:
        assert sum(lens) // 128 * h >= schedule.PAIRED_MIN_TASKS * num_sms(q.get_device())
    longest = max(lens + again)
    attention_varlen(q, k, v, cu_q, cu_k, longest, longest, causal=True)     # the schedule cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attention_varlen(q, k, v, cu_q, cu_k, longest, longest, causal=True)
    for now in (lens, again):
        cu_q.copy_(offsets(now, "cuda"))
        cu_k.copy_(cu_q)
        graph.replay()
        ro, _ = reference(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), True)
        assert _rel(o.cpu(), ro) < 1e-2


def test_the_ops_fakes_match_what_they_return(interpret):
    from tk_mlir.kernels import custom_ops  # noqa: F401  registers the ops
    q, k, v, cu_q, cu_k = _inputs([5, 70, 0, 3], [5, 90, 3, 40], 2, 1, 64, seed=13)
    ops = torch.ops.tk_mlir
    o, lse = ops.attention_varlen(q, k, v, cu_q, cu_k, True, 0.125)
    for op, args in [(ops.attention_varlen.default, (q, k, v, cu_q, cu_k, True, 0.125)),
                     (ops.attention_varlen_backward.default,
                      (torch.rand_like(o), q, k, v, o, lse, cu_q, cu_k, True, 0.125))]:
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.parametrize("causal", [True, False])
def test_lse_is_differentiable(interpret, causal):
    """A loss through lse as well as o (every row sees a key: lens_k >= lens_q),
    and through lse alone: the gradients of the float64 reference."""
    q, k, v, cu_q, cu_k = _inputs([70, 1, 130], [70, 5, 260], 2, 1, 64, seed=11)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, 130, 260, causal=causal, return_lse=True)
    g = torch.Generator().manual_seed(12)
    do, dl = torch.rand(o.shape, generator=g) - 0.5, torch.rand(lse.shape, generator=g) - 0.5
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro, rlse = reference(*ref_in, cu_q, cu_k, causal)
    for got, want in ((torch.autograd.grad((o.float() * do).sum() + (lse * dl).sum(), (q, k, v),
                                           retain_graph=True),
                       torch.autograd.grad((ro * do).sum() + (rlse * dl).sum(), ref_in,
                                           retain_graph=True)),
                      (torch.autograd.grad((lse * dl).sum(), (q, k)),        # (v: no path)
                       torch.autograd.grad((rlse * dl).sum(), ref_in[:2]))):
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-2


def test_head_dim_256_with_grad_warns_at_the_forward(interpret):
    q, k, v, cu_q, cu_k = _inputs([5, 9], [5, 9], 2, 1, 256, seed=3)
    with pytest.warns(UserWarning, match="attention_varlen: head dim 256 has a forward only"):
        attention_varlen(q.requires_grad_(), k, v, cu_q, cu_k, 9, 9)


@pytest.mark.parametrize("d, forward", [(64, True), (128, True), (64, False)])
def test_varlen_kernels_keep_their_key_loops_free_of_spills(d, forward, ptxas):
    """ptxas (no GPU needed) on the VARLEN kernels: the masks compare each
    column with its row's bound (flash_attention.per_row), one bound at a
    time in the forward, which keeps D=64's 160-register consumers from
    spilling in the loop (the combined form spilled 24/36 bytes there)."""
    import tk_mlir as tk
    from tk_mlir.kernels import flash_attention as fa
    from tk_mlir.summary import loop_bodies
    n = 4096
    q, vec = tk.spec((1, 8, n, d), tk.bf16), tk.spec((1, 8, n), tk.f32)
    table = tk.spec((40000,), "i32")
    if forward:
        cfg = fa._config(d, 0, True)
        c = fa.attention_kernel.compile(q, q, q, q, tk.spec((1, 8, n + 384), tk.f32), table,
                                        0.1, D=d, VARLEN=True,
                                        num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    else:
        c = fa.attention_backward_kernel.compile(q, q, q, q, vec, vec,
                                                 tk.spec((1, 8, n, d), tk.f32), q, q, table,
                                                 0.1, 0.1, D=d, VARLEN=True,
                                                 **fa._backward_config(d, 0.0))
    body = next((b for b in loop_bodies(c.asm["sass"])
                 if any(t.startswith("HGMMA") for t, _ in b)), None)
    assert body is not None, "no SASS loop issues an HGMMA"
    assert not [t for t, _ in body if t.startswith(("LDL", "STL"))], c.ptxas_log
    assert c.info["spill stores (bytes)"] == c.info["spill loads (bytes)"] == 0, c.ptxas_log
    assert "C75" not in c.ptxas_log, c.ptxas_log
