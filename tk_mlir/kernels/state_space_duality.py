"""Mamba-2's state-space duality layer (SSD), chunked, forward and backward.

    from tk_mlir.kernels import ssd
    y = ssd(x, dt, A, B, C, D=D)                          # mamba_chunk_scan_combined's
    y, state = ssd(x, dt, A, B, C, return_state=True)    # state: (b, h, p, n) f32

Per head, with a_t = dt_t·A (the log of the step's decay):

    h_t = exp(a_t)·h_{t-1} + dt_t·B_t x_tᵀ        (an n x p state)
    y_t = C_tᵀ h_t + D·x_t

This is gated linear attention with one gate per head and token: q = C,
k = dt·B, v = x. The kernels walk a (batch, head)'s sequence 64 tokens (a
chunk) at a time, one block per 64 columns of x, one warpgroup. With L_t the
cumulative a within the chunk (L_last at its last token):

    y_t  = exp(L_t)·C_t·H + Σ_{s<=t} (C_t·B_s)·exp(L_t - L_s)·dt_s·x_s + D·x_t
    H   <- exp(L_last)·H + Σ_s exp(L_last - L_s)·dt_s·B_s x_sᵀ

H, the state before the chunk, is carried in f32 wgmma accumulators and read
by the next chunk as bf16 in shared memory (as chunked_linear_attention's
state). Where one walk per (batch, head, 64 columns of x) would leave SMs
idle, the forward cuts a sequence into segments of whole chunks, as linear
attention does (segments_of): a sums kernel builds each segment's state
from zero, a prefix kernel carries them across the segments, each decayed
by its segment's exp(Σ a), and the main kernel walks its segment from
there. Every exponent is <= 0 when a <= 0 (A < 0, dt > 0, as Mamba-2 has
them); the cumulative sums L, exp(L_last - L) and exp(L_last) are made in
torch (f32, a few bytes per token). The backward: a pass in order gives dC
(the state before each chunk), a pass in reverse dB and dx (the state's
gradient after it); where its walks are fewer than the SMs it cuts them
into segments too, each starting from its state (the forward's sums and
prefix, again) and its end gradient (a gradient-sums kernel and the prefix
run last to first). The decays' gradient is the sum, from each token on, of
dL_t = C_t·dC_t - k_t·dk_t (FlashLinearAttention's dg for gated linear
attention), a sum whose terms cancel: the kernels sum a chunk's own pairs
(t, s) once, in f32, leaving out the diagonal, and give the terms that go
through the state the roundings of the products that built it (the state
read in two bf16 halves), so that what cancels in exact arithmetic cancels
here too.
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks
from tk_mlir.kernels import chunked_linear_attention
from tk_mlir.kernels.chunked_linear_attention import (C, OPERAND, _heads_first, publish,
                                                       publish_split, segment, segment_length)
from tk_mlir.kernels.device import num_sms
from tk_mlir.kernels.gemm import padded_rows

CHUNK = C               # tokens per chunk (linear attention's: segment() walks them)
MAX_STATE = 128         # n: the state's rows (a 64- or 128-row tile, masked)


@tk.func
def acc(cols):
    """A zero f32 accumulator of the chunk's rows and `cols` columns."""
    return tk.zeros((CHUNK, cols), f32, layout="row", scope="warpgroup")


@tk.func
def chunk_decays(LC, KD, DT, DECAY, b, h, c):
    """Chunk c's L (cumulative a), exp(L_last - L), dt (vectors) and
    exp(L_last) (a scalar)."""
    lc = tk.load(LC, (b, h, c), (CHUNK,), scope="warpgroup")
    kd = tk.load(KD, (b, h, c), (CHUNK,), scope="warpgroup")
    dt = tk.load(DT, (b, h, c), (CHUNK,), scope="warpgroup")
    return lc, kd, dt, tk.load(DECAY, (b, h, c))


@tk.func
def chunk_dt(DT, b, h, c):
    """Chunk c's dt, a vector of its own (a loaded vector takes the layout of
    the one tile it is used with: rows and columns each load theirs)."""
    return tk.load(DT, (b, h, c), (CHUNK,), scope="warpgroup")


@tk.func
def decay_matrix(LC, b, h, c):
    """exp(L_t - L_s) at (query t, key s) for s <= t, 0 after: chunk c's weights."""
    d = tk.zeros((CHUNK, CHUNK), f32, layout="row", scope="warpgroup").add_row(
        tk.load(LC, (b, h, c), (CHUNK,), scope="warpgroup")).sub_col(
        tk.load(LC, (b, h, c), (CHUNK,), scope="warpgroup"))
    return tk.where(d.col_indices() <= d.row_indices(), d, float("-inf")).exp()


@tk.func
def load_keys(Bm, X, bs, ks, xs, b, g, h, c, pb, kd, dt, NS):
    """Chunk c's B (bs, unless None), its keys dt·B·exp(L_last - L) (ks: what
    the state adds) and its 64 columns pb of x (xs), into shared memory."""
    bt = tk.load(Bm, (b, g, c, 0), (CHUNK, NS), layout="row", scope="warpgroup").to(f32)
    if bs is not None:
        tk.store(bs, bt.to(bs.dtype))
    tk.store(ks, bt.mul_row(dt * kd).to(ks.dtype))
    tk.store(xs, tk.load(X, (b, h, c, pb), (CHUNK, 64), layout="row", scope="warpgroup")
             .to(xs.dtype))


