"""Multi-head attention forward, FlashAttention-3 style, on Hopper.

    from tk_mlir.kernels import attention
    o = attention(q, k, v, causal=True)                 # (B, H, N, D) bf16/f16
    o, lse = attention(q, k, v, return_lse=True)        # lse: (B, H, N) f32, natural log

The kernel (`attention_kernel`) is warp-specialized: a producer warpgroup
loads each task's Q and its K and V blocks by TMA into two rings (tk.ring: K
and V are released at different points); CONSUMERS warpgroups of 64 query
rows compute S = Q·Kᵀ, the online softmax in registers and O += P·V with P
from registers, the softmax of block j overlapping the MMAs of block j+1
and a named-barrier ping-pong between warpgroups. The grid is persistent; a
task is (batch, head, 64·CONSUMERS query rows), and `tasks()` decides which
block runs which (kernels/schedule.py): balanced by the key blocks each
reads, causal tasks longest first in groups of heads whose K and V share L2.

Masks: keys past N_kv and, with causal=True, keys after the diagonal get -inf
scores. Causal attention with N_q != N_kv is aligned bottom-right, as
FlashAttention does: query i sees keys j <= i + N_kv - N_q. A query row that
sees no key gets output 0 and log-sum-exp -inf (never NaN). A sliding window
(WINDOW_LEFT / WINDOW_RIGHT) masks its edges and skips the key blocks wholly
outside it; SOFTCAP caps the scores (`tanh`); both are constexprs, so the
default specializations carry none of it. GQA / MQA: K and V may have fewer
heads (H_kv dividing H); query head h reads K/V head h // (H / H_kv).
"""
from __future__ import annotations

import math

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.kernels import checks, eager, packed_sequences, schedule
from tk_mlir.kernels.device import num_sms

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