@tk.func
def load_queries(Cm, dY, cs, qs, gs, b, g, h, c, pb, lc, NS):
    """Chunk c's C (cs, unless None), its queries exp(L)·C (qs: what the
    state's gradient adds) and its 64 columns pb of dy (gs), into shared
    memory: the backward's twin of load_keys."""
    ct = tk.load(Cm, (b, g, c, 0), (CHUNK, NS), layout="row", scope="warpgroup").to(f32)
    if cs is not None:
        tk.store(cs, ct.to(cs.dtype))
    tk.store(qs, ct.mul_row(lc.exp()).to(qs.dtype))
    tk.store(gs, tk.load(dY, (b, h, c, pb), (CHUNK, 64), layout="row", scope="warpgroup")
             .to(gs.dtype))


@tk.func
def skip(t, X, Dh, b, h, c, pb, HAS_D):
    """t + D·x of chunk c's columns pb (D a scalar per head), with HAS_D."""
    if HAS_D:
        t = t + tk.load(X, (b, h, c, pb), (CHUNK, 64), layout="row", scope="warpgroup") \
            .to(f32) * tk.load(Dh, (h,))
    return t


@tk.func
def first_state(H0, b, h, s, pb, NS, INITIAL):
    """The state before the first token: H0's state s (its columns pb), or zero."""
    H = tk.zeros((NS, 64), f32, layout="row", scope="warpgroup")
    if INITIAL:
        H = tk.load(H0, (b, h, s, pb), (NS, 64), layout="row", scope="warpgroup")
    return H


@tk.kernel(num_warps=4)
def ssd_segment_sums_kernel(X: tk.gl, Bm: tk.gl, KD: tk.gl, DT: tk.gl, DECAY: tk.gl,
                            SUMS: tk.gl, SEG: int, NS: tk.constexpr = 128,
                            HG: tk.constexpr = 1):
    """One segment's state from zero, H <- exp(L_last)·H + Σ_s exp(L_last -
    L_s)·dt_s·B_s x_sᵀ over its SEG chunks (x's columns pb), into SUMS (b, h,
    segments·NS, p) f32 (rows past n zero): what the segments after it add,
    decayed. The tensors as ssd_kernel reads them; grid (cdiv(p, 64), h,
    b·segments), blocks placed as linear attention's segment() reads them."""
    pb, h, b, s, lo, hi = segment(X.shape[2], SEG)
    g = h // HG
    ks = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    xs = tk.shared_tile(OPERAND, (CHUNK, 64), swizzle=128)
    H = tk.zeros((NS, 64), f32, layout="row", scope="warpgroup")
    for c in range(lo, hi):
        kd = tk.load(KD, (b, h, c), (CHUNK,), scope="warpgroup")
        dt = tk.load(DT, (b, h, c), (CHUNK,), scope="warpgroup")
        load_keys(Bm, X, None, ks, xs, b, g, h, c, pb, kd, dt, NS)
        tk.barrier()
        H = tk.mma_AtB(H * tk.load(DECAY, (b, h, c)), ks, xs)
        tk.mma_wait(0)
        tk.barrier()                     # every thread's MMAs read ks, xs
    tk.store(SUMS, H, (b, h, s, pb))


@tk.kernel(num_warps=4)
def ssd_segment_prefix_kernel(SUMS: tk.gl, FADE: tk.gl, H0: tk.gl, STARTS: tk.gl, H1: tk.gl,
                              SEGMENTS: int, NS: tk.constexpr = 128,
                              INITIAL: tk.constexpr = False, REVERSE: tk.constexpr = False):
    """Each segment's starting state: H0 (INITIAL; else zero), then for each
    segment in turn start_s, and H <- FADE[s]·H + SUMS[s] (FADE (b, h,
    segments') f32: the segment's exp(Σ a)); the state after the last into
    H1 (b, h, NS, p). SUMS, STARTS: (b, h, segments·NS, p) f32. REVERSE: the
    segments last to first (the backward's state gradients: H0 the final
    state's, each segment's at its end into STARTS, the initial state's into
    H1). Grid (cdiv(p, 64), h, b)."""
    pb, h, b = tk.block_id(0), tk.block_id(1), tk.block_id(2)
    H = tk.zeros((NS, 64), f32)
    if INITIAL:
        H = tk.load(H0, (b, h, 0, pb), (NS, 64))
    part = tk.load(SUMS, (b, h, SEGMENTS - 1 if REVERSE else 0, pb), (NS, 64))
    for i in range(SEGMENTS):
        s = SEGMENTS - 1 - i if REVERSE else i
        tk.store(STARTS, H, (b, h, s, pb))
        H = H * tk.load(FADE, (b, h, s)) + part
        after = max(s - 1, 0) if REVERSE else min(s + 1, SEGMENTS - 1)
        part = tk.load(SUMS, (b, h, after, pb), (NS, 64))                        # in flight
    tk.store(H1, H, (b, h, 0, pb))


@tk.kernel(num_warps=4)
def ssd_segment_grad_sums_kernel(Cm: tk.gl, LC: tk.gl, DECAY: tk.gl, dY: tk.gl, SUMS: tk.gl,
                                 SEG: int, NS: tk.constexpr = 128, HG: tk.constexpr = 1):
    """One segment's state gradient from zero at its end, walked back over
    its SEG chunks: dH <- exp(L_last)·dH + (exp(L)·C)ᵀ dy (dy's columns pb),
    into SUMS (b, h, segments·NS, p) f32: what it adds to the gradient of
    the state before it. The tensors as ssd_backward_kernel reads them;
    grid (cdiv(p, 64), h, b·segments)."""
    pb, h, b, s, lo, hi = segment(dY.shape[2], SEG)
    g = h // HG
    qs = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    gs = tk.shared_tile(OPERAND, (CHUNK, 64), swizzle=128)
    dH = tk.zeros((NS, 64), f32, layout="row", scope="warpgroup")
    for i in range(hi - lo):
        c = hi - 1 - i
        lc = tk.load(LC, (b, h, c), (CHUNK,), scope="warpgroup")
        load_queries(Cm, dY, None, qs, gs, b, g, h, c, pb, lc, NS)
        tk.barrier()
        dH = tk.mma_AtB(dH * tk.load(DECAY, (b, h, c)), qs, gs)
        tk.mma_wait(0)
        tk.barrier()                     # every thread's MMAs read qs, gs
    tk.store(SUMS, dH, (b, h, s, pb))


@tk.kernel(num_warps=4)
def ssd_kernel(X: tk.gl, Bm: tk.gl, Cm: tk.gl, LC: tk.gl, KD: tk.gl, DT: tk.gl, DECAY: tk.gl,
               Dh: tk.gl, Y: tk.gl, H0: tk.gl, H1: tk.gl, SEG: int, NS: tk.constexpr = 128,
               HG: tk.constexpr = 1, HAS_D: tk.constexpr = False,
               INITIAL: tk.constexpr = False, FINAL: tk.constexpr = False):
    """Y[..., 64·pb:64·pb+64] of SSD for one segment (SEG chunks) of a
    (batch, head)'s sequence. X, Y: (b, h, l, p); Bm, Cm: (b, g, l, n), head
    h reading group h // HG; LC, KD, DT: (b, h, l') f32, l' a multiple of 64
    (L, exp(L_last - L), dt; dt 0 past l); DECAY: (b, h, >= l' / 64) f32
    exp(L_last); Dh: (h,) f32 (HAS_D); H0: (b, h, n, p) f32, the initial
    state, or with several segments (b, h, segments·NS, p), each one's
    starting state (INITIAL; else zero: one segment); H1: (b, h, n,
    p) f32, the state after the last token (FINAL: one segment); unread
    otherwise. NS: n rounded up to 64 or 128. Grid (cdiv(p, 64), h,
    b·segments)."""
    pb, h, b, part, lo, hi = segment(X.shape[2], SEG)
    g = h // HG
    cs = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    bs = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    ks = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    xs = tk.shared_tile(OPERAND, (CHUNK, 64), swizzle=128)
    ss = tk.shared_tile(OPERAND, (NS, 64), swizzle=128)
    H = first_state(H0, b, h, part, pb, NS, INITIAL)
    publish(ss, H)
    for c in range(lo, hi):
        lc, kd, dt, decay = chunk_decays(LC, KD, DT, DECAY, b, h, c)
        load_keys(Bm, X, bs, ks, xs, b, g, h, c, pb, kd, dt, NS)
        tk.store(cs, tk.load(Cm, (b, g, c, 0), (CHUNK, NS), layout="row", scope="warpgroup")
                 .to(cs.dtype))
        tk.barrier()
        y = tk.mma_AB(acc(64), cs, ss)
        s = tk.mma_ABt(acc(CHUNK), cs, bs)
        tk.mma_wait(0)
        p = (s * decay_matrix(LC, b, h, c)).mul_col(chunk_dt(DT, b, h, c))
        y = tk.mma_AB(y.mul_row(lc.exp()), p.to(OPERAND), xs)
        H = tk.mma_AtB(H * decay, ks, xs)
        tk.mma_wait(0)
        tk.store(Y, skip(y, X, Dh, b, h, c, pb, HAS_D).to(Y.dtype), (b, h, c, pb))
        tk.barrier()                     # every thread's MMAs read ss, cs, bs, ks, xs
        publish(ss, H)
    if FINAL:
        tk.store(H1, H, (b, h, 0, pb))


@tk.func
def row_dot(X, a, b, g, c, j):
    """Σ over the row of X's (b, g) chunk c, columns block j, times a."""
    return (tk.load(X, (b, g, c, j), (CHUNK, 64), layout="row", scope="warpgroup").to(f32)
            * a).row_sum()


@tk.func
def as_multiplied(X, V, W, b, g, h, c, j):
    """X's (b, g) chunk c, columns block j, times exp(V) (W None) or V·W per
    row (V, W: (b, h, l') like LC), rounded to bf16 as the MMAs read it: the
    state's terms of C·dC and k·dk then carry the very roundings of the
    products that built the state, and cancel as they should."""
    if W is None:
        v = tk.load(V, (b, h, c), (CHUNK,), scope="warpgroup").exp()
    else:
        v = tk.load(V, (b, h, c), (CHUNK,), scope="warpgroup") * \
            tk.load(W, (b, h, c), (CHUNK,), scope="warpgroup")
    t = tk.load(X, (b, g, c, j), (CHUNK, 64), layout="row", scope="warpgroup").to(f32)
    return t.mul_row(v).to(OPERAND).to(f32)