@tk.kernel(num_warps=12)
def attention_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, O: tk.gl, LSE: tk.gl, TASKS: tk.gl,
                     scale_log2: float,
                     D: tk.constexpr = 128, BN: tk.constexpr = 128, STAGES: tk.constexpr = 2,
                     Q_STAGES: tk.constexpr = 1, O_TMA: tk.constexpr = False,
                     CAUSAL: tk.constexpr = False, CONSUMERS: tk.constexpr = 2,
                     CONSUMER_REGISTERS: tk.constexpr = 240, PRODUCER_REGISTERS: tk.constexpr = 24,
                     WINDOW_LEFT: tk.constexpr = -1, WINDOW_RIGHT: tk.constexpr = -1,
                     SOFTCAP: tk.constexpr = 0.0, VARLEN: tk.constexpr = False,
                     RESCALE_THRESHOLD: tk.constexpr = 0.0):
    """O = softmax(Q·Kᵀ·scale)·V and LSE = logsumexp(Q·Kᵀ·scale) per row.
    Q, O: (B, H, N, D); K, V: (B, H_kv, N_kv, D); LSE: (B, H, N) f32;
    scale_log2 = scale·log2(e) > 0; H_kv divides H. num_warps = 4·(CONSUMERS + 1).
    TASKS: the schedule table (kernels/schedule.py) of task ids
    (b·H + h)·cdiv(N, 64·CONSUMERS) + query block, from `tasks()`. Launch on
    the table's persistent grid (one block per SM). `attention()` checks all
    of this; a direct launch must keep to it.
    WINDOW_LEFT / WINDOW_RIGHT >= 0: query i sees keys in [i + shift -
    LEFT, i + shift + RIGHT] (shift = N_kv - N; with CAUSAL, RIGHT is 0);
    key blocks wholly outside a task's rows' windows are not read. SOFTCAP >
    0: scores s·scale become SOFTCAP·tanh(s·scale / SOFTCAP).
    VARLEN: B = 1 and Q, K, V, O are packed sequences (kernels/packed_sequences.py):
    query row r sees the keys its TASKS tail gives it, and a task reads BN-key
    blocks from the first key of its tail's range (CAUSAL and the window are
    then in the tail, not set here).
    O leaves by TMA from an O tile of each warpgroup's (O_TMA), or else from
    registers. RESCALE_THRESHOLD > 0 (FA4's conditional rescale): a row's
    running max, in log2 units, moves only when a block raises it by more
    than this, so P stays below 2^RESCALE_THRESHOLD and most steps find
    every factor of O's rescale 1, which a warp then skips."""
    assert not (VARLEN and (CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0)), \
        "VARLEN takes causality and windows from its table"
    assert 0 <= RESCALE_THRESHOLD <= 15, \
        f"RESCALE_THRESHOLD is 0 (off) up to 15 (P < 2^15, within f16's range), got " \
        f"{RESCALE_THRESHOLD}"
    assert tk.num_warps() == 4 * (CONSUMERS + 1), \
        f"{CONSUMERS} consumer warpgroups and a producer need num_warps={4 * (CONSUMERS + 1)}, " \
        f"the kernel has {tk.num_warps()}"
    tk.register_split(CONSUMERS, CONSUMER_REGISTERS, PRODUCER_REGISTERS)
    B, H, N, _ = Q.shape
    H_KV, N_KV = K.shape[1], K.shape[2]
    BM = 64 * CONSUMERS                          # query rows per task
    q_blocks = tk.cdiv(N, BM)
    shift = N_KV - N                             # causal: query i sees keys <= i + shift
    qs = tk.ring(Q.dtype, (64, D), Q_STAGES, count=CONSUMERS, consumers=CONSUMERS)
    ks = tk.ring(K.dtype, (BN, D), STAGES, consumers=CONSUMERS)
    vs = tk.ring(V.dtype, (BN, D), STAGES, consumers=CONSUMERS)
    if O_TMA:                                    # each warpgroup's O on its way out by TMA
        os = tk.shared_tiles(O.dtype, (64, D), CONSUMERS, swizzle=128)

    def task_of(task):
        """(batch, head, query block) of a task id."""
        bh = task // q_blocks
        return bh // H, bh % H, task % q_blocks

    RIGHT = 0 if CAUSAL else WINDOW_RIGHT        # keys after i + shift + RIGHT are masked

    def kv_range(qb):
        """The K/V blocks [lo, hi) (in STEPs) query block qb reads (at least
        one: rows that see no key come out of the masks as 0 / -inf). VARLEN
        counts keys, from the task's first key: its blocks start with its
        sequence's keys, loaded at element coordinates."""
        if VARLEN:
            first, end = packed_sequences.pair(
                TASKS, packed_sequences.forward_offsets(TASKS, N, N_KV, BM)[5], qb)
            # (clamped: offsets the host never checked cannot wrap the walk's
            # end, which would leave the consumers waiting for blocks never loaded)
            first, end = min(max(first, 0), N_KV), min(end, N_KV)
            return first, first + max(tk.cdiv(end - first, BN), 1) * BN
        else:
            hi = N_KV
            if RIGHT >= 0:
                hi = min(N_KV, (qb + 1) * BM + shift + RIGHT)
            hi = max(tk.cdiv(hi, BN), 1)
            lo = 0
            if WINDOW_LEFT >= 0:
                lo = min(max(qb * BM + shift - WINDOW_LEFT, 0) // BN, hi - 1)
        return lo, hi

    STEP = BN if VARLEN else 1                   # kv_range's unit: keys (VARLEN) or blocks

    def key_of(j):
        """The first key of the K/V block at j (kv_range's unit)."""
        return j if VARLEN else j * BN

    def load_kv(tile, X, b, hk, j, full):
        """The K/V block at j (kv_range's unit) into tile."""
        if VARLEN:
            tk.tma.load_async(tile, X, (b, hk, j, 0), full, elements=True)
        else:
            tk.tma.load_async(tile, X, (b, hk, j, 0), full)

    def masked(S, col0, row0, seen=None):
        """S with -inf where key col0 + c is past N_kv or outside the window
        of query row0 + r (causal: after the diagonal); only blocks that
        cross an edge are touched. VARLEN: seen = the keys (lo, hi) every
        row sees and each row's own bounds (two i32 row vectors)."""
        if VARLEN:
            lo_all, hi_all, row_lo, row_hi = seen
            # Each bound only in the blocks it cuts (a tile within one sequence:
            # the diagonal's), each a compare of the column with its row's bound;
            # the column indices made in each branch (made before both, ptxas
            # computes them in every block, masked or not).
            if col0 < lo_all:
                cols = S.col_indices()
                S = tk.where(cols >= per_row(row_lo - col0, cols), S, float("-inf"))
            if col0 + BN > hi_all:
                cols = S.col_indices()
                S = tk.where(cols < per_row(row_hi - col0, cols), S, float("-inf"))
        else:
            edge = col0 + BN > N_KV
            if RIGHT >= 0:
                edge = edge | (col0 + BN - 1 > row0 + shift + RIGHT)
            if WINDOW_LEFT >= 0:
                edge = edge | (col0 < row0 + 63 + shift - WINDOW_LEFT)
            if edge:
                last = N_KV - 1                      # the last key a row may see
                if RIGHT >= 0:
                    last = min(S.row_indices() + (row0 + shift + RIGHT), last)
                visible = S.col_indices() + col0 <= last
                if WINDOW_LEFT >= 0:
                    visible = visible & (S.col_indices() + col0 >=
                                         S.row_indices() + (row0 + shift - WINDOW_LEFT))
                S = tk.where(visible, S, float("-inf"))
        return S

    def capped(S):
        """SOFTCAP: the scores soft-capped, left in S's units (·scale·log2(e)
        later gives SOFTCAP·tanh(s·scale / SOFTCAP)·log2(e))."""
        if SOFTCAP > 0:
            S = tanh(S * (scale_log2 / (LOG2E * SOFTCAP))) * (SOFTCAP * LOG2E / scale_log2)
        return S

    # Each side reads its own block_id/grid_dim for the task loop: a value
    # computed before this branch and live in both loops is spilled by ptxas.
    if tk.warpgroup_id() == CONSUMERS:
        tk.decrease_registers(PRODUCER_REGISTERS)
        if tk.elect_leader("warpgroup"):
            it = 0
            n = 0
            first, end, task = schedule.block_tasks(TASKS)
            for slot in range(first, end):
                b, h, qb = task_of(task)
                task = tk.load(TASKS, (slot + 1,))     # the next task's id, read ahead
                hk = h // (H // H_KV)
                lo, hi = kv_range(qb)
                q, q_full = qs.fill(n)
                for c in tk.static_range(CONSUMERS):
                    tk.tma.load_async(q[c] if CONSUMERS > 1 else q, Q,
                                      (b, h, CONSUMERS * qb + c, 0), q_full)
                for j in range(lo, hi, STEP):
                    kt, k_full = ks.fill(it)
                    load_kv(kt, K, b, hk, j, k_full)
                    vt, v_full = vs.fill(it)
                    load_kv(vt, V, b, hk, j, v_full)
                    it += 1
                n += 1
    else:
        tk.increase_registers(CONSUMER_REGISTERS)
        wg = tk.warpgroup_id()
        # The thread that issues this warpgroup's O stores (TMA store groups
        # are per thread: the same one waits for them).
        leader = tk.elect_leader("warpgroup")
        if CONSUMERS > 1 and wg == CONSUMERS - 1:
            tk.named_barrier_arrive(1, warps=8)   # warpgroup 0 issues its MMAs first
        it = 0
        n = 0
        first, end, task = schedule.block_tasks(TASKS)
        for slot in range(first, end):
            b, h, qb = task_of(task)
            task = tk.load(TASKS, (slot + 1,))         # the next task's id, read ahead
            row0 = qb * BM + wg * 64             # this warpgroup's first query row
            lo, hi = kv_range(qb)
            seen = None
            if VARLEN:
                klo, khi, tiles, _, _, _ = packed_sequences.forward_offsets(TASKS, N, N_KV, BM)
                lo_all, hi_all = packed_sequences.pair(TASKS, tiles, row0 // 64)
                seen = (lo_all, hi_all, packed_sequences.row_bound(TASKS, klo, row0 // 64),
                        packed_sequences.row_bound(TASKS, khi, row0 // 64))
            q = qs.wait(n, part=wg)
            schedule_mmas(wg, CONSUMERS)
            k0 = ks.wait(it)
            S = tk.mma_ABt(tk.zeros((64, BN), f32, layout="row", scope="warpgroup"), q, k0)
            yield_mmas(wg, CONSUMERS)
            tk.mma_wait(0)
            ks.release(it)
            S = masked(capped(S), key_of(lo), row0, seen)
            m = S.row_max() * scale_log2
            P = (S * scale_log2).sub_row(finite(m)).exp2()
            l = P.row_sum()
            P = P.to(Q.dtype)                    # the A operand of P·V, from registers
            acc = tk.zeros((64, D), f32, layout="row", scope="warpgroup")
            for j in range(lo + STEP, hi, STEP):
                # S of block j runs while P of block j-1 multiplies V ...
                # The turn first, then the data (FA3 waits for K/V first: slower
                # causal here, see BENCHMARKS.md).
                schedule_mmas(wg, CONSUMERS)
                kt, vt = ks.wait(it + 1), vs.wait(it)
                S = tk.mma_ABt(tk.zeros((64, BN), f32, layout="row", scope="warpgroup"), q, kt)
                acc = tk.mma_AB(acc, P, vt)
                yield_mmas(wg, CONSUMERS)
                tk.mma_wait(1)
                ks.release(it + 1)
                # ... and the softmax of block j runs while P·V finishes.
                S = masked(capped(S), key_of(j), row0, seen)
                m_new = max(m, S.row_max() * scale_log2)
                if RESCALE_THRESHOLD > 0:   # the max kept unless it grew past the threshold
                    m_new = tk.where(m_new - m > RESCALE_THRESHOLD, m_new, m)
                m_use = finite(m_new)
                alpha = (m - m_use).exp2()
                if RESCALE_THRESHOLD > 0:   # exactly 1 where kept, whatever ex2 makes of 0
                    alpha = tk.where(m_new == m, 1.0, alpha)
                P = (S * scale_log2).sub_row(m_use).exp2()
                l = l * alpha + P.row_sum()
                P = P.to(Q.dtype)
                m = m_new
                tk.mma_wait(0)
                vs.release(it)
                acc = acc.mul_row(alpha, skip_ones=RESCALE_THRESHOLD > 0)
                it += 1
            schedule_mmas(wg, CONSUMERS)
            v_last = vs.wait(it)
            acc = tk.mma_AB(acc, P, v_last)
            yield_mmas(wg, CONSUMERS)
            tk.mma_wait(0)
            vs.release(it)
            qs.release(n)
            it += 1
            # Rows that saw no key have l = 0: output 0, LSE -inf.
            out = acc.mul_row(tk.where(l == 0.0, 0.0, l.rcp())).to(O.dtype)
            if O_TMA:   # through shared memory: the next task starts while O leaves
                if leader:
                    tk.tma.store_wait(0)         # the last task's O has left os[wg]
                tk.named_barrier(1 + CONSUMERS + wg, warps=4)
                tk.store(os[wg], out)
                tk.named_barrier(1 + CONSUMERS + wg, warps=4)
                if leader:
                    tk.tma.store_async(O, os[wg], (b, h, CONSUMERS * qb + wg, 0))
                    tk.tma.store_commit()
            else:
                tk.store(O, out, (b, h, CONSUMERS * qb + wg, 0))
            n += 1
            tk.store(LSE, m * LN2 + l.log(), (b, h, CONSUMERS * qb + wg))
        if O_TMA and leader:
            tk.tma.store_wait(0, read=False)

@tk.func
def tanh(x):
    """tanh of a tile, 1 - 2 / (exp(2x) + 1) (exp2 and rcp: two MUFU ops; ±1
    where exp overflows or vanishes), for soft-capping."""
    return 1.0 - 2.0 * ((x * (2.0 * LOG2E)).exp2() + 1.0).rcp()


@tk.func
def finite(m):
    """The row maxima to subtract: 0 for a row with no key yet (max -inf), so
    exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN."""
    return tk.where(m == float("-inf"), 0.0, m)


@tk.func
def per_row(v, like):
    """An i32 tile like `like` holding v[i] in every element of row i:
    `cols < per_row(v, cols)` compiles to one compare an element (the 0·
    folds away), where `cols.sub_row(v) < 0` needs an add before each."""
    return (like * 0).add_row(v)


@tk.func
def schedule_mmas(wg, consumers):
    """Ping-pong: wait for this warpgroup's turn to issue MMAs (named barrier
    1 + wg, completed by the previous warpgroup's arrival)."""
    if consumers > 1:
        tk.named_barrier(1 + wg, warps=8)


@tk.func
def yield_mmas(wg, consumers):
    """Ping-pong: this warpgroup's MMAs are issued; the next one may issue its own."""
    if consumers > 1:
        tk.named_barrier_arrive(1 + (wg + 1) % consumers, warps=8)


# Non-causal rows at least this long take 192-key blocks at D=128 (fewer
# softmax rounds per key; measured, BENCHMARKS.md).
LONG_KV = 8192
LONG_KV_256 = 4096

# attention_kernel's RESCALE_THRESHOLD per head dim (log2 units; absent: 0, O
# rescaled every step). Timed on the H100 (BENCHMARKS.md, 12-07 13:00): D=256
# gains 1.6-3.7%; D=128 causal loses 1.5-5.5%, D=64 causal 0.2-0.6%, D=128
# unmasked moves 0.2-0.7%.
RESCALE_THRESHOLDS = {256: 8.0}


def _config(d: int, n_kv: int = 0, causal: bool = False) -> dict:
    """Tile configuration per head dim (and, at D=128, key count and
    causality; at D=256, key count). setmaxnreg only moves registers
    between warpgroups: the split must fit what the block starts with."""
    return {**_tiles(d, n_kv, causal), "RESCALE_THRESHOLD": RESCALE_THRESHOLDS.get(d, 0.0)}


def _tiles(d: int, n_kv: int, causal: bool) -> dict:
    """_config's tiles, stages and register split."""
    # Two Q stages (the next task's Q and first K/V blocks load during this
    # one) and O leaving by TMA where shared memory holds them (not D=256).
    if d == 64:     # 512 threads start with 128 registers each
        return dict(BN=128, STAGES=2, Q_STAGES=2, O_TMA=True, CONSUMERS=3,
                    CONSUMER_REGISTERS=160, PRODUCER_REGISTERS=32)
    # 384 threads start with 168 registers each (D=256: the producer's
    # address arithmetic spills in 24)
    if d == 128 and not causal and n_kv >= LONG_KV:
        # 192-key K/V tiles leave shared memory for one Q stage and no O tile
        return dict(BN=192, STAGES=2, Q_STAGES=1, O_TMA=False, CONSUMERS=2,
                    CONSUMER_REGISTERS=240, PRODUCER_REGISTERS=24)
    if d == 128:
        return dict(BN=128, STAGES=2, Q_STAGES=2, O_TMA=True, CONSUMERS=2,
                    CONSUMER_REGISTERS=240, PRODUCER_REGISTERS=24)
    # D=256: 80-key K/V blocks (two stages of them and one Q stage fill shared
    # memory, 230528 of 232448 bytes) from LONG_KV_256 keys on, 64 below
    # (80 loses at 2048 causal: more blocks cross the diagonal; BENCHMARKS.md)
    return dict(BN=80 if n_kv >= LONG_KV_256 else 64, STAGES=2, Q_STAGES=1, CONSUMERS=2,
                CONSUMER_REGISTERS=232, PRODUCER_REGISTERS=40)


# Causal forward tasks run in groups of heads whose K and V fit in this many
# bytes of L2 (the H200 has 60 MB; the figure was measured, BENCHMARKS.md).
L2_KV_BYTES = 32 << 20
# A task's cost besides its key blocks, in key blocks (its Q load, first and
# last MMAs and epilogue), for balancing the schedule.
TASK_OVERHEAD_BLOCKS = 1


def tasks(q, k, causal: bool, grid: int, window: tuple[int, int] = (-1, -1)):
    """attention_kernel's TASKS table for q (B, H, N, D) and k (B, H_kv, N_kv,
    D) over `grid` blocks, on q's device (made once per shape). Not causal:
    query blocks inner, so blocks running together share K and V in L2.
    Causal: the longest tasks (last query blocks) first, heads inner, in
    groups of as many heads as have K and V that fit in L2_KV_BYTES. A
    window: query blocks inner, balanced by the key blocks each reads."""
    B, H, N, D = q.shape
    N_KV = k.shape[2]
    cfg = _config(D, N_KV, causal)
    bm, bn = 64 * cfg["CONSUMERS"], cfg["BN"]
    key = ("attention", B * H, N, N_KV, D, bm, bn, causal, grid, L2_KV_BYTES,
           TASK_OVERHEAD_BLOCKS, *window)
    return schedule.on_device(
        key, lambda: _task_table(B * H, N, N_KV, D, bm, bn, causal, grid, window), q.device)


def _task_table(heads: int, n: int, n_kv: int, d: int, bm: int, bn: int, causal: bool,
                grid: int, window: tuple[int, int] = (-1, -1)):
    import numpy as np
    q_blocks = -(-n // bm)
    if window != (-1, -1):          # kv_range's blocks, per query block
        left, right = window[0], 0 if causal else window[1]
        qb = np.arange(q_blocks)
        hi = np.full(q_blocks, n_kv) if right < 0 else \
            np.minimum(n_kv, (qb + 1) * bm + n_kv - n + right)
        hi = np.maximum(-(-hi // bn), 1)
        lo = np.zeros(q_blocks, dtype=np.int64) if left < 0 else \
            np.minimum(np.maximum(qb * bm + n_kv - n - left, 0) // bn, hi - 1)
        ids = np.arange(heads * q_blocks)
        return schedule.table(ids, (hi - lo)[ids % q_blocks] + TASK_OVERHEAD_BLOCKS, grid)
    if not causal:
        ids = np.arange(heads * q_blocks)
        return schedule.table(ids, np.ones(len(ids)), grid)
    group = max(min(L2_KV_BYTES // (4 * d) // n_kv, heads), 1)
    longest_first = np.arange(q_blocks - 1, -1, -1)
    ids = schedule.head_groups(heads, group, longest_first, q_blocks)
    visible = np.minimum(n_kv, (ids % q_blocks + 1) * bm + n_kv - n)   # keys the last row sees
    blocks = np.maximum(-(-visible // bn), 1)
    return schedule.table(ids, blocks + TASK_OVERHEAD_BLOCKS, grid)


def reach(q, k) -> int:
    """More than any distance between a query and a key of q, k (B, H, N, D):
    a window side this wide bounds nothing (checks.window)."""
    return q.shape[2] + k.shape[2]


def attention(q, k, v, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, deterministic: bool = False,
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0):
    """softmax(q·kᵀ·scale [+ causal mask])·v on (B, H, N, D) torch tensors.

    q: (B, H, N, D); k, v: (B, H_kv, N_kv, D) with H_kv dividing H (GQA/MQA);
    bf16 or f16, on one CUDA device; any strides with a contiguous last dim
    (e.g. `x.view(B, N, H, D).transpose(1, 2)` straight from a projection;
    a view whose rows are not 16-byte aligned is copied first). D is 64, 128
    or 256 (256: the forward only, its backward raises); N, N_kv are any
    lengths (N_kv = 0: rows that see no key, 0 with lse -inf, as SDPA gives
    them). scale defaults to
    1/sqrt(D). causal=True masks key j for query i when j > i + N_kv - N
    (bottom-right aligned, as FlashAttention). Returns o (B, H, N, D), laid
    out like q, and with return_lse=True also the log-sum-exp (B, H, N) f32
    (natural log; -inf for rows that see no key; when N is not a multiple of
    4, a view of rows padded to one, as the kernels read them).

    Under torch.compile it runs as the custom op torch.ops.tk_mlir.attention
    (tk_mlir/kernels/custom_ops.py), traced as one node; eager calls launch
    directly (custom_ops.EagerAttention; with nothing to differentiate, the
    forward kernel alone). Either way o is differentiable in
    q, k and v (the backward is `attention_backward`), and so is lse (its
    gradient dlse adds dlse·P to the scores' gradient: the backward subtracts
    it from rowsum(dO ∘ O)), as a ring attention's merge of partial results
    needs.
    deterministic=True makes the backward's dq the same bits on every run (its
    f32 sums over key blocks in a fixed order, FA3's per-tile semaphores), at
    some speed; o, dk and dv are deterministic either way.

    window=(left, right): query i sees keys in [i + N_kv - N - left,
    i + N_kv - N + right], -1 for no bound on that side (with causal, right
    is 0), as FlashAttention's window_size; key blocks wholly outside are not
    read, forward and backward (deterministic=True takes no window where
    gradients are recorded: NotImplementedError). softcap > 0:
    scores s·scale become softcap·tanh(s·scale / softcap) (Gemma-2), forward
    and backward."""
    import torch
    if torch.compiler.is_compiling():
        scale, left, right, softcap, _ = _checked_call(q, k, v, causal, scale, deterministic,
                                                       window, softcap, return_lse)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        o, lse = torch.ops.tk_mlir.attention(q, k, v, causal, scale, deterministic, left, right,
                                             softcap)
        return (o, lse) if return_lse else o
    # eager: no op dispatch, and a signature seen before was checked then (eager.py)
    key = (eager.tensor_key(q), eager.tensor_key(k), eager.tensor_key(v),
           eager.option_key(causal, scale, return_lse, deterministic, window, softcap),
           torch.is_grad_enabled())
    return _PREPARED.call(key, lambda: _prepare(q, k, v, causal, scale, return_lse,
                                                deterministic, window, softcap), q, k, v)


# Eager attention calls by signature (eager.py).
_PREPARED = eager.Prepared()


def warn_if_forward_only(fn: str, d: int, grad: bool) -> None:
    """Head dim 256 has a forward only: a call autograd records (`grad`) is
    warned of at the caller's line, where refusing it would break forward-only
    calls in grad mode (its backward raises)."""
    if grad and d == 256:
        import warnings
        from tk_mlir.errors import user_stacklevel
        warnings.warn(f"{fn}: head dim 256 has a forward only; an input requires grad, so "
                      f"this call records a graph whose backward will raise (call it under "
                      f"torch.no_grad() for inference)", stacklevel=user_stacklevel())


def _checked_call(q, k, v, causal, scale, deterministic, window, softcap,
                  return_lse=False) -> tuple:
    """attention's arguments checked: (scale, left, right, softcap) as the
    kernels take them, and whether autograd records the call."""
    import torch
    _check(q, k, v)
    checks.flags("attention", causal=causal, deterministic=deterministic, return_lse=return_lse)
    scale, left, right, softcap = checks.attention_options("attention", q.shape[-1], reach(q, k),
                                                           scale, window, softcap)
    if causal:          # a right window bound adds nothing to causality's (a no-op window
        right = -1      # is no window: deterministic=True takes causal=True, window=(-1, 0))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad and (left, right) != (-1, -1) and deterministic:
        raise NotImplementedError("attention: deterministic=True takes no window in the "
                                  "backward yet")
    if not torch.compiler.is_compiling():
        warn_if_forward_only("attention", q.shape[-1], grad)
    checks.on_cuda("attention", "q", q)       # last: every other rule shows on CPU tensors
    return scale, left, right, softcap, grad


def _prepare(q, k, v, causal, scale, return_lse, deterministic, window, softcap):
    """After checking an eager call, `run(q, k, v)` for calls like it: through
    autograd (EagerAttention) when it records them, else the forward kernel
    alone, its launch planned here."""
    scale, left, right, softcap, grad = _checked_call(q, k, v, causal, scale, deterministic,
                                                      window, softcap, return_lse)
    planned = planned_launch(q, k, causal, scale, (left, right), softcap, same_signature=True)
    run = _prepared_run(planned, causal, scale, return_lse, deterministic, left, right, softcap,
                        grad)
    if all(checks.kernel_operand(t) is t for t in (q, k, v)):   # (strides, alignment: keyed)
        return run

    def run_copied(q, k, v):
        """Views whose rows the kernels cannot read (not 16-byte aligned)
        copied, differentiably; o laid out like q still."""
        used = [checks.kernel_operand(t) for t in (q, k, v)]
        out = run(*used)
        o = checks.laid_out_as_given(out[0] if return_lse else out, q, used[0])
        return (o, out[1]) if return_lse else o
    return run_copied


def _prepared_run(planned, causal, scale, return_lse, deterministic, left, right, softcap, grad):
    """_prepare's `run(q, k, v)` on tensors the kernels read as they lie."""
    from tk_mlir.kernels import custom_ops  # registers torch.ops.tk_mlir on first use
    if grad:
        # planned at the first backward (its task table) per layout of the saved
        # tensors, then kept
        backward = eager.per_layout(lambda q, k, v, o, lse: planned_backward(
            q, k, causal, scale, deterministic, left, right, softcap, same_signature=True), 5)

        def remembered_backward(do, q, k, v, o, lse, *options, dlse=None, **keywords):
            return backward(do, q, k, v, o, lse, dlse)

        def run_recorded(q, k, v):
            o, lse = custom_ops.EagerAttention.apply(q, k, v, causal, scale, deterministic, left,
                                                     right, softcap, planned, remembered_backward)
            return (o, lse) if return_lse else o
        return run_recorded

    def run(q, k, v):
        o, lse = custom_ops.attention_forward(q, k, v, causal, scale, (left, right), softcap,
                                              planned)
        return (o, lse) if return_lse else o
    return run


def launch(q, k, v, o, lse, causal: bool, scale: float, window: tuple[int, int] = (-1, -1),
           softcap: float = 0.0) -> None:
    """attention_kernel on checked tensors, into o and lse (planned_launch's)."""
    planned_launch(q, k, causal, scale, window, softcap)(q, k, v, o, lse)


def planned_launch(q, k, causal: bool, scale: float, window: tuple[int, int] = (-1, -1),
                   softcap: float = 0.0, same_signature: bool = False):
    """`run(q, k, v, o, lse)`: attention_kernel on checked tensors shaped like
    q and k (and on their device), into o (q's shape) and lse (B, H, N'), N'
    >= N a multiple of 4 (rows of whole 16-byte vectors); the configuration,
    grid and task table chosen here, once. same_signature: every call's
    tensors are laid out as the first's (eager.launcher)."""
    if not q.shape[0] * q.shape[1] * q.shape[2]:
        return lambda q, k, v, o, lse: None          # (no query rows: nothing to launch)
    if not k.shape[2]:      # no keys: each row sees none, and gets what the kernel gives such
        return lambda q, k, v, o, lse: (o.zero_(), lse.fill_(float("-inf")))   # rows (0, -inf)
    cfg = _config(q.shape[-1], k.shape[2], causal)
    grid = num_sms(q.get_device())
    masks = {} if window == (-1, -1) and not softcap else \
        dict(WINDOW_LEFT=window[0], WINDOW_RIGHT=window[1], SOFTCAP=float(softcap))
    table, scale2 = tasks(q, k, causal, grid, window), scale * math.log2(math.e)
    kernel = eager.launcher(attention_kernel, same_signature)(
        (grid,), D=q.shape[-1], CAUSAL=causal, num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg,
        **masks)
    return lambda q, k, v, o, lse: kernel(q, k, v, o, lse, schedule.pin_if_capturing(table),
                                          scale2)


def _check(q, k, v) -> None:
    """Shapes, dtypes, devices and layouts, each with the rule it breaks."""
    import torch
    checks.tensor("attention", "q", q, ndim=4, dtypes=(torch.bfloat16, torch.float16))
    for name, t in (("k", k), ("v", v)):
        checks.tensor("attention", name, t, ndim=4, dtypes=(torch.bfloat16, torch.float16))
        checks.like("attention", name, t, "q", q)
    _check_shapes(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"attention: {name}'s last dim (D) must be contiguous (stride 1), "
                             f"got strides {tuple(t.stride())}")


def _check_shapes(q, k, v) -> None:
    B, H, N, D = q.shape
    if D not in (64, 128, 256):
        raise ValueError(f"attention: head dim D must be 64, 128 or 256, got {D}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"attention: k and v must be (B={B}, H_kv, N_kv, D={D}), got "
                         f"{tuple(k.shape)}")
    if k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(f"attention: the K/V heads H_kv={k.shape[1]} must divide the query "
                         f"heads H={H} (GQA/MQA)")


# ------------------------------------------------------------------ backward

@tk.kernel(num_warps=4)
def attention_backward_prep_kernel(O: tk.gl, dO: tk.gl, LSE: tk.gl, dLSE: tk.gl,
                                   NEG_DELTA: tk.gl, SHIFT: tk.gl, dQ: tk.gl, log_scale: float,
                                   unit: float, D: tk.constexpr = 128,
                                   WITH_DLSE: tk.constexpr = False):
    """What the backward kernel reads besides Q, K, V and dO, per 64 query
    rows, as its accumulators start: NEG_DELTA = -Delta, Delta = rowsum(dO ∘
    O) (the term the softmax gradient subtracts) less dLSE (WITH_DLSE: the
    gradient of the log-sum-exp, which adds dLSE·P to the scores' gradient);
    SHIFT = (ln(scale) - LSE)·unit, -inf for a row that saw no key (LSE -inf:
    its P comes out 0); and dQ's rows zeroed (the backward adds into them).
    log_scale = ln(scale); unit = 1/scale puts SHIFT in the scores' units,
    exp2((S + SHIFT)·scale·log2(e)) = scale·P, and unit = log2(e) in the
    exponent's (soft-capped: exp2(c·t + SHIFT)). LSE, dLSE, NEG_DELTA,
    SHIFT: (B, H, N') f32, N' >= N a multiple of 4; LSE's and dLSE's rows
    past N are not used, NEG_DELTA's and SHIFT's get 0. Grid (cdiv(N, 64),
    H, B)."""
    r, h, b = tk.block_id(0), tk.block_id(1), tk.block_id(2)
    o = tk.load(O, (b, h, r, 0), (64, D)).to(f32)
    do = tk.load(dO, (b, h, r, 0), (64, D)).to(f32)
    delta = (o * do).row_sum()
    lse = tk.load(LSE, (b, h, r), (64,))
    real = lse.indices() + r * 64 < O.shape[2]      # rows past N: padding
    if WITH_DLSE:
        delta = delta - tk.where(real, tk.load(dLSE, (b, h, r), (64,)), 0.0)
    tk.store(NEG_DELTA, delta * -1.0, (b, h, r))
    shift = tk.where(lse == float("-inf"), float("-inf"), (lse * -1.0 + log_scale) * unit)
    tk.store(SHIFT, tk.where(real, shift, 0.0), (b, h, r))
    tk.store(dQ, tk.zeros((64, D), f32), (b, h, r, 0))


@tk.kernel(num_warps=12)
def attention_backward_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, dO: tk.gl, SHIFT: tk.gl,
                              NEG_DELTA: tk.gl,
                              dQ: tk.gl, dK: tk.gl, dV: tk.gl, TASKS: tk.gl, scale_log2: float,
                              grad_scale: float, D: tk.constexpr = 128,
                              STAGES: tk.constexpr = 2,
                              CAUSAL: tk.constexpr = False, DETERMINISTIC: tk.constexpr = False,
                              PIPELINE: tk.constexpr = False,
                              CONSUMER_REGISTERS: tk.constexpr = 240,
                              PRODUCER_REGISTERS: tk.constexpr = 24,
                              WINDOW_LEFT: tk.constexpr = -1, WINDOW_RIGHT: tk.constexpr = -1,
                              SOFTCAP: tk.constexpr = 0.0, VARLEN: tk.constexpr = False,
                              QUERY_ROWS: tk.constexpr = 64, DKV_TMA: tk.constexpr = False,
                              SCALE_IN_P: tk.constexpr = True):
    """dQ (f32, accumulated: zero it first), dK, dV of attention, FA3's
    backward on Hopper: a task owns 128 K/V rows (64 per consumer warpgroup)
    of one K/V head and loops over the query blocks (QUERY_ROWS) of every query
    head that reads it (GQA sums there, in registers). Per block, with
    Sᵀ = K·Qᵀ so LSE and Delta broadcast along columns, and with SCALE_IN_P
    P' = scale·P (scale folded into the exponent: SHIFT, from
    attention_backward_prep_kernel):
        P'ᵀ = exp2((Sᵀ + SHIFT)·scale·log2(e)),  dPᵀ = V·dOᵀ
        dV += P'ᵀ·dO / scale,  dS'ᵀ = P'ᵀ∘(dPᵀ − Delta),  dK += dS'ᵀ·Q
        dQ += dS'·K           (dV's and dK's A from registers; dS'ᵀ through shared
                               memory for dQ, added by TMA in f32)
    so that dQ and dK need no multiply by scale, and dV one per task by
    grad_scale = 1/scale. Without SCALE_IN_P (f16: P' would be √D times
    nearer f16's subnormals), P' = P and grad_scale = scale multiplies dQ
    each step and dK once (scale_log2 = scale·log2(e) either way). At
    D=128 each warpgroup computes half of dQ's columns over all 128 keys (one
    f32 addition per element and task); at D=64 each adds its own keys'
    share. SHIFT = (ln(scale) − LSE)/scale (ln(scale) 0 without SCALE_IN_P;
    −inf for a row that saw no key; soft-capped, (ln(scale) − LSE)·log2(e),
    added to the capped exponent) and NEG_DELTA = −Delta: (B, H, N') f32 with
    N' >= N a multiple of 4.
    TASKS: the schedule table
    (kernels/schedule.py) of task ids (b·H_kv + h_kv)·cdiv(N_kv, 128) + K/V
    block, from `backward_tasks()`, over the launch's persistent grid.
    PIPELINE: step t+1's Sᵀ and dPᵀ are issued before step t's dQ leaves
    (needs STAGES >= 3 to pay; not with DETERMINISTIC).

    DETERMINISTIC: each dQ tile takes its adds in one order, K/V block by K/V
    block (at D=64 warpgroup 0's keys before warpgroup 1's), so dQ is the same
    bits on every run. TASKS then ends with `dq_counters(B, H, N)` zeroed i32
    counters, one per 64-row query tile (b, h, i), that count the adds it has
    received: a task waits until the tile has the adds of every K/V block
    before its own, adds, and counts its add once the TMA has completed it.
    The K/V blocks that reach query tile i are a prefix 0, 1, ... (a task
    walks the query blocks from first_q_block(kvb), which grows with kvb), so
    block kvb's turn is the count 2·kvb (+ wg at D=64; at D=128 both column
    halves count). A task waits only on tasks before it in the table's order,
    in which every block runs its tasks (see `backward_tasks`), and the grid
    is resident (one block per SM), so the waits cannot deadlock.

    WINDOW_LEFT / WINDOW_RIGHT: attention_kernel's window; a task walks only
    the query blocks whose windows reach its keys (at least one: rows that
    see none of them give P = 0). Not with DETERMINISTIC: the K/V blocks that
    reach a dQ tile are then no longer a prefix 0, 1, ... SOFTCAP: P from the
    capped scores, and dSᵀ times the cap's derivative 1 - tanh².

    QUERY_ROWS = 80 (D=128 only; FA3's block when not causal): query blocks
    of 80 rows, so each step's fixed costs (barriers, SHIFT and NEG_DELTA, dQ's
    hand-off) buy 25% more work. dQ = dS·K is then computed transposed,
    dQᵀ = Kᵀ·dSᵀ (wgmma's M is 64 rows per warpgroup: each takes 64 of dQ's
    columns as rows), and stored transposed back (tk.transpose: 4-byte
    pieces) for its TMA add. Not with DETERMINISTIC or VARLEN (their tables
    count 64-row tiles). QUERY_ROWS = 128 (D=64 only; FA3's block there):
    twice the work per step; each warpgroup computes 64 of dQ's rows over all
    128 keys and adds them as their own 64-row tile; not with DETERMINISTIC
    or VARLEN either.

    VARLEN: B = 1 and Q, K, V, dO (and dQ, dK, dV) are packed sequences
    (kernels/packed_sequences.py): query row r sees the keys its TASKS tail
    gives it, and a task walks the query tiles the tail's ranges give (not
    with DETERMINISTIC; CAUSAL and the window are then in the tail).

    DKV_TMA: dK and dV (of K's and V's dtypes) leave by TMA from the task's
    own K and V tiles, which go back to the producer once the TMA has read
    them (there is no room for tiles of their own); else from registers once
    the tiles are back."""
    windowed = WINDOW_LEFT >= 0 or (not CAUSAL and WINDOW_RIGHT >= 0)
    assert not (DETERMINISTIC and (windowed or VARLEN)), \
        "the deterministic backward takes no window or packed sequences (its dQ turns " \
        "assume a prefix of K/V blocks)"
    assert not (VARLEN and (CAUSAL or windowed)), \
        "VARLEN takes causality and windows from its table"
    assert QUERY_ROWS == 64 or (
        (QUERY_ROWS, D) in ((80, 128), (128, 64)) and not (DETERMINISTIC or VARLEN)), \
        "QUERY_ROWS is 64, or 80 at D=128 or 128 at D=64, without DETERMINISTIC or VARLEN"
    BM = QUERY_ROWS
    dq_transposed = BM == 80
    # D=64 with 64 rows: each warpgroup's dQ is its own keys' share of the whole
    # tile; else each computes a 64-wide block of dQ (columns at D=128, rows at
    # BM=128) over all 128 keys, from both warpgroups' dSᵀ and both K tiles.
    dq_by_keys = D == 64 and BM == 64
    dq_rows = 64 if BM == 128 else BM
    tk.register_split(2, CONSUMER_REGISTERS, PRODUCER_REGISTERS)
    B, H, N, _ = Q.shape
    H_KV, N_KV = K.shape[1], K.shape[2]
    group = H // H_KV
    q_blocks = tk.cdiv(N, BM)
    shift = N_KV - N                             # causal: query i sees keys <= i + shift
    kvs = tk.ring(K.dtype, (64, D), 1, count=4, consumers=2)    # K0, K1, V0, V1
    qs = tk.ring(Q.dtype, (BM, D), STAGES, count=2, consumers=2)   # Q_i, dO_i
    vs = tk.ring(f32, (BM,), STAGES, count=2, consumers=2)         # SHIFT_i, NEG_DELTA_i
    # dQ of each consumer; dSᵀ per consumer (x2 stages at D=128): an 80-column
    # row is 160 bytes, and 32 the widest swizzle dividing it.
    dqs = tk.shared_tiles(f32, (dq_rows, 64), 2, swizzle=128)
    ds = tk.shared_tiles(Q.dtype, (64, BM), 2 if dq_by_keys else 4,
                         swizzle=32 if dq_transposed else 128)

    def task_of(task):
        """(batch, K/V head, K/V block) of a task id."""
        bh = task // tk.cdiv(N_KV, 128)
        return bh // H_KV, bh % H_KV, task % tk.cdiv(N_KV, 128)

    def first_q_block(kvb):
        """The first query block that sees a key of K/V block kvb."""
        first = 0
        if VARLEN:
            first = packed_sequences.pair(
                TASKS, packed_sequences.backward_offsets(TASKS, N, N_KV)[5], kvb)[0]
        elif CAUSAL:
            first = max((kvb * 128 - shift) // BM, 0)
        elif WINDOW_RIGHT >= 0:
            first = min(max((kvb * 128 - shift - WINDOW_RIGHT) // BM, 0), q_blocks - 1)
        return first

    def end_q_block(kvb, first):
        """One past the last query block that sees a key of K/V block kvb
        (past first: a task walks at least one block)."""
        end = q_blocks
        if VARLEN:
            end = packed_sequences.pair(
                TASKS, packed_sequences.backward_offsets(TASKS, N, N_KV)[5], kvb)[1]
        elif WINDOW_LEFT >= 0:
            end = max(min((kvb * 128 + 127 - shift + WINDOW_LEFT) // BM + 1, q_blocks),
                      first + 1)
        return end

    def walk_start(hk, first):
        """The first (query head, query block) of a task's walk over the query
        blocks first.. of its K/V head's query heads (see next_block)."""
        return hk * group, (q_blocks - 1 if DETERMINISTIC else first)

    def next_block(h, i, first, end, hk):
        """The (query head, query block) after (h, i) in that walk: one loop,
        not one per head, so no accumulator lives across an outer loop's
        boundary. Heads outer, blocks up; DETERMINISTIC: blocks down to
        first, heads inner, so that all tasks of a K/V head reach a dQ tile
        at the same step of their walks (they take turns there: a task a
        step ahead of the one before it would wait for it at every tile)."""
        if DETERMINISTIC:       # (h is one of K/V head hk's: a compare, not a modulo)
            last = h + 1 == (hk + 1) * group
            h, i = (h + 1 - group if last else h + 1), (i - 1 if last else i)
        else:
            last = i + 1 == end
            h, i = (h + 1 if last else h), (first if last else i + 1)
        return h, i

    def dq_counter(b, h, i):
        """DETERMINISTIC: the entry of TASKS that counts dQ tile (b, h, i)'s
        adds (the counters end TASKS: dq_counters(B, H, N) of them)."""
        counters = tk.cdiv(B * H * q_blocks, 4) * 4
        return TASKS.shape[0] - counters + (b * H + h) * q_blocks + i

    if tk.warpgroup_id() == 2:
        tk.decrease_registers(PRODUCER_REGISTERS)
        if tk.elect_leader("warpgroup"):
            it = 0
            n = 0
            first_task, end, task = schedule.block_tasks(TASKS)
            for slot in range(first_task, end):
                b, hk, kvb = task_of(task)
                task = tk.load(TASKS, (slot + 1,))     # the next task's id, read ahead
                kv, kv_full = kvs.fill(n)
                for c in tk.static_range(2):
                    tk.tma.load_async(kv[c], K, (b, hk, 2 * kvb + c, 0), kv_full)
                    tk.tma.load_async(kv[2 + c], V, (b, hk, 2 * kvb + c, 0), kv_full)
                first = first_q_block(kvb)
                end_q = end_q_block(kvb, first)
                h, i = walk_start(hk, first)
                for _ in range(group * (end_q - first)):
                    t, q_full = qs.fill(it)
                    tk.tma.load_async(t[0], Q, (b, h, i, 0), q_full)
                    tk.tma.load_async(t[1], dO, (b, h, i, 0), q_full)
                    rows, v_full = vs.fill(it)
                    tk.tma.load_async(rows[0], SHIFT, (b, h, i), v_full)
                    tk.tma.load_async(rows[1], NEG_DELTA, (b, h, i), v_full)
                    it += 1
                    h, i = next_block(h, i, first, end_q, hk)
                n += 1
    else:
        tk.increase_registers(CONSUMER_REGISTERS)
        wg = tk.warpgroup_id()
        # One thread issues the warpgroup's dQ adds and waits for them: TMA
        # store groups are per thread, so it must be the same one each time.
        leader = tk.elect_leader("warpgroup")

        def scores(kt, vt, it):
            """Step it's Sᵀ + SHIFT (Sᵀ = K·Qᵀ; Sᵀ alone when soft-capped) and
            dPᵀ - Delta (dPᵀ = V·dOᵀ) issued, one MMA group each: (Q tile, dO
            tile, Sᵀ, dPᵀ). The accumulators start at SHIFT and NEG_DELTA, so
            neither column vector is live beside them in the softmax (at D=128
            it is what spilled); ones times a column is the column itself
            (x·1 folds, where 0 - x does not), so each is its loaded registers
            and their copies, no arithmetic."""
            qt, dot = qs.wait(it, part=0), qs.wait(it, part=1)
            ones = tk.full((64, BM), 1.0, layout="row", scope="warpgroup")
            s0 = tk.zeros((64, BM), f32, layout="row", scope="warpgroup")
            if SOFTCAP == 0.0:      # (capping caps Sᵀ itself: SHIFT comes after)
                s0 = ones.mul_col(tk.load(vs.wait(it, part=0), scope="warpgroup"))
            dp0 = ones.mul_col(tk.load(vs.wait(it, part=1), scope="warpgroup"))
            s = tk.mma_ABt(s0, kt, qt)
            dp = tk.mma_ABt(dp0, vt, dot)
            return qt, dot, s, dp

        def gradients(s, dp, qt, dot, kt, kt0, kt1, it, i, kv0, dk, dv):
            """Once Sᵀ and dPᵀ are complete: P and dSᵀ, dV += Pᵀ·dO and dK += dSᵀ·Q
            issued, dSᵀ to shared memory and dQ = dS·K issued: (dk, dv, dq)."""
            if VARLEN:      # read first: the softmax runs while the loads do
                lo_all, hi_all = packed_sequences.pair(TASKS, seq_tiles, i)
            if SOFTCAP > 0:
                t = tanh(s * (scale_log2 / (LOG2E * SOFTCAP)))
                # The cap's derivative 1 - tanh² goes into dPᵀ now, so that
                # t dies with P (dSᵀ = P∘(dPᵀ - Delta)∘(1 - t²))
                dp = dp * (1.0 - t * t)
                p = (t * (SOFTCAP * LOG2E)).add_col(
                    tk.load(vs.wait(it, part=0), scope="warpgroup")).exp2()
            else:
                p = (s * scale_log2).exp2()
            if VARLEN:
                if (kv0 < lo_all) | (kv0 + 64 > hi_all):    # crosses a row's bounds
                    cols = p.col_indices()
                    p = tk.where((cols >= per_row(key_qlo - i * BM, cols)) &
                                 (cols < per_row(key_qhi - i * BM, cols)), p, 0.0)
            if CAUSAL:
                if kv0 + 63 > i * BM + shift:       # crosses the diagonal
                    keys = p.row_indices() + kv0
                    p = tk.where(p.col_indices() + (i * BM + shift) >= keys, p, 0.0)
            elif WINDOW_RIGHT >= 0:
                if kv0 + 63 > i * BM + shift + WINDOW_RIGHT:
                    keys = p.row_indices() + kv0
                    p = tk.where(p.col_indices() + (i * BM + shift + WINDOW_RIGHT) >= keys, p,
                                 0.0)
            if WINDOW_LEFT >= 0:
                if kv0 < i * BM + BM - 1 + shift - WINDOW_LEFT:  # crosses the window's left edge
                    keys = p.row_indices() + kv0
                    p = tk.where(keys >= p.col_indices() + (i * BM + shift - WINDOW_LEFT), p,
                                 0.0)
            # Both A operands converted before either MMA: fewer registers
            # live at once (p, dP and the bf16 copies do not all overlap).
            dst = p * dp                            # dSᵀ
            dsb = dst.to(Q.dtype)
            pb = p.to(Q.dtype)
            dv = tk.mma_AB(dv, pb, dot)
            dk = tk.mma_AB(dk, dsb, qt)
            # dQ = dS·K, dSᵀ through shared memory as wgmma's transposed A.
            if leader:
                tk.tma.store_wait(0)            # the last block's dQ tile is read
            if dq_by_keys:  # one column block: each warpgroup adds its keys' share
                tk.store(ds[wg], dsb)
                tk.named_barrier(1 + wg, warps=4)
                dq = tk.mma_AtB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"),
                                ds[wg], kt)
            else:           # block wg of dQ over all 128 keys: one f32 add, not two
                stage = 2 * (it % 2)        # double-buffered: one barrier per block
                tk.store(ds[stage + wg], dsb)
                tk.named_barrier(1, warps=8)
                if dq_transposed:       # dQᵀ's rows wg·64.. = Kᵀ·dSᵀ
                    # dV's and dK's MMAs done first: P and dSᵀ (their A
                    # registers) die before dQᵀ's 40 are taken (else ptxas
                    # serializes the wgmmas for registers, C7512).
                    tk.mma_wait(0)
                    dq = tk.mma_AtB(tk.zeros((64, BM), f32, layout="row", scope="warpgroup"),
                                    kt0.column_block(wg), ds[stage])
                    dq = tk.mma_AtB(dq, kt1.column_block(wg), ds[stage + 1])
                elif BM == 128:         # dQ's rows wg·64.. = dS's rows · K
                    dq = tk.mma_AtB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"),
                                    ds[stage].column_block(wg), kt0)
                    dq = tk.mma_AtB(dq, ds[stage + 1].column_block(wg), kt1)
                else:                   # dQ's columns wg·64.. = dS · K's
                    dq = tk.mma_AtB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"),
                                    ds[stage], kt0.column_block(wg))
                    dq = tk.mma_AtB(dq, ds[stage + 1], kt1.column_block(wg))
            return dk, dv, dq

        def add_dq(dq, it, b, h, i, kvb):
            """Once dQ's MMA is complete: dQ (dS'·K) added into global dQ by TMA (in
            turn when DETERMINISTIC), and step it's slots released (its MMAs
            are complete too)."""
            # Added by TMA, off the warpgroup's path (faster than
            # red.global.add from registers, see BENCHMARKS.md).
            if not SCALE_IN_P:
                dq = dq * grad_scale
            tk.store(dqs[wg], dq.T if dq_transposed else dq)
            tk.named_barrier(3 + wg, warps=4)
            if leader:
                # Here, with no MMA in flight (a signal's trap path would serialize
                # them, ptxas C7518): wait for this tile's turn (the adds of the
                # K/V blocks before this one), add, count the add.
                if DETERMINISTIC:
                    tk.wait_signal(TASKS, (dq_counter(b, h, i),),
                                   2 * kvb + (wg if dq_by_keys else 0), scope="gpu")
                    tk.fence("gpu", async_proxy=True)   # the acquire before the TMA add
                tk.tma.reduce_add_async(dQ, dqs[wg], (b, h, 2 * i + wg, 0) if BM == 128
                                        else (b, h, i, 0 if dq_by_keys else wg))
                tk.tma.store_commit()
                if DETERMINISTIC:
                    # Counted as soon as it is done: the next K/V block's task
                    # waits for it (counted a step later, every turn cost a step).
                    tk.tma.store_wait(0, read=False)
                    tk.fence("gpu", async_proxy=True)
                    tk.signal(TASKS, (dq_counter(b, h, i),), scope="gpu")
            qs.release(it)
            vs.release(it)

        it = 0
        n = 0
        first_task, end, task = schedule.block_tasks(TASKS)
        for slot in range(first_task, end):
            b, hk, kvb = task_of(task)
            task = tk.load(TASKS, (slot + 1,))         # the next task's id, read ahead
            kv0 = kvb * 128 + wg * 64            # this warpgroup's first key
            if VARLEN:      # the queries that see each of its keys, and where tiles' are
                _, _, seq_tiles, qlo, qhi, _ = packed_sequences.backward_offsets(TASKS, N,
                                                                                 N_KV)
                key_qlo = packed_sequences.row_bound(TASKS, qlo, 2 * kvb + wg)
                key_qhi = packed_sequences.row_bound(TASKS, qhi, 2 * kvb + wg)
            kt = kvs.wait(n, part=wg)
            vt = kvs.wait(n, part=2 + wg)
            kt0, kt1 = kvs.wait(n, part=0), kvs.wait(n, part=1)
            dk = tk.zeros((64, D), f32, layout="row", scope="warpgroup")
            dv = tk.zeros((64, D), f32, layout="row", scope="warpgroup")
            first = first_q_block(kvb)
            end_q = end_q_block(kvb, first)
            h, i = walk_start(hk, first)
            steps = group * (end_q - first)      # >= 1: every K/V block has a query
            # The loop rotated: step t's gradients, then step t+1's Sᵀ and dPᵀ
            # (the first step's issued before it, the last one's gradients
            # after it). In this order ptxas keeps dK and dV in their MMAs'
            # registers across steps; with Sᵀ and dPᵀ first in the body it
            # parked them elsewhere and copied them back each step (at D=128,
            # 164 of the loop's 696 instructions were moves; 50 rotated).
            # Nothing is in flight across the back edge: ptxas would
            # serialize the MMAs (C7514). A loop does not carry shared tiles
            # either: each step finds its Q and dO tiles again (a completed wait).
            q_first, do_first, s, dp = scores(kt, vt, it)
            tk.mma_wait(0)
            for _ in range(steps - 1):
                qt, dot = qs.wait(it, part=0), qs.wait(it, part=1)
                dk, dv, dq = gradients(s, dp, qt, dot, kt, kt0, kt1, it, i, kv0, dk, dv)
                if PIPELINE and not DETERMINISTIC:
                    # Step t+1's Sᵀ and dPᵀ run while step t's dQ leaves (not
                    # with the deterministic add, whose wait would serialize
                    # them, C7518).
                    q_next, do_next, s, dp = scores(kt, vt, it + 1)
                    tk.mma_wait(2)                  # dV, dK and dQ of this step
                    add_dq(dq, it, b, h, i, kvb)
                else:
                    tk.mma_wait(0)
                    add_dq(dq, it, b, h, i, kvb)
                    q_next, do_next, s, dp = scores(kt, vt, it + 1)
                tk.mma_wait(0)
                it += 1
                h, i = next_block(h, i, first, end_q, hk)
            qt, dot = qs.wait(it, part=0), qs.wait(it, part=1)
            dk, dv, dq = gradients(s, dp, qt, dot, kt, kt0, kt1, it, i, kv0, dk, dv)
            tk.mma_wait(0)
            add_dq(dq, it, b, h, i, kvb)
            it += 1
            if SCALE_IN_P:      # dV summed P' = scale·P; dK was scaled through dS'
                dv = dv * grad_scale
            else:
                dk = dk * grad_scale
            if DKV_TMA:     # through the task's K and V tiles, by TMA
                # Unless dq_by_keys, the other warpgroup's last dQ read this
                # one's K tile: both are past it first.
                tk.store(vt, dv.to(dV.dtype))
                if not dq_by_keys:
                    tk.named_barrier(1, warps=8)
                tk.store(kt, dk.to(dK.dtype))
                tk.named_barrier(3 + wg, warps=4)
                if leader:
                    tk.tma.store_async(dK, kt, (b, hk, 2 * kvb + wg, 0))
                    tk.tma.store_async(dV, vt, (b, hk, 2 * kvb + wg, 0))
                    tk.tma.store_commit()
                    tk.tma.store_wait(0)        # read out before the tiles are refilled
            kvs.release(n)
            n += 1
            if not DKV_TMA:
                tk.store(dK, dk.to(dK.dtype), (b, hk, 2 * kvb + wg, 0))
                tk.store(dV, dv.to(dV.dtype), (b, hk, 2 * kvb + wg, 0))
        if leader:
            tk.tma.store_wait(0, read=False)


def _backward_config(d: int, softcap: float = 0.0, query_rows: int = 64,
                     fn: str = "attention") -> dict:
    """attention_backward_kernel's constexprs for a head dim, soft cap and
    query block (384 threads start with 168 registers each). D=64 with 64-row
    blocks pipelines its steps (PIPELINE) over three Q/dO stages: 1.01-1.17x
    (BENCHMARKS.md); D=128 and 128-row blocks have no registers for it.
    `fn`: the caller its error names."""
    if d == 256:
        raise NotImplementedError(f"{fn}'s backward: head dim 256 is not supported yet (its "
                                  f"dK and dV accumulators alone need 256 registers per "
                                  f"thread); the forward warned of it")
    cfg = dict(STAGES=2, PIPELINE=False, CONSUMER_REGISTERS=240, PRODUCER_REGISTERS=24)
    if d == 64 and query_rows == 64:
        cfg.update(STAGES=3, PIPELINE=True)
    if softcap:
        cfg.update(SOFTCAP=float(softcap))
    if query_rows != 64:
        # dK and dV by TMA through the K and V tiles: the wide kernels'
        # register stores stay narrow (lane exchanges spill there), and the
        # TMA epilogue is 1.01-1.13x faster than them (BENCHMARKS.md).
        cfg.update(QUERY_ROWS=query_rows, DKV_TMA=True)
    return cfg


# 80-row query blocks (FA3's at D=128 when not causal: the step's fixed costs over
# 25% more work): 6-8% faster than 64 rows unmasked on the H200; masked, the
# diagonal's extra work cancels it (BENCHMARKS.md), so 64 rows stay there.
WIDE_QUERY_BLOCKS = True
# 128-row query blocks at D=64 (FA3's there, masked or not): the step's fixed
# costs over twice the work (BENCHMARKS.md).
TALL_QUERY_BLOCKS = True


def _backward_query_rows(d: int, causal: bool, window: tuple[int, int], softcap: float,
                         deterministic: bool) -> int:
    """attention_backward_kernel's QUERY_ROWS for a call: 80 where the wide
    blocks apply (D=128, no mask, no cap, not deterministic), 128 where the
    tall ones do (D=64, no cap, not deterministic), else 64."""
    if d == 64 and TALL_QUERY_BLOCKS and not (softcap or deterministic):
        return 128
    plain = not (causal or softcap or deterministic) and window == (-1, -1)
    return 80 if WIDE_QUERY_BLOCKS and d == 128 and plain else 64


def backward_tasks(q, k, causal: bool, grid: int, deterministic: bool = False,
                   window: tuple[int, int] = (-1, -1)):
    """attention_backward_kernel's TASKS table for q (B, H, N, D) and k (B,
    H_kv, N_kv, D) over `grid` blocks, on q's device (made once per shape).
    Not causal: K/V blocks inner, so blocks running together share Q and dO
    in L2. Causal: the longest tasks (first K/V blocks) first, heads inner,
    in groups of as many K/V heads as have query heads whose Q, dO and dQ's
    f32 sums fit in L2_KV_BYTES (QUERY_ROW_BYTES_PER_D); balanced by the query blocks each
    task walks. Either way a head's K/V blocks come in increasing order, as
    the deterministic kernel needs. deterministic=True: a new tensor, the table followed by the
    kernel's dQ counters, zeroed (one per launch: the kernel counts on them)."""
    import torch
    B, H, N, D = q.shape
    H_KV, N_KV = k.shape[1], k.shape[2]
    key = ("attention backward", B * H_KV, H // H_KV, N, N_KV, D, causal, grid, L2_KV_BYTES,
           QUERY_ROW_BYTES_PER_D, TASK_OVERHEAD_BLOCKS, *window)
    table = schedule.on_device(
        key, lambda: _backward_task_table(B * H_KV, H // H_KV, N, N_KV, D, causal, grid, window),
        q.device)
    if deterministic:
        table = torch.cat((table, table.new_zeros(dq_counters(B, H, N))))
    return table


def dq_counters(b: int, h: int, n: int) -> int:
    """The deterministic backward's dQ counters: one per 64-row query tile,
    padded to whole 16-byte vectors (the kernel finds them from TASKS' end)."""
    tiles = b * h * -(-n // 64)
    return -(-tiles // 4) * 4


# What a query row keeps in L2 while the causal backward's tasks walk it, per
# element of D, for sizing its groups of K/V heads: Q and dO (2 bytes each)
# and dQ's f32 sums (4). Counting dQ halves the groups against Q and dO
# alone: 1.00-1.12x over eleven shapes on the H200 (BENCHMARKS.md).
QUERY_ROW_BYTES_PER_D = 2 + 2 + 4


def _backward_task_table(kv_heads: int, q_per_kv: int, n: int, n_kv: int, d: int,
                         causal: bool, grid: int, window: tuple[int, int] = (-1, -1)):
    import numpy as np
    kv_blocks, q_blocks = -(-n_kv // 128), -(-n // 64)
    if window != (-1, -1):          # the kernel's first_q_block / end_q_block, per K/V block
        left, right, kvb = window[0], 0 if causal else window[1], np.arange(kv_blocks)
        first = np.zeros(kv_blocks, dtype=np.int64) if right < 0 else \
            np.minimum(np.maximum((kvb * 128 - (n_kv - n) - right) // 64, 0), q_blocks - 1)
        end = np.full(kv_blocks, q_blocks) if left < 0 else \
            np.maximum(np.minimum((kvb * 128 + 127 - (n_kv - n) + left) // 64 + 1, q_blocks),
                       first + 1)
        ids = np.arange(kv_heads * kv_blocks)
        steps = q_per_kv * (end - first)[ids % kv_blocks]
        return schedule.table(ids, steps + 2 * TASK_OVERHEAD_BLOCKS, grid)
    if not causal:
        ids = np.arange(kv_heads * kv_blocks)
        return schedule.table(ids, np.ones(len(ids)), grid)
    per_group = max(min(L2_KV_BYTES // (QUERY_ROW_BYTES_PER_D * d) // (q_per_kv * n), kv_heads),
                    1)
    longest_first = np.arange(kv_blocks)
    ids = schedule.head_groups(kv_heads, per_group, longest_first, kv_blocks)
    first = np.maximum((ids % kv_blocks * 128 - (n_kv - n)) // 64, 0)
    steps = q_per_kv * np.maximum(q_blocks - first, 0)
    # A step (one 64-row query block against 128 keys) costs about half a
    # forward key block.
    return schedule.table(ids, steps + 2 * TASK_OVERHEAD_BLOCKS, grid)


def lse_rows(q):
    """(B, H, N') float32 on q's device for q (B, H, N, D), N' >= N a multiple
    of 4: lse's rows padded to whole 16-byte vectors (the kernels' row rule;
    they write and read the padding)."""
    import torch
    B, H, N = q.shape[:3]
    return q.new_empty(B, H, -(-N // 4) * 4, dtype=torch.float32)


def lse_like(q):
    """(B, H, N) float32: the first N of each of lse_rows(q)'s rows."""
    # narrow, not [..., :N]: a CPU-only torch cannot slice a fake CUDA tensor
    return lse_rows(q).narrow(-1, 0, q.shape[2])


def padded_rows(lse):
    """A (B, H, N) f32 tensor as (B, H, N') with N' >= N a multiple of 4 (rows
    of whole 16-byte vectors, the kernels' rule): a view of the same memory
    when its rows are padded there (as `lse_like` makes them),
    else a padded copy. The padding holds anything: kernels write it or mask
    it."""
    import torch
    B, H, N = lse.shape
    n4 = -(-N // 4) * 4
    if lse.stride(-1) == 1 and not (lse.stride(0) % 4 or lse.stride(1) % 4 or
                                    lse.data_ptr() % 16):
        if n4 == N:                 # (whole vectors already: no view to make)
            return lse
        try:
            return lse.as_strided((B, H, n4), lse.stride())
        except RuntimeError:        # the padding is past the end of its storage
            pass
    padded = torch.empty(B, H, n4, dtype=lse.dtype, device=lse.device)
    padded.narrow(-1, 0, N).copy_(lse)
    return padded


def attention_backward(do, q, k, v, o, lse, causal: bool, scale: float,
                       deterministic: bool = False, left: int = -1, right: int = -1,
                       softcap: float = 0.0, dlse=None):
    """(dq, dk, dv) of attention(q, k, v, causal, scale) given its output o, its
    log-sum-exp lse (B, H, N) and the output's gradient do; dk, dv have k's and
    v's shapes (GQA: summed over the query heads of each K/V head).
    deterministic=True: dq's f32 sums in a fixed order (the same bits on every
    run), at some speed (tasks wait for their turn at each dQ tile).
    left, right, softcap: the forward's window and cap (the window not with
    deterministic); dlse: the gradient of lse (B, H, N), or None; the arguments of
    the op torch.ops.tk_mlir.attention_backward."""
    return planned_backward(q, k, causal, scale, deterministic, left, right, softcap)(
        do, q, k, v, o, lse, dlse)


def planned_backward(q, k, causal: bool, scale: float, deterministic: bool = False,
                     left: int = -1, right: int = -1, softcap: float = 0.0,
                     same_signature: bool = False):
    """`run(do, q, k, v, o, lse, dlse=None) -> (dq, dk, dv)`: attention_backward for
    tensors shaped like q and k (and on their device), its configuration,
    grid, task table and launches chosen once. same_signature: q, k, v, o
    and lse are laid out alike on every call (a remembered eager forward's
    and its saved tensors): do, whose layout autograd chooses, is copied
    into o's where it differs, and the launches read addresses alone
    (eager.launcher); dlse's launch is checked every call."""
    import torch
    window = (left, right)
    rows = _backward_query_rows(q.shape[-1], causal, window, softcap, deterministic)
    cfg = _backward_config(q.shape[-1], softcap, rows)
    if window != (-1, -1):
        if deterministic:
            raise NotImplementedError("attention backward: deterministic=True takes no window "
                                      "yet (its dQ turns assume every K/V block before a "
                                      "tile's reaches it)")
        cfg.update(WINDOW_LEFT=window[0], WINDOW_RIGHT=window[1])
    grid = num_sms(q.get_device())
    # deterministic: a new table per launch (its zeroed dQ counters are the launch's)
    table = None if deterministic else backward_tasks(q, k, causal, grid, False, window)
    kernels = backward_launcher(q.shape, grid, scale, same_signature=same_signature,
                                CAUSAL=causal, DETERMINISTIC=deterministic, **cfg)

    def run(do, q, k, v, o, lse, dlse=None):
        if not same_signature:
            do = checks.kernel_operand(do)
        else:
            do = eager.laid_out(do, o.shape, o.stride(), o.dtype)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        tasks = schedule.pin_if_capturing(table) if table is not None else \
            backward_tasks(q, k, causal, grid, True)     # (a new one: a graph's own)
        dq = kernels(do, q, k, v, o, lse, dk, dv, tasks, dlse)
        # dq laid out like q (as the op's fake says: a compiled backward checks it).
        return dq.to(q.dtype), dk, dv
    return run


def launch_backward(do, q, k, v, o, lse, dk, dv, tasks, grid: int, scale: float, dlse=None,
                    **cfg):
    """The backward's two kernels on (B, H, N, D) tensors as they read them
    (lse (B, H, N) f32, and its gradient dlse like it or None), dK and dV
    written into dk, dv; cfg: the backward kernel's constexprs
    (_backward_config's and the masks'). Returns dq (B, H, N, D) f32, laid out
    like q."""
    return backward_launcher(q.shape, grid, scale, **cfg)(do, q, k, v, o, lse, dk, dv, tasks,
                                                          dlse)


def backward_launcher(shape, grid: int, scale: float, same_signature: bool = False, **cfg):
    """`launch(do, q, k, v, o, lse, dk, dv, tasks, dlse=None) -> dq`: launch_backward for
    (B, H, N, D) tensors of `shape`, its two kernels' launches made once
    (same_signature: planned_backward's; the dlse launch is never bound)."""
    import torch
    B, H, N, D = shape
    n4 = -(-N // 4) * 4                        # rows of whole 16-byte vectors
    prep = eager.launcher(attention_backward_prep_kernel, same_signature)(
        (tk.cdiv(N, 64), H, B), D=D)
    prep_dlse = attention_backward_prep_kernel.launcher((tk.cdiv(N, 64), H, B), D=D,
                                                        WITH_DLSE=True)
    # scale folded into P (one decision for both kernels) for bf16, not f16
    # (its P' would be √D times nearer the subnormals)
    mains = {in_p: eager.launcher(attention_backward_kernel, same_signature)(
        (grid,), D=D, SCALE_IN_P=in_p, **cfg) for in_p in (True, False)}
    scale2 = scale * math.log2(math.e)
    # SHIFT's unit: the scores', or the exponent's where the scores are capped
    shift_unit = LOG2E if cfg.get("SOFTCAP", 0.0) else 1.0 / scale

    def launch(do, q, k, v, o, lse, dk, dv, tasks, dlse=None):
        shift, neg_delta = (torch.empty(B, H, n4, dtype=torch.float32, device=q.device)
                            for _ in range(2))
        # laid out like q, so that dq's conversion to q's dtype is a plain copy (a
        # (B, N, H, D) view's, or varlen's packed rows, took 1.4x as long strided)
        dq = torch.empty_like(q, dtype=torch.float32)
        in_p = q.dtype == torch.bfloat16
        log_scale, grad_scale = (math.log(scale), 1.0 / scale) if in_p else (0.0, scale)
        if dlse is None:                                               # (dLSE unread)
            prep(o, do, padded_rows(lse), neg_delta, neg_delta, shift, dq, log_scale,
                 shift_unit)
        else:
            prep_dlse(o, do, padded_rows(lse), padded_rows(dlse.float()), neg_delta, shift, dq,
                      log_scale, shift_unit)
        mains[in_p](q, k, v, do, shift, neg_delta, dq, dk, dv, tasks, scale2, grad_scale)
        return dq
    return launch