@tk.func
def total(parts, part):
    """parts + part, where parts may be None (the first of a static loop)."""
    return part if parts is None else parts + part


@tk.kernel(num_warps=4)
def ssd_backward_kernel(X: tk.gl, Bm: tk.gl, Cm: tk.gl, LC: tk.gl, KD: tk.gl, DT: tk.gl,
                        DECAY: tk.gl, Dh: tk.gl, dY: tk.gl, H0: tk.gl, dH1: tk.gl, dX: tk.gl,
                        dB: tk.gl, dC: tk.gl, DL: tk.gl, BDK: tk.gl, dH0: tk.gl, SEG: int,
                        NS: tk.constexpr = 128, HG: tk.constexpr = 1,
                        HAS_D: tk.constexpr = False, INITIAL: tk.constexpr = False,
                        FINAL_GRAD: tk.constexpr = False, INITIAL_GRAD: tk.constexpr = False,
                        SEGMENTS: tk.constexpr = 1):
    """The gradients of ssd_kernel for the 64 columns pb of x: dX (b, h, l,
    p) whole (D·dy included with HAS_D); dH0 (b, h, n, p) the initial
    state's (INITIAL; dH1 is the final state's, FINAL_GRAD); and this
    block's share, by atomic adds into zeroed f32 tensors, of: dB and dC (b,
    g, l, n; every head of the group and every column block adds its part),
    dB as dt·dk; BDK (b, h, l'), B_t·dk_t; DL (b, h, l'), the gradient of
    the cumulative decay at t (the sum of a over the whole sequence up to t)
    but for the final state's term: C_t·dC_t - k_t·dk_t, with the chunk's
    own pairs (t, s) summed directly in f32 and the diagonal left out (it
    cancels: the difference of two rounded copies of it would not).
    SEGMENTS > 1: one segment of SEG chunks per block (the grid as
    ssd_kernel's), H0 and dH1 holding each segment's state at its start and
    state gradient at its end (b, h, SEGMENTS·NS, p); else the whole
    sequence (SEG unread). SEGMENTS is a compile-time count so that ptxas
    re-derives the batch and segment from the block id where it needs them
    (divided by a run-time count, they are held across the loops and spill:
    160 bytes against 52). dH0 is written with INITIAL_GRAD (not with
    segments: the backward's prefix makes it then). Grid (2·cdiv(p, 64), h,
    b·SEGMENTS): the even blocks of the first axis walk their chunks in
    order, the odd ones in reverse, each pass on its own SM (the two share
    nothing but the atomic sums)."""
    pb, h = tk.block_id(0) // 2, tk.block_id(1)
    b, part = tk.block_id(2) // SEGMENTS, tk.block_id(2) % SEGMENTS
    lo, hi = 0, tk.cdiv(X.shape[2], CHUNK)
    if SEGMENTS > 1:
        lo = part * SEG
        hi = min(lo + SEG, hi)
    order_pass = tk.block_id(0) % 2 == 0
    g = h // HG
    cs = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    qs = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)        # exp(L)·C
    bs = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    ks = tk.shared_tile(OPERAND, (CHUNK, NS), swizzle=128)
    xs = tk.shared_tile(OPERAND, (CHUNK, 64), swizzle=128)
    gs = tk.shared_tile(OPERAND, (CHUNK, 64), swizzle=128)        # dy
    ps = tk.shared_tiles(OPERAND, (CHUNK, CHUNK), 2, swizzle=128)  # P, dy·xᵀ: transposed
    ss = tk.shared_tile(OPERAND, (NS, 64), swizzle=128)           # H, then dH
    sl = tk.shared_tile(OPERAND, (NS, 64), swizzle=128)           # (what bf16 leaves of it)

    if order_pass:
        # dC, chunks in order (the state before each chunk), and the pairs of DL.
        H = first_state(H0, b, h, part, pb, NS, INITIAL)
        publish_split(ss, sl, H)
        for c in range(lo, hi):
            lc, kd, dt, decay = chunk_decays(LC, KD, DT, DECAY, b, h, c)
            load_keys(Bm, X, bs, ks, xs, b, g, h, c, pb, kd, dt, NS)
            tk.store(cs, tk.load(Cm, (b, g, c, 0), (CHUNK, NS), layout="row", scope="warpgroup")
                     .to(cs.dtype))
            tk.store(gs, tk.load(dY, (b, h, c, pb), (CHUNK, 64), layout="row", scope="warpgroup")
                     .to(gs.dtype))
            tk.barrier()
            # pair (t, s), s < t: (dy_t·x_s)·(C_t·B_s)·e^(L_t-L_s)·dt_s, in C_t·dC_t
            # and in k_s·dk_s: summed over s (rows) and over t (columns).
            w = tk.mma_ABt(acc(CHUNK), gs, xs)
            s = tk.mma_ABt(acc(CHUNK), cs, bs)
            tk.mma_wait(0)
            w = (w * decay_matrix(LC, b, h, c)).mul_col(chunk_dt(DT, b, h, c))
            pairs = tk.where(w.col_indices() < w.row_indices(), w * s, 0.0)
            tk.atomic_add(DL, -pairs.col_sum(), (b, h, c))
            early = pairs.row_sum()
            w = w.to(OPERAND)
            el = lc.exp()
            for j in tk.static_range(NS // 64):     # 64 columns of dC at a time (registers)
                dc = tk.mma_ABt(acc(64), gs, ss.subtile(j, 64))
                dc = tk.mma_ABt(dc, gs, sl.subtile(j, 64))
                tk.mma_wait(0)              # C_t·dC_t's share from the state before:
                early = early + (as_multiplied(Cm, LC, None, b, g, h, c, j) * dc).row_sum()
                dc = tk.mma_AB(dc.mul_row(el), w, bs.column_block(j))
                tk.mma_wait(0)
                tk.atomic_add(dC, dc, (b, g, c, j))
            tk.atomic_add(DL, early, (b, h, c))
            H = tk.mma_AtB(H * decay, ks, xs)
            tk.mma_wait(0)
            tk.barrier()
            publish_split(ss, sl, H)
    else:
        # dB and dx, chunks in reverse: the state's gradient after each chunk.
        dH = first_state(dH1, b, h, part, pb, NS, FINAL_GRAD)
        tk.barrier()
        publish_split(ss, sl, dH)
        for i in range(hi - lo):
            c = hi - 1 - i
            lc, kd, dt, decay = chunk_decays(LC, KD, DT, DECAY, b, h, c)
            load_keys(Bm, X, bs, ks, xs, b, g, h, c, pb, kd, dt, NS)
            load_queries(Cm, dY, cs, qs, gs, b, g, h, c, pb, lc, NS)
            tk.barrier()
            m = decay_matrix(LC, b, h, c)
            s = tk.mma_ABt(acc(CHUNK), cs, bs)
            tk.mma_wait(0)
            tk.store(ps[0], (s * m).mul_col(chunk_dt(DT, b, h, c)).to(OPERAND))
            w = tk.mma_ABt(acc(CHUNK), gs, xs)
            tk.mma_wait(0)
            tk.store(ps[1], (w * m).to(OPERAND))
            tk.barrier()
            bdk = None                      # B_t·dk_t
            later = None                    # k_t·dk_t's share from the state after
            for j in tk.static_range(NS // 64):     # 64 columns of dk at a time (registers)
                dk = tk.mma_AtB(acc(64), ps[1], cs.column_block(j))
                late = tk.mma_ABt(acc(64), xs, ss.subtile(j, 64))
                late = tk.mma_ABt(late, xs, sl.subtile(j, 64))
                tk.mma_wait(0)
                later = total(later, (as_multiplied(Bm, DT, KD, b, g, h, c, j) * late).row_sum())
                dk = dk + late.mul_row(kd)
                bdk = total(bdk, row_dot(Bm, dk, b, g, c, j))
                tk.atomic_add(dB, dk.mul_row(dt), (b, g, c, j))
            tk.atomic_add(BDK, bdk, (b, h, c))
            tk.atomic_add(DL, -later, (b, h, c))
            dx = tk.mma_AtB(acc(64), ps[0], gs)
            dx = tk.mma_AB(dx, ks, ss)
            tk.mma_wait(0)
            tk.store(dX, skip(dx, dY, Dh, b, h, c, pb, HAS_D).to(dX.dtype), (b, h, c, pb))
            dH = tk.mma_AtB(dH * decay, qs, gs)
            tk.mma_wait(0)
            tk.barrier()
            publish_split(ss, sl, dH)
        if INITIAL_GRAD:
            tk.store(dH0, dH, (b, h, 0, pb))


def ssd(x, dt, A, B, C, chunk_size: int = 64, D=None, initial_state=None,
        return_state: bool = False):
    """Mamba-2's SSD layer (mamba_ssm's mamba_chunk_scan_combined without z
    or dt_bias): per head, h_t = exp(dt_t·A)·h_{t-1} + dt_t·B_t x_tᵀ and
    y_t = C_tᵀ h_t + D·x_t.

    x: (b, l, h, p) bf16 or f16, p a multiple of 8; dt: (b, l, h), already
    through softplus (> 0); A: (h,) (< 0); B, C: (b, l, g, n) of x's dtype,
    g dividing h (head i reads group i // (h / g)), n a multiple of 8 up to
    128; D: (h,) or None. dt, A and D may be float32 or x's dtype; all on x's
    CUDA device, x, B and C with contiguous last dims (views of one
    projection are fine). chunk_size is accepted as mamba_ssm takes it (a
    positive multiple of 16): the result is the recurrence whatever the
    chunking, and the kernels always cut the sequence in 64 tokens. (The
    state keywords are initial_state and return_state, where mamba_ssm has
    initial_states and return_final_states.) initial_state: (b, h, p, n) f32,
    the state before the first token. Returns y like x (contiguous), and with
    return_state=True also the state after the last token, (b, h, p, n) f32.
    Differentiable, to first order, in every input (x, dt, A, B, C, D and
    the initial state, the returned state's gradient included); under
    torch.compile the custom op torch.ops.tk_mlir.ssd.

    Numerics: the MMAs take bf16 operands (f16 inputs are rounded to bf16:
    the state needs bf16's range), the state and every sum are f32. dA is
    ill-conditioned (a sum over the sequence of terms ~100x its size that
    cancel): ~3e-3 from the float64 recurrence typically, up to ~1e-2.
    The gradients of B, C, dt and A are sums by atomic adds, in no fixed
    order: their last bits may differ between runs.

    The decays' signs are not checked (that needs a host synchronisation):
    with dt·A > 0 the chunk's exponents grow, and may overflow to inf. An
    inf or NaN in x, B or dt at token t also reaches the tokens before t
    in its 64-token chunk (a masked weight of 0 times inf is NaN in the
    chunk's MMA): pad sequences with zeros, not uninitialised memory."""
    import torch
    _check(x, dt, A, B, C, chunk_size, D, initial_state, return_state)
    checks.on_cuda("ssd", "x", x)
    from tk_mlir.kernels import custom_ops
    args = (x, dt, A, B, C, D, initial_state)
    if torch.compiler.is_compiling():
        y, h1 = torch.ops.tk_mlir.ssd(*args)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        y, h1 = custom_ops.EagerSsd.apply(*args)
    else:
        y, h1 = forward(*args)
    return (y, h1) if return_state else y


def _check(x, dt, A, B, C, chunk_size, D, initial_state, return_state) -> None:
    """Shapes, dtypes, devices and flags, each with the rule it breaks."""
    import numbers

    import torch
    fn = "ssd"
    halves = (torch.bfloat16, torch.float16)
    checks.tensor(fn, "x", x, ndim=4, dtypes=halves)
    b, l, h, p = x.shape
    floats = (torch.float32, x.dtype)
    checks.tensor(fn, "dt", dt, ndim=3, dtypes=floats)
    checks.tensor(fn, "A", A, ndim=1, dtypes=floats)
    checks.tensor(fn, "B", B, ndim=4, dtypes=(x.dtype,))
    checks.tensor(fn, "C", C, ndim=4, dtypes=(x.dtype,))
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C)):
        checks.like(fn, name, t, "x", x, dtype=False)
    checks.shape(fn, "dt", dt, (b, l, h), "(b, l, h) of x's (b, l, h, p)")
    checks.shape(fn, "A", A, (h,), "one per head")
    g, n = B.shape[2], B.shape[3]
    checks.shape(fn, "B", B, (b, l, g, n), "(b, l, g, n) with x's b and l")
    checks.shape(fn, "C", C, B.shape, "B's shape")
    if g == 0 or h % g:
        raise ValueError(f"{fn}: the groups g={g} of B and C must divide the heads h={h}")
    if not (n % 8 == 0 and 8 <= n <= MAX_STATE):
        raise ValueError(f"{fn}: the state size n (B's last dim) must be a multiple of 8 "
                         f"from 8 to {MAX_STATE}, got {n}")
    if p % 8 or p == 0:
        raise ValueError(f"{fn}: the head dim p (x's last dim) must be a positive multiple "
                         f"of 8 (rows of whole 16-byte vectors), got {p}")
    for name, t in (("x", x), ("B", B), ("C", C)):        # (dt goes through torch first)
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name}'s last dim must be contiguous (stride 1), got "
                             f"strides {tuple(t.stride())}")
    if D is not None:
        checks.tensor(fn, "D", D, ndim=1, dtypes=floats)
        checks.like(fn, "D", D, "x", x, dtype=False)
        checks.shape(fn, "D", D, (h,), "one per head")
    if initial_state is not None:
        checks.tensor(fn, "initial_state", initial_state, ndim=4, dtypes=(torch.float32,))
        checks.like(fn, "initial_state", initial_state, "x", x, dtype=False)
        checks.shape(fn, "initial_state", initial_state, (b, h, p, n), "(b, h, p, n)")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"{fn}: chunk_size must be an int, got {chunk_size!r}")
    if chunk_size <= 0 or chunk_size % 16:
        raise ValueError(f"{fn}: chunk_size must be a positive multiple of 16, got "
                         f"{chunk_size}")
    checks.flags(fn, return_state=return_state)


def _decays(dt, A):
    """(L, exp(L_last - L), dt, exp(L_last)) as the kernels read them: (b, h,
    l') f32 with l' = l rounded up to 64 (dt 0 past l, so L stays), and (b,
    h, l' / 64 padded to whole 16-byte rows); L the cumulative dt·A
    within each chunk."""
    import torch
    b, l, h = dt.shape
    pad = -l % CHUNK
    dt32 = torch.nn.functional.pad(dt.float().transpose(1, 2), (0, pad))
    lc = (dt32 * A.float()[None, :, None]).view(b, h, -1, CHUNK).cumsum(-1)
    last = lc[..., -1:]
    return (lc.view(b, h, -1), (last - lc).exp().view(b, h, -1), dt32.contiguous(),
            padded_rows(last[..., 0].exp()))


def _state_rows(n: int) -> int:
    """The state's tile rows for n: 64 or 128 (masked past n)."""
    return 64 if n <= 64 else 128


def forward(x, dt, A, B, C, D, h0):
    """(y, final state (b, h, p, n) f32) on checked tensors."""
    import torch
    b, l, h, p = x.shape
    n = B.shape[3]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h1 = torch.empty(b, h, n, p, dtype=torch.float32, device=x.device)
    if b and h and l:
        lc, kd, dt32, decay = _decays(dt, A)
        h0t = h0.transpose(-1, -2).contiguous() if h0 is not None else None
        d = padded_rows(D.float()) if D is not None else decay
        pbs, chunks = -(-p // 64), -(-l // CHUNK)
        seg = segments_of(b * h * pbs, chunks, x.get_device())
        # (views of one projection may start mid-vector: those are copied)
        heads = [_heads_first(checks.kernel_operand(t)) for t in (x, B, C)]
        flags = dict(NS=_state_rows(n), HG=h // B.shape[2])
        starts = h0t
        if seg < chunks:            # several segments: each starts from its predecessors'
            starts = _segment_starts(heads[0], heads[1], kd, dt32, decay, h0t, h1, seg, chunks,
                                     **flags)
        ssd_kernel[(pbs, h, b * -(-chunks // seg))](
            *heads, lc, kd, dt32, decay, d, _heads_first(y), h1 if starts is None else starts,
            h1, seg, HAS_D=D is not None, INITIAL=starts is not None, FINAL=seg == chunks,
            **flags)
    elif h0 is not None:                # no token: the state is the initial one
        h1.copy_(h0.transpose(-1, -2))
    else:
        h1.zero_()
    return y, h1.transpose(-1, -2).contiguous()


def segments_of(units: int, chunks: int, device: int) -> int:
    """Chunks per segment of the forward, for `units` (batch, head, 64 columns
    of x) walks of `chunks` chunks: linear attention's segment_length, aiming
    for FORWARD_BLOCKS_PER_SM, where the walks are fewer than the SMs, else
    one segment (the sums kernel's extra pass over the keys buys nothing
    when every SM has a walk: the path BENCHMARKS.md measured)."""
    return segment_length(units, chunks, device, FORWARD_BLOCKS_PER_SM) \
        if units < num_sms(device) else chunks


# Blocks per SM the forward's segments aim for: as many as run at once (an
# SSD block's 72 KB of shared memory lets 3). Linear attention's 8 cut long
# sequences into segments too short for their sums and prefix to pay: 1.22x
# slower at l = 16384, b1 h16 (at 2048 and 4096 both give the same segments;
# BENCHMARKS.md).
FORWARD_BLOCKS_PER_SM = 3


def _segment_starts(x, Bm, kd, dt32, decay, h0t, h1, seg: int, chunks: int, NS: int,
                    HG: int):
    """Each segment's starting state (b, h, segments·NS, p) f32 for ssd_kernel
    (x, Bm: the kernels' (b, h, l, p) and (b, g, l, n) views; h0t: the
    initial state as (b, h, n, p), or None), the final state written into
    h1 (b, h, n, p): the segments' own states (ssd_segment_sums_kernel),
    carried across them decayed by each segment's exp(Σ a), the product of
    its chunks' (ssd_segment_prefix_kernel)."""
    import torch
    b, h, l, p = x.shape
    segments = -(-chunks // seg)
    sums = x.new_empty(b, h, segments * NS, p, dtype=torch.float32)
    ssd_segment_sums_kernel[(-(-p // 64), h, b * segments)](
        x, Bm, kd, dt32, decay, sums, seg, NS=NS, HG=HG)
    starts = torch.empty_like(sums)
    ssd_segment_prefix_kernel[(-(-p // 64), h, b)](
        sums, padded_rows(_segment_fades(decay, seg, chunks)), h1 if h0t is None else h0t,
        starts, h1, segments, NS=NS, INITIAL=h0t is not None)
    return starts


def _segment_fades(decay, seg: int, chunks: int):
    """(b, h, segments) f32: each segment's exp(Σ a), the product of its
    chunks' exp(L_last) (decay: (b, h, >= chunks))."""
    import torch
    b, h = decay.shape[:2]
    segments = -(-chunks // seg)
    return torch.nn.functional.pad(decay[..., :chunks], (0, segments * seg - chunks),
                                   value=1.0).view(b, h, segments, seg).prod(-1)


def backward_segments_of(units: int, chunks: int, device: int) -> int:
    """Chunks per segment of the backward, for `units` (batch, head, 64
    columns of x) walks of `chunks` chunks each pass: where the two passes'
    2·units walks are fewer than the SMs, enough segments (of MIN_SEGMENT
    chunks or more) for about two blocks per SM (one at a time fits: 128 KB
    of shared memory each), else one. Each segment costs its share of two
    extra walks (its start state and its end gradient, one MMA a chunk
    where the passes make five). The count of segments is a power of two:
    the backward kernel is compiled per count (SEGMENTS), so sequences of
    many lengths share a few. Not yet timed."""
    if 2 * units >= num_sms(device):
        return chunks
    wanted = max(1, min(chunks // chunked_linear_attention.MIN_SEGMENT,
                        -(-num_sms(device) // units)))
    count = 1 << (wanted.bit_length() - 1)
    while count > 1 and -(-chunks // -(-chunks // count)) != count:
        count //= 2                     # (segments of cdiv(chunks, count) make fewer)
    return -(-chunks // count)


def _segment_ends(Cm, lc, decay, dy, dh1t, dh0t, seg: int, chunks: int, NS: int, HG: int):
    """Each segment's state gradient at its end (b, h, segments·NS, p) f32 for
    ssd_backward_kernel (Cm, dy: the kernels' (b, g, l, n) and (b, h, l, p)
    views; dh1t: the final state's gradient as (b, h, n, p), or None), the
    initial state's gradient written into dh0t (b, h, n, p): each segment's
    own (ssd_segment_grad_sums_kernel), carried back across the segments
    decayed as the forward carries the states (ssd_segment_prefix_kernel,
    REVERSE)."""
    import torch
    b, h, l, p = dy.shape
    segments = -(-chunks // seg)
    sums = dy.new_empty(b, h, segments * NS, p, dtype=torch.float32)
    ssd_segment_grad_sums_kernel[(-(-p // 64), h, b * segments)](
        Cm, lc, decay, dy, sums, seg, NS=NS, HG=HG)
    ends = torch.empty_like(sums)
    ssd_segment_prefix_kernel[(-(-p // 64), h, b)](
        sums, padded_rows(_segment_fades(decay, seg, chunks)),
        dh0t if dh1t is None else dh1t, ends, dh0t, segments, NS=NS,
        INITIAL=dh1t is not None, REVERSE=True)
    return ends


def backward(dy, dh1, x, dt, A, B, C, D, h0, h1):
    """(dx, ddt, dA, dB, dC, dD, dh0) of `forward` given y's gradient dy and
    the final state's dh1 (either may be None: zero), h1 the final state
    forward returned. dD, dh0 None without D, h0."""
    import torch
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    f32_ = torch.float32
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dB32 = torch.zeros(b, g, l, n, dtype=f32_, device=x.device)
    dC32 = torch.zeros_like(dB32)
    dL = torch.zeros(b, h, -(-l // CHUNK) * CHUNK, dtype=f32_, device=x.device)  # whole rows
    bdk = torch.zeros_like(dL)
    dh0t = torch.empty(b, h, n, p, dtype=f32_, device=x.device) if h0 is not None else None
    if dy is None:
        dy = torch.zeros_like(x)
    if b and h and l:
        lc, kd, dt32, decay = _decays(dt, A)
        h0t = h0.transpose(-1, -2).contiguous() if h0 is not None else None
        dh1t = dh1.transpose(-1, -2).contiguous() if dh1 is not None else None
        d = padded_rows(D.float()) if D is not None else decay
        pbs, chunks = -(-p // 64), -(-l // CHUNK)
        seg = backward_segments_of(b * h * pbs, chunks, x.get_device())
        xh, bh, ch, dyh = (_heads_first(checks.kernel_operand(t)) for t in (x, B, C, dy))
        flags = dict(NS=_state_rows(n), HG=h // g)
        starts, ends = h0t, dh1t
        if seg < chunks:        # each segment from its start state and end gradient
            scratch = torch.empty(b, h, n, p, dtype=f32_, device=x.device)
            starts = _segment_starts(xh, bh, kd, dt32, decay, h0t, scratch, seg, chunks,
                                     **flags)
            ends = _segment_ends(ch, lc, decay, dyh, dh1t, dh0t if h0 is not None else scratch,
                                 seg, chunks, **flags)
        ssd_backward_kernel[(2 * pbs, h, b * -(-chunks // seg))](
            xh, bh, ch, lc, kd, dt32, decay, d, dyh, dL if starts is None else starts,
            dL if ends is None else ends, _heads_first(dx), dB32, dC32, dL, bdk,
            dh0t if h0 is not None else dL, seg, HAS_D=D is not None,
            INITIAL=starts is not None, FINAL_GRAD=ends is not None,
            INITIAL_GRAD=h0 is not None and seg == chunks, SEGMENTS=-(-chunks // seg), **flags)
    else:
        dx.zero_()
        if h0 is not None and dh1 is not None:
            dh0t.copy_(dh1.transpose(-1, -2))
        elif h0 is not None:
            dh0t.zero_()
    # The decays: a_t's gradient is the sum of dL over the tokens from t on
    # (L_t is a sum of a up to t), the final state's <dh1, h1> (its own
    # exp(L)) counted at the last token.
    dt_h = dt.float().transpose(1, 2)                               # (b, h, l)
    dL, bdk = dL[..., :l], bdk[..., :l]
    if dh1 is not None and l:
        dL[..., -1] += (dh1.float() * h1).sum((-1, -2))
    da = dL.flip(-1).cumsum(-1).flip(-1)
    ddt = (A.float()[None, :, None] * da + bdk).transpose(1, 2).to(dt.dtype)
    dA = (dt_h * da).sum((0, 2)).to(A.dtype)
    dD = None
    if D is not None:
        dD = (dy.float() * x.float()).sum((0, 1, 3)).to(D.dtype)
    dB, dC = (t.transpose(1, 2).to(B.dtype, memory_format=torch.contiguous_format)
              for t in (dB32, dC32))
    dh0 = dh0t.transpose(-1, -2).contiguous() if h0 is not None else None
    return dx, ddt.contiguous(), dA, dB, dC, dD, dh0
