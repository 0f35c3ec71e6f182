"""Linear attention with a feature map, chunked, forward and backward.

    from tk_mlir.kernels import linear_attention
    o = linear_attention(q, k, v, feature_map="elu1")          # (B, N, H, D), causal
    o, state = linear_attention(q, k, v, return_state=True)    # state: (S, z), f32

With φ the feature map and q scaled first, causal:

    S_t = S_{t-1} + φ(k_t) v_tᵀ      z_t = z_{t-1} + φ(k_t)
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)·z_t + 1e-6)        (normalize=False: φ(q_t)ᵀ S_t)

and not causal, S and z summed over every token. A (batch, head)'s
sequence is cut into segments of whole chunks (64 tokens), one block per
(batch, head, segment, 64 columns of v), one warpgroup: a first kernel sums each
segment's φ(K)ᵀV, a second turns the sums into each segment's starting
state, and the main kernel walks its segment a chunk at a time: within a
chunk the masked scores φ(Q)·φ(K)ᵀ times V, across chunks the f32 state S
(D_k x 64) carried in wgmma accumulators and read by the next chunk as bf16
in shared memory (as FlashLinearAttention's chunked kernels round it). z
rides along as a (D_k x 16) accumulator of φ(K)ᵀ·1 whose columns are equal,
read back in two bf16 halves (hi + lo) so the normaliser keeps f32's
precision. The backward recomputes the forward's chunk quantities: a pass
in order gives dq (the state S_{<c}), a pass in reverse dk and dv (the
state's gradient dH = Σ_{later} φ(q) dnumᵀ), each over the same segments.

DK in the kernels is the feature count: D_k for the elementwise maps; for
taylor2 the kernels read q and k of taylor.WIDTH columns and expand them
into DK = taylor.FEATURES features as they stage them
(taylor_linear_attention.py), and dq, dk go back through the expansion.
"""
from __future__ import annotations

import math

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks
from tk_mlir.kernels import taylor_linear_attention as taylor
from tk_mlir.kernels.device import num_sms

FEATURE_MAPS = (None, "elu1", "relu", "taylor2")   # taylor2: taylor_linear_attention.py
# The MMA operands and the state's copies in shared memory, whatever the
# inputs' dtype: bf16 has f32's range, where f16's (65504) would overflow as
# the state's sums grow with the tokens.
OPERAND = tk.bf16
EPS = 1e-6
C = 64                  # tokens per chunk
# Blocks per SM a sequence's segments aim for (the forward kernel's registers
# hold two per SM: later waves cover the first's tail), and the fewest chunks
# in a segment (each segment costs a step of the sequential prefix kernel).
# Measured in BENCHMARKS.md.
BLOCKS_PER_SM = 8
MIN_SEGMENT = 4
# The columns of v a block takes for taylor2 (its 192 x VW f32 state, and
# the backward's gradient of it, live beside a chunk's tiles). 64 spills
# (416-664 bytes a thread in the causal forward, dq and dk/dv) and is faster
# all the same: half the blocks re-expand q and k (BENCHMARKS.md, 1.6-1.7x
# against 32, which does not spill in the forward).
TAYLOR_V_COLUMNS = 64


@tk.func
def feature(x, MAP):
    """φ(x) of an f32 tile: identity, elu(x) + 1 or relu(x)."""
    if MAP == "elu1":
        x = tk.where(x > 0.0, x + 1.0, x.exp())
    elif MAP == "relu":
        x = x.relu()
    return x


@tk.func
def feature_grad(x, dy, MAP):
    """dφ(x) given x and the gradient dy of φ(x)."""
    if MAP == "elu1":
        dy = tk.where(x > 0.0, dy, dy * x.exp())
    elif MAP == "relu":
        dy = tk.where(x > 0.0, dy, 0.0)
    return dy


@tk.func
def publish(st, acc):
    """An f32 accumulator into shared tile st as bf16 (the warpgroup's MMAs
    that read the old contents are complete: the caller's barrier)."""
    tk.store(st, acc.to(st.dtype))


@tk.func
def publish_split(hi, lo, acc):
    """An f32 accumulator as two bf16 shared tiles whose sum keeps f32's
    precision (an MMA reads each: two products, one f32 sum)."""
    top = acc.to(hi.dtype)
    tk.store(hi, top)
    tk.store(lo, (acc - top.to(f32)).to(lo.dtype))


@tk.func
def width(DK, MAP):
    """The columns of q and k the kernels read: D_k, but taylor2's inputs
    (its DK is the features')."""
    if MAP == "taylor2":
        return taylor.WIDTH
    return DK


@tk.func
def v_columns(MAP):
    """The columns of v (and o, dO, the state) one block takes."""
    if MAP == "taylor2":
        return TAYLOR_V_COLUMNS
    return 64


@tk.func
def v_tile(rows, MAP):
    """A shared tile of `rows` rows and v_columns(MAP) columns, as wgmma reads it."""
    return tk.shared_tile(OPERAND, (rows, v_columns(MAP)), swizzle=2 * v_columns(MAP))


@tk.func
def feature_tables(FX, MAP):
    """What taylor2's expansion reads (taylor.shared_tables' tiles), or None
    for the elementwise maps (FX unread)."""
    if MAP != "taylor2":
        return None
    return taylor.shared_tables(FX)


@tk.func
def key_loads(K, V, b, h, c, vb, DK, MAP):
    """Chunk c's K and the column block vb of its V, as loaded (issued: a
    caller that loads the next chunk's while this one's MMAs run hides the
    loads' latency)."""
    return (tk.load(K, (b, h, c, 0), (C, width(DK, MAP)), layout="row", scope="warpgroup"),
            tk.load(V, (b, h, c, vb), (C, v_columns(MAP)), layout="row", scope="warpgroup"))


@tk.func
def stage_keys(k, v, ks, vs, c, N, MAP, fx):
    """key_loads' chunk c into shared memory for the whole warpgroup's MMAs:
    φ(K) (rows past N zero: φ(0) may not be) and V."""
    if MAP == "taylor2":
        taylor.expand(k.to(f32), fx, ks, N - c * C, True)
    else:
        k = feature(k.to(f32), MAP)
        tk.store(ks, tk.where(k.row_indices() + c * C < N, k, 0.0).to(ks.dtype))
    tk.store(vs, v.to(vs.dtype))
    tk.barrier()


@tk.func
def query_load(Q, b, h, c, DK, MAP):
    """Chunk c's Q, as loaded (issued, as key_loads)."""
    return tk.load(Q, (b, h, c, 0), (C, width(DK, MAP)), layout="row", scope="warpgroup")


@tk.func
def stage_queries(x, qs, scale, MAP, fx):
    """query_load's chunk as φ(Q·scale) into shared tile qs, the A operand of
    wgmma (from shared memory: at D_k=128 its registers are what the state
    needs). The warpgroup's MMAs that read qs before are complete (each
    thread's mma_wait before the call; the barriers here cover the rest)."""
    x = x.to(f32) * scale
    if MAP == "taylor2":
        taylor.expand(x, fx, qs, C, False)
    else:
        tk.barrier()
        tk.store(qs, feature(x, MAP).to(qs.dtype))
    tk.barrier()
    return qs


@tk.func
def send_input_grad(G, dphi, X, fx, at, j, scale, dx, DK, MAP, VB, KEYS):
    """dφ's column block j (64 x 64 f32, complete) as the gradient of the
    inputs x·scale (X's chunk at tile coordinates `at`: queries, or KEYS
    with scale 1.0): put into G block by block for the elementwise maps;
    for taylor2 added into dx (None at j = 0) and put whole after the last
    block. Returns dx."""
    if MAP == "taylor2":
        part = taylor.input_grad(dphi, fx, j, KEYS)
        dx = part if dx is None else dx + part
        if j == DK // 64 - 1:
            put(G, dx * scale, at, VB)
    else:
        b, h, c, _ = at
        t = tk.load(X, (b, h, c, j), (C, 64), layout="row", scope="warpgroup").to(f32) * scale
        put(G, feature_grad(t, dphi, MAP) * scale, (b, h, c, j), VB)
    return dx


@tk.func
def state_dot(qb, zhi, zlo):
    """φ(q)·z of the state's z, 16 times per row (issued, not waited for)."""
    qz = tk.mma_AB(tk.zeros((C, 16), f32, layout="row", scope="warpgroup"), qb, zhi)
    return tk.mma_AB(qz, qb, zlo)


@tk.func
def denominator(qz, a_sum):
    """φ(q)·z + 1e-6 per row, given state_dot's (complete) result and, causal,
    the row sums of the chunk's own masked scores (None otherwise): taken as
    soon as the scores are, so the scores tile does not stay live."""
    den = qz.row_sum() * (1.0 / 16) + EPS
    if a_sum is not None:
        den = den + a_sum
    return den


def state_first(MAP, DK: int, key_pass: bool = False) -> bool:
    """Whether a backward pass issues the state's MMAs first in its loop
    body, as the forward does (ptxas keeps the state in its MMAs' registers;
    issued last, it parked it elsewhere and copied it back each chunk). Not
    for taylor2, whose expansions then spill more, nor in the dK/dV pass
    (key_pass) at D_k=64, where it ran 9% slower on the H200 (BENCHMARKS.md)."""
    return MAP != "taylor2" and not (key_pass and DK == 64)


@tk.func
def state_step(S, Z, ks, vs, ones):
    """S + φ(K)ᵀ·V and z + φ(K)ᵀ·1 of a chunk staged in ks, vs (issued)."""
    return tk.mma_AtB(S, ks, vs), tk.mma_AtB(Z, ks, ones)


@tk.func
def state_gradient_step(dH, dZ, qs, gs, es, NORMALIZE):
    """dH + φ(Q)ᵀ·g and dz + φ(Q)ᵀ·e of a chunk staged in qs, gs, es (issued)."""
    dH = tk.mma_AtB(dH, qs, gs)
    if NORMALIZE:
        dZ = tk.mma_AtB(dZ, qs, es)
    return dH, dZ


@tk.func
def segment(N, SEG):
    """(column block of v, head, batch, segment, first chunk, one past its
    last chunk) of this block: a segment is SEG chunks of a sequence, and
    the grid is (DV / v_columns, H, B·segments), block_id(2) = b·segments + s."""
    chunks = tk.cdiv(N, C)
    segments = tk.cdiv(chunks, SEG)
    s = tk.block_id(2) % segments
    return (tk.block_id(0), tk.block_id(1), tk.block_id(2) // segments, s, s * SEG,
            min(s * SEG + SEG, chunks))


@tk.func
def key_sums(K, V, ks, vs, ones, S, Z, b, h, vb, lo, hi, DK, MAP, fx):
    """S + Σ φ(K_c)ᵀ V_c and Z + Σ φ(K_c)ᵀ·1 over chunks lo .. hi-1 (`ones`
    filled; the warpgroup's MMAs on ks and vs complete when it returns).
    Chunk c+1's loads are in flight while chunk c's MMAs run."""
    k, v = key_loads(K, V, b, h, lo, vb, DK, MAP)
    for c in range(lo, hi):
        stage_keys(k, v, ks, vs, c, K.shape[2], MAP, fx)
        k, v = key_loads(K, V, b, h, min(c + 1, hi - 1), vb, DK, MAP)
        S, Z = state_step(S, Z, ks, vs, ones)
        tk.mma_wait(0)
        tk.barrier()
    return S, Z


@tk.func
def first_state(K, V, S0, Z0, ks, vs, ss, ones, zhi, zlo, b, h, s, vb, DK, MAP, CAUSAL,
                INITIAL, fx):
    """The state (S, Z) the first chunk's queries read, as accumulators and
    published to ss, zhi + zlo: with INITIAL, S0 and Z0's state s (causal:
    the one before segment s; not causal: the whole sequence's, s = 0);
    else zero, and, not causal, every chunk's keys and values summed. Also
    fills `ones`."""
    tk.store(ones, tk.full((C, 16), 1.0, ones.dtype, layout="row", scope="warpgroup"))
    S = tk.zeros((DK, v_columns(MAP)), f32, layout="row", scope="warpgroup")
    Z = tk.zeros((DK, 16), f32, layout="row", scope="warpgroup")
    if INITIAL:
        S = tk.load(S0, (b, h, s, vb), (DK, v_columns(MAP)), layout="row", scope="warpgroup")
        Z = tk.load(Z0, (b, h, s, 0), (DK, 16), layout="row", scope="warpgroup")
    elif not CAUSAL:         # every query sees the whole sequence's state
        S, Z = key_sums(K, V, ks, vs, ones, S, Z, b, h, vb, 0, tk.cdiv(K.shape[2], C), DK,
                        MAP, fx)
    publish(ss, S)
    publish_split(zhi, zlo, Z)
    tk.barrier()
    return S, Z


@tk.kernel(num_warps=4)
def linear_attention_segment_sums_kernel(K: tk.gl, V: tk.gl, SS: tk.gl, ZS: tk.gl, FX: tk.gl,
                                         SEG: int, DK: tk.constexpr = 64,
                                         MAP: tk.constexpr = "none"):
    """One segment's Σ φ(K_c)ᵀ V_c (V's column block vb) and Σ φ(K_c)ᵀ·1 over
    its SEG chunks, into SS (B, H, segments·DK, DV) and ZS (B, H,
    segments·DK, 16) f32 (z in every column): what the segments after it
    start from. K: (B, H, N, DK); V: (B, H, N, DV); FX: taylor2's tables
    (taylor.tables). Grid (DV / v_columns, H, B·segments)."""
    vb, h, b, s, lo, hi = segment(K.shape[2], SEG)
    fx = feature_tables(FX, MAP)
    ks = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    vs = v_tile(C, MAP)
    ones = tk.shared_tile(OPERAND, (C, 16), swizzle=32)
    tk.store(ones, tk.full((C, 16), 1.0, ones.dtype, layout="row", scope="warpgroup"))
    S, Z = key_sums(K, V, ks, vs, ones,
                    tk.zeros((DK, v_columns(MAP)), f32, layout="row", scope="warpgroup"),
                    tk.zeros((DK, 16), f32, layout="row", scope="warpgroup"), b, h, vb, lo, hi,
                    DK, MAP, fx)
    tk.store(SS, S, (b, h, s, vb))
    if vb == 0:
        tk.store(ZS, Z, (b, h, s, 0))


@tk.kernel(num_warps=4)
def linear_attention_segment_prefix_kernel(SS: tk.gl, ZS: tk.gl, S0: tk.gl, Z0: tk.gl,
                                           STARTS: tk.gl, ZSTARTS: tk.gl, S1: tk.gl,
                                           Z1: tk.gl, SEGMENTS: int, DK: tk.constexpr = 64,
                                           INITIAL: tk.constexpr = False,
                                           REVERSE: tk.constexpr = False,
                                           STORE_STARTS: tk.constexpr = True):
    """Each segment's starting state from the segments' own sums (the sums
    kernels' SS, ZS: (B, H, SEGMENTS·DK, DV) and (B, H, SEGMENTS·DK, 16)
    f32): S0 and Z0 (INITIAL: (B, H, DK, DV) and (B, H, DK, 16)) plus the sums of
    the segments before it (REVERSE: after it) into STARTS, ZSTARTS (shaped
    as SS, ZS; with STORE_STARTS), and the sum of them all into S1, Z1
    (shaped as S0, Z0). A block walks 64 of the DK rows and 64 of the DV
    columns (the sums are elementwise): grid (DV / 64 · DK / 64, H, B)."""
    R = DK // 64
    vb, j = tk.block_id(0) // R, tk.block_id(0) % R
    h, b = tk.block_id(1), tk.block_id(2)
    S = tk.zeros((64, 64), f32)
    Z = tk.zeros((64, 16), f32)
    if INITIAL:
        S = tk.load(S0, (b, h, j, vb), (64, 64))
        Z = tk.load(Z0, (b, h, j, 0), (64, 16))

    def sums(i):
        """The i-th segment of the walk and its sums' rows, as loaded (issued:
        the next segment's are in flight while this one's are added)."""
        s = SEGMENTS - 1 - i if REVERSE else i
        return (s, tk.load(SS, (b, h, s * R + j, vb), (64, 64)),
                tk.load(ZS, (b, h, s * R + j, 0), (64, 16)))

    s, dS, dZ = sums(0)
    for i in range(SEGMENTS):
        if STORE_STARTS:
            tk.store(STARTS, S, (b, h, s * R + j, vb))
            if vb == 0:
                tk.store(ZSTARTS, Z, (b, h, s * R + j, 0))
        S = S + dS
        Z = Z + dZ
        s, dS, dZ = sums(min(i + 1, SEGMENTS - 1))
    tk.store(S1, S, (b, h, j, vb))
    if vb == 0:
        tk.store(Z1, Z, (b, h, j, 0))


@tk.kernel(num_warps=4)
def linear_attention_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, O: tk.gl, S0: tk.gl, Z0: tk.gl,
                            S1: tk.gl, Z1: tk.gl, FX: tk.gl, scale: float, SEG: int,
                            DK: tk.constexpr = 64, MAP: tk.constexpr = "none",
                            CAUSAL: tk.constexpr = True, NORMALIZE: tk.constexpr = True,
                            INITIAL: tk.constexpr = False, FINAL: tk.constexpr = False):
    """O's column block vb (v_columns wide) of linear attention for one segment (SEG
    chunks) of a (batch, head)'s sequence. Q, K: (B, H, N, DK); V, O: (B, H,
    N, DV). With INITIAL, S0 (B, H, segments·DK, DV) and Z0 (B, H,
    segments·DK, 16) f32 hold each segment's starting state (z in every
    column; not causal: one state, the whole sequence's); without it a
    segment starts from zero (causal: one segment only). FINAL (one
    segment): the state after the last token into S1 (B, H, DK, DV), Z1 (B,
    H, DK, 16); any tensors otherwise, unread. Grid (DV / v_columns, H,
    B·segments)."""
    vb, h, b, s, lo, hi = segment(Q.shape[2], SEG)
    fx = feature_tables(FX, MAP)
    ks = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    vs = v_tile(C, MAP)
    ss = v_tile(DK, MAP)
    qs = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    ones = tk.shared_tile(OPERAND, (C, 16), swizzle=32)
    zhi = tk.shared_tile(OPERAND, (DK, 16), swizzle=32)
    zlo = tk.shared_tile(OPERAND, (DK, 16), swizzle=32)
    S, Z = first_state(K, V, S0, Z0, ks, vs, ss, ones, zhi, zlo, b, h, s if CAUSAL else 0, vb,
                       DK, MAP, CAUSAL, INITIAL, fx)
    # D_k=64: chunk c+1's loads are issued once chunk c's are staged, in
    # flight while its MMAs run (the last chunk loads itself again); at
    # D_k=128 their registers would spill, and a chunk's loads are issued
    # together at its start.
    ahead = DK == 64
    if ahead:
        if CAUSAL:
            k, v = key_loads(K, V, b, h, lo, vb, DK, MAP)
        x = query_load(Q, b, h, lo, DK, MAP)
    for c in range(lo, hi):
        if not ahead:
            if CAUSAL:
                k, v = key_loads(K, V, b, h, c, vb, DK, MAP)
            x = query_load(Q, b, h, c, DK, MAP)
        if CAUSAL:      # first: its f32 tile is not live beside the queries' MMAs
            stage_keys(k, v, ks, vs, c, K.shape[2], MAP, fx)
            # The state's MMAs first in the loop body: ptxas then keeps S and Z
            # in their MMAs' registers across chunks (issued after the chunk's
            # own MMAs, it parked them elsewhere and copied them back: BENCHMARKS.md)
            S, Z = state_step(S, Z, ks, vs, ones)
        qb = stage_queries(x, qs, scale, MAP, fx)
        if ahead:
            if CAUSAL:
                k, v = key_loads(K, V, b, h, min(c + 1, hi - 1), vb, DK, MAP)
            x = query_load(Q, b, h, min(c + 1, hi - 1), DK, MAP)
        o = tk.mma_AB(tk.zeros((C, v_columns(MAP)), f32, layout="row", scope="warpgroup"), qb,
                      ss)
        if NORMALIZE:
            qz = state_dot(qb, zhi, zlo)
        a_sum = None
        if CAUSAL:
            A = tk.mma_ABt(tk.zeros((C, C), f32, layout="row", scope="warpgroup"), qb, ks)
            tk.mma_wait(0)
            A = causal_mask(A)
            if NORMALIZE:
                a_sum = A.row_sum()
            o = tk.mma_AB(o, A.to(OPERAND), vs)
        tk.mma_wait(0)
        if NORMALIZE:
            o = o.div_row(denominator(qz, a_sum))
        tk.store(O, o.to(O.dtype), (b, h, c, vb))
        if CAUSAL:
            tk.barrier()                 # every thread's MMAs read ss, zhi, zlo, ks, vs
            publish(ss, S)
            publish_split(zhi, zlo, Z)
            tk.barrier()
    if FINAL:
        tk.store(S1, S, (b, h, 0, vb))
        if vb == 0:
            tk.store(Z1, Z, (b, h, 0, 0))


@tk.func
def causal_mask(t):
    """A chunk's (query, key) tile with the keys after each query zeroed."""
    return tk.where(t.col_indices() <= t.row_indices(), t, 0.0)


@tk.func
def row_gradients(DEN, b, h, c, vb, den, VB):
    """Chunk c's 1 / den and dden = -(dO·O) / den per row (dO·O over all D_v
    columns from DEN's row 2·VB, the prep kernel's), stored in DEN's rows 2·vb
    and 2·vb + 1 (the reverse pass reads them back)."""
    rden = den.rcp()
    e = -(tk.load(DEN, (b, h, 2 * VB, c), (C,), scope="warpgroup") * rden)
    tk.store(DEN, rden, (b, h, 2 * vb, c))
    tk.store(DEN, e, (b, h, 2 * vb + 1, c))
    return rden, e


@tk.func
def gradient_loads(Q, dO, b, h, c, vb, DK, MAP):
    """Chunk c's Q and the column block vb of its dO, as loaded (issued, as
    key_loads)."""
    return (query_load(Q, b, h, c, DK, MAP),
            tk.load(dO, (b, h, c, vb), (C, v_columns(MAP)), layout="row", scope="warpgroup"))


@tk.func
def stage_gradient_inputs(x, g, DEN, qs, gs, es, b, h, c, vb, scale, MAP, NORMALIZE, fx):
    """gradient_loads' chunk c as φ(Q) (bf16, also into qs), g = dO / den
    (bf16, also into gs) and e = dden per row, with e/16 in every column of
    es: what the state's gradient dH += φ(Q)ᵀ·g, dz += φ(Q)ᵀ·e takes (den
    and e as linear_attention_dq_kernel stored them in DEN)."""
    qb = stage_queries(x, qs, scale, MAP, fx)
    g = g.to(f32)
    e = None
    if NORMALIZE:
        g = g.mul_row(tk.load(DEN, (b, h, 2 * vb, c), (C,), scope="warpgroup"))
        e = tk.load(DEN, (b, h, 2 * vb + 1, c), (C,), scope="warpgroup")
        tk.store(es, tk.zeros((C, 16), f32, layout="row", scope="warpgroup")
                 .add_row(e * (1.0 / 16)).to(es.dtype))
    gb = g.to(OPERAND)
    tk.store(gs, gb)
    tk.barrier()
    return qb, gb, e


@tk.kernel(num_warps=4)
def linear_attention_backward_prep_kernel(O: tk.gl, dO: tk.gl, DEN: tk.gl, VB: tk.constexpr,
                                          VW: tk.constexpr = 64):
    """dO·O per row over all of O's D_v = VW·VB columns into DEN's last row
    (the normaliser's gradient needs it whole; the backward's blocks each
    have VW). Grid (cdiv(N, 64), H, B)."""
    c, h, b = tk.block_id(0), tk.block_id(1), tk.block_id(2)
    oo = tk.zeros((C, 64), f32).row_sum()
    for j in tk.static_range(VB * VW // 64):
        oo = oo + (tk.load(dO, (b, h, c, j), (C, 64)).to(f32) *
                   tk.load(O, (b, h, c, j), (C, 64)).to(f32)).row_sum()
    tk.store(DEN, oo, (b, h, 2 * VB, c))


@tk.func
def put(G, g, at, VB):
    """A gradient tile into G at tile coordinates `at`: stored in G's dtype
    when one block owns it (VB = 1), else added into G (f32, zeroed) with
    atomics, each of the VB blocks of v's columns adding its share."""
    if VB == 1:
        tk.store(G, g.to(G.dtype), at)
    else:
        tk.atomic_add(G, g, at)


@tk.func
def query_sums(Q, dO, DEN, qs, gs, es, dH, dZ, b, h, vb, lo, hi, scale, DK, MAP, NORMALIZE,
               fx):
    """dH + Σ φ(Q_c)ᵀ g_c and dZ + Σ φ(Q_c)ᵀ e_c over chunks lo .. hi-1: the
    state gradient those chunks' queries send back to every key before them
    (stage_gradient_inputs' g and e; the MMAs complete when it returns).
    Chunk c+1's loads are in flight while chunk c's MMAs run."""
    x, g = gradient_loads(Q, dO, b, h, lo, vb, DK, MAP)
    for c in range(lo, hi):
        stage_gradient_inputs(x, g, DEN, qs, gs, es, b, h, c, vb, scale, MAP, NORMALIZE, fx)
        x, g = gradient_loads(Q, dO, b, h, min(c + 1, hi - 1), vb, DK, MAP)   # in flight
        dH, dZ = state_gradient_step(dH, dZ, qs, gs, es, NORMALIZE)
        tk.mma_wait(0)
        tk.barrier()
    return dH, dZ


@tk.kernel(num_warps=4)
def linear_attention_segment_grad_sums_kernel(Q: tk.gl, dO: tk.gl, DEN: tk.gl, SS: tk.gl,
                                              ZS: tk.gl, FX: tk.gl,
                                              scale: float, SEG: int,
                                              DK: tk.constexpr = 64,
                                              MAP: tk.constexpr = "none",
                                              NORMALIZE: tk.constexpr = True):
    """One segment's share of the state gradient, Σ φ(Q_c)ᵀ g_c (g: dO's
    column block vb over den) and Σ φ(Q_c)ᵀ e_c, into SS (B, H, segments·DK, DV)
    and ZS (B, H, segments·DK, 16) f32 (e/16 in every column): what the
    reverse pass of the segments before it starts from. DEN as
    linear_attention_dq_kernel left it. Grid (DV / v_columns, H, B·segments)."""
    vb, h, b, s, lo, hi = segment(Q.shape[2], SEG)
    fx = feature_tables(FX, MAP)
    qs = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    gs = v_tile(C, MAP)
    es = tk.shared_tile(OPERAND, (C, 16), swizzle=32)
    dH, dZ = query_sums(Q, dO, DEN, qs, gs, es,
                        tk.zeros((DK, v_columns(MAP)), f32, layout="row", scope="warpgroup"),
                        tk.zeros((DK, 16), f32, layout="row", scope="warpgroup"),
                        b, h, vb, lo, hi, scale, DK, MAP, NORMALIZE, fx)
    tk.store(SS, dH, (b, h, s, vb))
    if vb == 0:         # (every block's dZ is the same: e is over all of dO's columns)
        tk.store(ZS, dZ, (b, h, s, 0))


@tk.kernel(num_warps=4)
def linear_attention_dq_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, dO: tk.gl, S0: tk.gl, Z0: tk.gl,
                               dQ: tk.gl, DEN: tk.gl, FX: tk.gl, scale: float,
                               SEG: int,
                               DK: tk.constexpr = 64, DV: tk.constexpr = 64,
                               MAP: tk.constexpr = "none", CAUSAL: tk.constexpr = True,
                               NORMALIZE: tk.constexpr = True, INITIAL: tk.constexpr = False):
    """The backward's pass in order over one segment of linear_attention_kernel
    (the same S0, Z0, INITIAL and grid): dq, from the state before each
    chunk, and each row's 1/den and dden into DEN for the reverse pass. dQ:
    (B, H, N, DK), as `put` writes it; DEN: (B, H, 2·VB + 1, N') f32 (N' >= N a
    multiple of 64), its last row dO·O per row (NORMALIZE:
    linear_attention_backward_prep_kernel's).

    With g = dO / den and e = -(dO·O) / den per row (g = dO, e = 0 without
    NORMALIZE), and dP = g·Vᵀ + e (masked causal): dφ(q) = dP·φ(K) + g·Sᵀ +
    e·zᵀ. e's terms are split evenly over the blocks (each adds 1/VB)."""
    vb, h, b, s, lo, hi = segment(Q.shape[2], SEG)
    fx = feature_tables(FX, MAP)
    VB = DV // v_columns(MAP)
    share = 1.0 / VB
    ks = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    vs = v_tile(C, MAP)
    qs = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    ss = v_tile(DK, MAP)
    ones = tk.shared_tile(OPERAND, (C, 16), swizzle=32)
    zhi = tk.shared_tile(OPERAND, (DK, 16), swizzle=32)
    zlo = tk.shared_tile(OPERAND, (DK, 16), swizzle=32)
    S, Z = first_state(K, V, S0, Z0, ks, vs, ss, ones, zhi, zlo, b, h, s if CAUSAL else 0, vb,
                       DK, MAP, CAUSAL, INITIAL, fx)
    for c in range(lo, hi):
        # the chunk's loads issued together (at D_k=128 one after the other:
        # their registers would spill)
        if CAUSAL:
            k, v = key_loads(K, V, b, h, c, vb, DK, MAP)
            if DK > 64:
                stage_keys(k, v, ks, vs, c, K.shape[2], MAP, fx)
        x, g = gradient_loads(Q, dO, b, h, c, vb, DK, MAP)
        if CAUSAL and DK == 64:
            stage_keys(k, v, ks, vs, c, K.shape[2], MAP, fx)
        if CAUSAL and state_first(MAP, DK):
            S, Z = state_step(S, Z, ks, vs, ones)
        qb = stage_queries(x, qs, scale, MAP, fx)
        if NORMALIZE:
            qz = state_dot(qb, zhi, zlo)
        a_sum = None
        if CAUSAL and NORMALIZE:
            A = tk.mma_ABt(tk.zeros((C, C), f32, layout="row", scope="warpgroup"), qb, ks)
        tk.mma_wait(0)
        if CAUSAL and NORMALIZE:
            a_sum = causal_mask(A).row_sum()
        g = g.to(f32)
        e = None
        if NORMALIZE:
            rden, e = row_gradients(DEN, b, h, c, vb, denominator(qz, a_sum), VB)
            g = g.mul_row(rden)
        gb = g.to(OPERAND)
        dPb = None
        if CAUSAL:
            dP = tk.mma_ABt(tk.zeros((C, C), f32, layout="row", scope="warpgroup"), gb, vs)
            tk.mma_wait(0)
            if NORMALIZE:
                dP = dP.add_row(e * share)
            dPb = causal_mask(dP).to(OPERAND)
        Eb = None
        if NORMALIZE:
            Eb = tk.zeros((C, 16), f32, layout="row", scope="warpgroup").add_row(
                e * (share / 16)).to(OPERAND)
        dx = None
        for j in tk.static_range(DK // 64):     # 64 columns of dq at a time (registers)
            dq = tk.mma_ABt(tk.zeros((C, 64), f32, layout="row", scope="warpgroup"), gb,
                            ss.subtile(j, 64))
            if NORMALIZE:
                dq = tk.mma_ABt(dq, Eb, zhi.subtile(j, 64))
                dq = tk.mma_ABt(dq, Eb, zlo.subtile(j, 64))
            if CAUSAL:
                dq = tk.mma_AB(dq, dPb, ks.column_block(j))
            tk.mma_wait(0)
            dx = send_input_grad(dQ, dq, Q, fx, (b, h, c, 0), j, scale, dx, DK, MAP, VB,
                                 False)
        if CAUSAL:
            if not state_first(MAP, DK):
                S, Z = state_step(S, Z, ks, vs, ones)
                tk.mma_wait(0)
            tk.barrier()
            publish(ss, S)
            publish_split(zhi, zlo, Z)
            tk.barrier()


@tk.kernel(num_warps=4)
def linear_attention_dkdv_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, dO: tk.gl, H0: tk.gl,
                                 HZ0: tk.gl, dK: tk.gl, dV: tk.gl, dS0: tk.gl, dZ0: tk.gl,
                                 DEN: tk.gl, FX: tk.gl, scale: float, SEG: int,
                                 DK: tk.constexpr = 64,
                                 DV: tk.constexpr = 64, MAP: tk.constexpr = "none",
                                 CAUSAL: tk.constexpr = True, NORMALIZE: tk.constexpr = True,
                                 INITIAL: tk.constexpr = False, FINAL: tk.constexpr = False):
    """The backward's pass in reverse over one segment: dk and dv from the
    state's gradient after each chunk, dH = Σ_later φ(q)·gᵀ and dz = Σ_later
    e·φ(q) (DEN as linear_attention_dq_kernel left it). With INITIAL, H0
    (B, H, segments·DK, DV) and HZ0 (B, H, segments·DK, 16) f32 hold the
    gradient each segment starts from (causal: the segments' after it; not
    causal: one, the whole sequence's; HZ0 with Σ φ(q)·e/16 in every column);
    without it zero (causal: one segment) or, not causal, summed here.
    FINAL (one segment): the initial state's gradient into dS0 (B, H, DK,
    DV) and dZ0 (B, H, DK, 16). dK: (B, H, N, DK), as `put` writes it;
    dV: (B, H, N, DV). Grid (DV / v_columns, H, B·segments).

    dφ(k) = dPᵀ·φ(Q) + V·dHᵀ + dz and dv = Aᵀ·g + φ(K)·dH; dz's term is
    split evenly over the blocks (each adds 1/VB)."""
    vb, h, b, s, lo, hi = segment(Q.shape[2], SEG)
    fx = feature_tables(FX, MAP)
    VB = DV // v_columns(MAP)
    share = 1.0 / VB
    ks = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    vs = v_tile(C, MAP)
    qs = tk.shared_tile(OPERAND, (C, DK), swizzle=128)
    gs = v_tile(C, MAP)
    ps = tk.shared_tiles(OPERAND, (C, C), 2, swizzle=128)      # A and dP, for their transposes
    ss = v_tile(DK, MAP)                                       # dH
    es = tk.shared_tile(OPERAND, (C, 16), swizzle=32)
    zhi = tk.shared_tile(OPERAND, (DK, 16), swizzle=32)        # dz
    zlo = tk.shared_tile(OPERAND, (DK, 16), swizzle=32)
    dH = tk.zeros((DK, v_columns(MAP)), f32, layout="row", scope="warpgroup")
    dZ = tk.zeros((DK, 16), f32, layout="row", scope="warpgroup")
    if INITIAL:
        dH = tk.load(H0, (b, h, s if CAUSAL else 0, vb), (DK, v_columns(MAP)), layout="row",
                     scope="warpgroup")
        dZ = tk.load(HZ0, (b, h, s if CAUSAL else 0, 0), (DK, 16), layout="row",
                     scope="warpgroup")
    elif not CAUSAL:
        dH, dZ = query_sums(Q, dO, DEN, qs, gs, es, dH, dZ, b, h, vb, 0, tk.cdiv(Q.shape[2], C),
                            scale, DK, MAP, NORMALIZE, fx)
    publish(ss, dH)
    publish_split(zhi, zlo, dZ)
    tk.barrier()
    for i in range(hi - lo):
        c = hi - 1 - i
        # the chunk's loads issued together (at D_k=128 the keys' after the
        # queries are staged: their registers would spill)
        x, g = gradient_loads(Q, dO, b, h, c, vb, DK, MAP)
        if DK == 64:
            k, v = key_loads(K, V, b, h, c, vb, DK, MAP)
        qb, gb, e = stage_gradient_inputs(x, g, DEN, qs, gs, es, b, h, c, vb, scale, MAP,
                                          NORMALIZE, fx)
        if CAUSAL and state_first(MAP, DK, key_pass=True):
            dH, dZ = state_gradient_step(dH, dZ, qs, gs, es, NORMALIZE)
        if DK > 64:
            k, v = key_loads(K, V, b, h, c, vb, DK, MAP)
        stage_keys(k, v, ks, vs, c, K.shape[2], MAP, fx)
        dv = tk.zeros((C, v_columns(MAP)), f32, layout="row", scope="warpgroup")
        if CAUSAL:          # A, then dP: one of the two live at a time (registers)
            A = tk.mma_ABt(tk.zeros((C, C), f32, layout="row", scope="warpgroup"), qb, ks)
            tk.mma_wait(0)
            tk.store(ps[0], causal_mask(A).to(OPERAND))
            dP = tk.mma_ABt(tk.zeros((C, C), f32, layout="row", scope="warpgroup"), gb, vs)
            tk.mma_wait(0)
            if NORMALIZE:
                dP = dP.add_row(e * share)
            tk.store(ps[1], causal_mask(dP).to(OPERAND))
            tk.barrier()
            dv = tk.mma_AtB(dv, ps[0], gs)
        dv = tk.mma_AB(dv, ks, ss)
        spread = tk.full((C, 16), share, OPERAND, layout="row", scope="warpgroup")
        dx = None
        for j in tk.static_range(DK // 64):     # 64 columns of dk at a time (registers)
            dk = tk.zeros((C, 64), f32, layout="row", scope="warpgroup")
            if CAUSAL:
                dk = tk.mma_AtB(dk, ps[1], qs.column_block(j))
            dk = tk.mma_ABt(dk, vs, ss.subtile(j, 64))
            if NORMALIZE:
                dk = tk.mma_ABt(dk, spread, zhi.subtile(j, 64))
                dk = tk.mma_ABt(dk, spread, zlo.subtile(j, 64))
            tk.mma_wait(0)
            dx = send_input_grad(dK, dk, K, fx, (b, h, c, 0), j, 1.0, dx, DK, MAP, VB, True)
        tk.store(dV, dv.to(dV.dtype), (b, h, c, vb))
        if CAUSAL and not state_first(MAP, DK, key_pass=True):
            dH, dZ = state_gradient_step(dH, dZ, qs, gs, es, NORMALIZE)
            tk.mma_wait(0)
        tk.barrier()
        if CAUSAL:
            publish(ss, dH)
            publish_split(zhi, zlo, dZ)
            tk.barrier()
    if FINAL:           # every query after the initial state read it
        tk.store(dS0, dH, (b, h, 0, vb))
        if vb == 0:
            tk.store(dZ0, dZ * 16.0, (b, h, 0, 0))     # (each column holds 1/16)


def linear_attention(q, k, v, feature_map: str | None = None, causal: bool = True,
                     normalize: bool = True, scale: float | None = None, initial_state=None,
                     return_state: bool = False):
    """Linear attention of (B, N, H, D) tensors (FlashLinearAttention's
    layout): o_t = φ(q_t·scale)ᵀ S_t / (φ(q_t·scale)·z_t + 1e-6), S_t and
    z_t the sums of φ(k_s) v_sᵀ and φ(k_s) over s <= t (causal) or over
    every s; normalize=False leaves out the division.

    q, k: (B, N, H, D_k); v: (B, N, H, D_v); bf16 or f16 on one CUDA device,
    last dim contiguous; D_k is 64 or 128, D_v 64, 128 or 256.
    feature_map: None (identity), "elu1" (elu(x) + 1), "relu", or
    "taylor2": Based's [1, x, vec(x ⊗ x)/√2] of D_φ = 1 + D_k + D_k² features,
    for D_k <= 16 (taylor_linear_attention.py: the kernels expand the
    features). The kernels' operands are bf16 for f16 inputs too, whose
    range the sums outgrow. scale defaults to 1/sqrt(D_k). initial_state:
    (S (B, H, D_φ, D_v), z (B, H, D_φ)) f32, D_φ = D_k but for taylor2, added
    before the first token. return_state=True also returns the state after
    the last token, in that form. Both causal only (a state is the
    recurrence's). o has v's shape and
    dtype, contiguous. Differentiable in q, k, v and the initial state, and
    the returned state is differentiable too; under torch.compile the
    custom op torch.ops.tk_mlir.linear_attention. Causal: an inf or NaN in v
    at token t also reaches the tokens before t in its 64-token chunk (a
    masked weight of 0 times inf is NaN in the chunk's MMA): pad sequences
    with zeros, not uninitialised memory."""
    import torch
    _check(q, k, v, feature_map, causal, normalize, initial_state, return_state)
    scale = checks.attention_scale("linear_attention", scale, q.shape[-1])
    checks.on_cuda("linear_attention", "q", q)
    from tk_mlir.kernels import custom_ops
    s0, z0 = initial_state if initial_state is not None else (None, None)
    args = (q, k, v, s0, z0, feature_map or "none", causal, normalize, scale)
    if torch.compiler.is_compiling():
        o, s1, z1 = torch.ops.tk_mlir.linear_attention(*args)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                         for t in (q, k, v, s0, z0)):
        o, s1, z1 = custom_ops.EagerLinearAttention.apply(*args)
    else:
        o, s1, z1 = forward(*args)
    return (o, (s1, z1)) if return_state else o


def _check(q, k, v, feature_map, causal, normalize, initial_state, return_state,
           fn: str = "linear_attention", state: str = "initial_state") -> None:
    """Shapes, dtypes, devices and flags, each with the rule it breaks (`fn`
    and `state`: the function and the state argument the errors name)."""
    import torch
    dtypes = (torch.bfloat16, torch.float16)
    checks.tensor(fn, "q", q, ndim=4, dtypes=dtypes)
    for name, t in (("k", k), ("v", v)):
        checks.tensor(fn, name, t, ndim=4, dtypes=dtypes)
        checks.like(fn, name, t, "q", q)
    B, N, H, DK = q.shape
    checks.shape(fn, "k", k, q.shape, "q's shape")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{fn}: v must be (B={B}, N={N}, H={H}, D_v), got {tuple(v.shape)}")
    if feature_map not in FEATURE_MAPS:         # (first: the head dims' rule depends on it)
        raise ValueError(f"{fn}: feature_map must be one of {FEATURE_MAPS}, got "
                         f"{feature_map!r}")
    if feature_map == "taylor2":
        if not 1 <= DK <= taylor.MAX_DK:
            raise ValueError(f"{fn}: feature_map='taylor2' takes a q/k head dim D_k up to "
                             f"{taylor.MAX_DK} (its D_φ = 1 + D_k + D_k² features), got {DK}")
    elif DK not in (64, 128):
        raise ValueError(f"{fn}: the q/k head dim D_k must be 64 or 128, got {DK}")
    DV = v.shape[3]
    if DV not in (64, 128, 256):
        raise ValueError(f"{fn}: the v head dim D_v must be 64, 128 or 256, got {DV}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name}'s last dim must be contiguous (stride 1), got "
                             f"strides {tuple(t.stride())}")
    checks.flags(fn, causal=causal, normalize=normalize, return_state=return_state)
    if initial_state is not None:
        if not causal:
            raise ValueError(f"{fn}: {state} is a recurrence's state: causal=True only")
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise TypeError(f"{fn}: {state} must be (S, z), got {type(initial_state)}")
        s0, z0 = initial_state
        dphi = taylor.feature_dim(DK) if feature_map == "taylor2" else DK
        for name, t, shape in ((f"{state} S", s0, (B, H, dphi, DV)),
                               (f"{state} z", z0, (B, H, dphi))):
            checks.tensor(fn, name, t, ndim=len(shape), dtypes=(torch.float32,))
            checks.like(fn, name, t, "q", q, dtype=False)
            checks.shape(fn, name, t, shape, "(B, H, D_φ, D_v) and (B, H, D_φ), D_φ the "
                         "feature dim")
    if return_state and not causal:
        raise ValueError(f"{fn}: return_state is a recurrence's state: causal=True only")


def _heads_first(t):
    """(B, N, H, D) as the kernels' (B, H, N, D) view."""
    return t.transpose(1, 2)


def _columns(z):
    """z (B, H, D_k) as the kernels read it: (B, H, D_k, 16), z in every column."""
    return z.unsqueeze(-1).expand(*z.shape, 16).contiguous()


def segment_length(units: int, chunks: int, device: int,
                   blocks_per_sm: int | None = None) -> int:
    """Chunks per segment, for `units` (batch, head, block of v's columns) walks of
    `chunks` chunks each: enough segments (of MIN_SEGMENT chunks or more)
    that the grid holds `blocks_per_sm` (default BLOCKS_PER_SM) blocks per
    SM, each walking its segment from the state its predecessors summed
    (segment_states), where one walk per unit would leave SMs idle."""
    per_sm = BLOCKS_PER_SM if blocks_per_sm is None else blocks_per_sm
    wanted = -(-per_sm * num_sms(device) // units)
    segments = max(1, min(chunks // MIN_SEGMENT, wanted))
    return -(-chunks // segments)


def v_block(feature_map: str) -> int:
    """The columns of v one block of the chunked kernels takes (v_columns)."""
    return TAYLOR_V_COLUMNS if feature_map == "taylor2" else 64


def feature_columns(x, feature_map: str) -> int:
    """The kernels' DK for q or k x: its head dim, or taylor2's FEATURES."""
    return taylor.FEATURES if feature_map == "taylor2" else x.shape[3]


def _tables(x, feature_map: str):
    """The kernels' FX: taylor2's expansion tables on x's device, or (unread) x."""
    return taylor.tables(x.device) if feature_map == "taylor2" else x


def segment_states(k, v, s0, z0, feature_map: str, causal: bool, seg: int):
    """Each segment's starting state for linear_attention_kernel's INITIAL:
    (S (B, H, segments·D_k, D_v), Z (B, H, segments·D_k, 16)) f32, causal
    the sums of the segments before it and the initial state, not causal
    the whole sequence's (one state); and the final state (S (B, H, D_k,
    D_v), Z (B, H, D_k, 16)). The segments' own sums come from
    linear_attention_segment_sums_kernel, their prefix from _prefix."""
    DK = feature_columns(k, feature_map)
    sums, zsums, grid = _segment_buffers(k, DK, v.shape[3], seg, v_block(feature_map))
    linear_attention_segment_sums_kernel[grid](
        _heads_first(k), _heads_first(v), *_stacked(sums, zsums), _tables(k, feature_map), seg,
        DK=DK, MAP=feature_map)
    return _prefix(sums, zsums, None if s0 is None else s0.contiguous(),
                   None if z0 is None else _columns(z0), causal)


def _segment_buffers(x, DK: int, DV: int, seg: int, vw: int):
    """(sums (B, H, segments, DK, D_v), zsums (B, H, segments, DK, 16), the
    grid of a segment sums kernel of vw columns of v a block) for x (B, N,
    H, ·) in segments of `seg` chunks, DK features: one sum per segment,
    f32, for the kernel to fill."""
    import torch
    B, N, H, _ = x.shape
    segments = -(-(-(-N // C)) // seg)
    sums = x.new_empty(B, H, segments, DK, DV, dtype=torch.float32)
    zsums = x.new_empty(B, H, segments, DK, 16, dtype=torch.float32)
    return sums, zsums, (DV // vw, H, B * segments)


def _stacked(*sums):
    """Segment sums (B, H, segments, D, cols) as the kernels index them:
    (B, H, segments·D, cols) views."""
    return [t.view(*t.shape[:2], -1, t.shape[4]) for t in sums]


def _prefix(sums, zsums, s0, z0, causal: bool, reverse: bool = False):
    """(each segment's start S, its Z, (the end S, Z)) of the segments' sums
    (B, H, segments, D_k, D_v) and (..., D_k, 16) after s0, z0 (None: zero)
    by linear_attention_segment_prefix_kernel; not causal, every segment's
    start is the end (one state: (end S, end Z, the same))."""
    B, H, segments, DK, DV = sums.shape
    ends = (sums.new_empty(B, H, DK, DV), sums.new_empty(B, H, DK, 16))
    starts = (sums.new_empty(sums.shape), sums.new_empty(zsums.shape)) if causal else ends
    initial = s0 is not None
    stacked = _stacked(*starts) if causal else ends
    linear_attention_segment_prefix_kernel[(DV // 64 * (DK // 64), H, B)](
        *_stacked(sums, zsums), s0 if initial else ends[0], z0 if initial else ends[1],
        *stacked, *ends, segments, DK=DK, INITIAL=initial, REVERSE=reverse,
        STORE_STARTS=causal)
    return (*stacked, ends)


def forward(q, k, v, s0, z0, feature_map: str, causal: bool, normalize: bool, scale: float):
    """(o, S, z) on checked tensors: o like v (contiguous), the final state
    (S (B, H, D_k, D_v), z (B, H, D_k) f32; empty when not causal)."""
    return forward_and_starts(q, k, v, s0, z0, feature_map, causal, normalize, scale)[0]


def forward_and_starts(q, k, v, s0, z0, feature_map: str, causal: bool, normalize: bool,
                       scale: float):
    """(`forward`'s (o, S, z), the segments' starting states (S, Z) as
    segment_states made them, or None for one segment): `backward` takes
    the starts instead of summing the keys again."""
    if feature_map == "taylor2":
        return _taylor_forward(q, k, v, s0, z0, causal, normalize, scale)
    return _forward_and_starts(q, k, v, s0, z0, feature_map, causal, normalize, scale)


def _taylor_forward(q, k, v, s0, z0, causal: bool, normalize: bool, scale: float):
    """forward_and_starts for taylor2: the kernels on q, k padded to
    taylor.WIDTH, states in the compact basis inside, the full one outside
    (the starts stay compact: _taylor_backward reads them)."""
    d = q.shape[3]
    s0c, z0c = (None, None) if s0 is None else \
        (taylor.to_compact(s0, d), taylor.to_compact(z0, d))
    (o, s1, z1), kept = _forward_and_starts(taylor.padded(q), taylor.padded(k), v, s0c, z0c,
                                            "taylor2", causal, normalize, scale)
    if causal:
        s1, z1 = taylor.to_full(s1, d, s0, s0c), taylor.to_full(z1, d, z0, z0c)
    return (o, s1, z1), kept


def _forward_and_starts(q, k, v, s0, z0, feature_map: str, causal: bool, normalize: bool,
                        scale: float):
    """forward_and_starts on the kernels' own q, k and states (taylor2's
    compact); views the kernels cannot read as they lie (a misaligned slice
    of a projection) through aligned copies."""
    import torch
    q, k, v = (checks.kernel_operand(t) for t in (q, k, v))
    B, N, H, _ = q.shape
    DK = feature_columns(q, feature_map)
    DV = v.shape[3]
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    s1 = q.new_empty((B, H, DK, DV) if causal else (0,), dtype=torch.float32)
    z16 = q.new_empty((B, H, DK, 16) if causal else (0,), dtype=torch.float32)
    initial = s0 is not None
    kept = None
    if B and H and N:
        chunks = -(-N // C)
        vw = v_block(feature_map)
        seg = segment_length(B * H * (DV // vw), chunks, q.get_device())
        if seg < chunks:            # several segments: each starts from its predecessors'
            starts, zstarts, final = segment_states(k, v, s0, z0, feature_map, causal, seg)
            kept = starts, zstarts
            if causal:
                s1, z16 = final
            initial = True
        else:
            starts, zstarts = (s0.contiguous(), _columns(z0)) if initial else (s1, z16)
        linear_attention_kernel[(DV // vw, H, B * -(-chunks // seg))](
            _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(o),
            starts, zstarts, s1, z16, _tables(q, feature_map), scale, seg, DK=DK,
            MAP=feature_map, CAUSAL=causal, NORMALIZE=normalize, INITIAL=initial,
            FINAL=causal and seg == chunks)
    elif causal and initial:            # no token: the state is the initial one
        s1.copy_(s0)
        z16.copy_(_columns(z0))
    elif causal:
        s1.zero_()
        z16.zero_()
    return (o, s1, z16[..., 0].contiguous() if causal else z16), kept


def backward(do, q, k, v, o, s0, z0, feature_map: str, causal: bool, normalize: bool,
             scale: float, starts=None, ds1=None, dz1=None):
    """(dq, dk, dv, dS0, dz0) of `forward` given o and its gradient do (dS0,
    dz0 None without an initial state): a pass in order (dq) and one in
    reverse (dk, dv), each over `forward`'s segments, from their starts
    (forward_and_starts'; None: made again). ds1, dz1: the gradients of the
    final state (causal; None: none): the reverse pass starts from ds1 (S1 =
    S0 + Σ φ(k)vᵀ), and dz1 adds to every φ(k) and to z0 (z1 = z0 + Σ φ(k))."""
    if feature_map == "taylor2":
        return _taylor_backward(do, q, k, v, o, s0, z0, causal, normalize, scale, starts, ds1,
                                dz1)
    return _backward(do, q, k, v, o, s0, z0, feature_map, causal, normalize, scale, starts,
                     ds1, dz1)


def _taylor_backward(do, q, k, v, o, s0, z0, causal: bool, normalize: bool, scale: float,
                     starts, ds1, dz1):
    """backward for taylor2, as _taylor_forward: the gradients of the states
    carried between the bases (the final state's into the compact one, the
    initial state's back, with the path through what the final state holds
    unchanged)."""
    d = q.shape[3]
    s0c, z0c = (None, None) if s0 is None else \
        (taylor.to_compact(s0, d), taylor.to_compact(z0, d))
    ds1c = None if ds1 is None else taylor.grad_to_compact(ds1.float(), d)
    dz1c = None if dz1 is None else taylor.grad_to_compact(dz1.float(), d)
    dq, dk, dv, ds0, dz0 = _backward(do, taylor.padded(q), taylor.padded(k), v, o, s0c, z0c,
                                     "taylor2", causal, normalize, scale, starts, ds1c, dz1c)
    if d < taylor.WIDTH:
        dq, dk = dq[..., :d].contiguous(), dk[..., :d].contiguous()
    if s0 is not None:
        ds0 = taylor.grad_to_full(ds0, d, None if ds1 is None else ds1.float(), ds1c)
        dz0 = taylor.grad_to_full(dz0, d, None if dz1 is None else dz1.float(), dz1c)
    return dq, dk, dv, ds0, dz0


def _backward(do, q, k, v, o, s0, z0, feature_map: str, causal: bool, normalize: bool,
              scale: float, starts, ds1, dz1):
    """backward on the kernels' own q, k and states (taylor2's compact), the
    tensors as _forward_and_starts reads them."""
    import torch
    q, k, v, o = (checks.kernel_operand(t) for t in (q, k, v, o))
    B, N, H, DX = q.shape
    DK = feature_columns(q, feature_map)
    DV = v.shape[3]
    final = None
    if ds1 is not None:     # where the reverse walk starts, with no z term (dz1: below)
        final = (ds1.to(torch.float32).contiguous(),
                 q.new_zeros(B, H, DK, 16, dtype=torch.float32))
    vw = v_block(feature_map)
    if DV == vw:        # one block per row: the kernels store dq and dk in q's dtype
        dq, dk = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(2))
        dq_acc, dk_acc = _heads_first(dq), _heads_first(dk)
    else:               # DV/vw blocks add their shares in f32
        dq_acc = torch.zeros(B, H, N, DX, dtype=torch.float32, device=q.device)
        dk_acc = torch.zeros_like(dq_acc)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    initial = s0 is not None
    ds0 = torch.empty(s0.shape, dtype=torch.float32, device=q.device) if initial else None
    dz16 = q.new_empty(B, H, DK, 16, dtype=torch.float32) if initial else None
    if B and H and N:
        do = checks.kernel_operand(do, v.dtype)
        chunks = -(-N // C)
        seg = segment_length(B * H * (DV // vw), chunks, q.get_device())
        grid = (DV // vw, H, B * -(-chunks // seg))
        den = q.new_empty(B, H, 2 * DV // vw + 1, chunks * C, dtype=torch.float32)
        if normalize:
            linear_attention_backward_prep_kernel[(chunks, H, B)](
                _heads_first(o), _heads_first(do), den, VB=DV // vw, VW=vw)
        flags = dict(DK=DK, DV=DV, MAP=feature_map, CAUSAL=causal, NORMALIZE=normalize)
        heads = [_heads_first(t) for t in (q, k, v, do)]
        if seg < chunks:
            starts, zstarts = starts or segment_states(k, v, s0, z0, feature_map, causal,
                                                       seg)[:2]
        else:
            starts, zstarts = (s0.contiguous(), _columns(z0)) if initial else (den, den)
        tables = _tables(q, feature_map)
        linear_attention_dq_kernel[grid](*heads, starts, zstarts, dq_acc, den, tables, scale, seg,
                                         INITIAL=initial or seg < chunks, **flags)
        if seg < chunks:
            ends, zends, totals = grad_states(q, do, den, feature_map, causal, normalize, scale,
                                              seg, DV, final)
            if initial:
                ds0.copy_(totals[0])
                dz16.copy_(totals[1] * 16.0)      # (each column holds 1/16)
        else:
            ends, zends = final or (den, den)     # (den: unread)
        linear_attention_dkdv_kernel[grid](
            *heads, ends, zends, dk_acc, _heads_first(dv), ds0 if initial else den,
            dz16 if initial else den, den, tables, scale, seg,
            INITIAL=seg < chunks or final is not None, FINAL=initial and seg == chunks, **flags)
    else:
        dv.zero_()
        if initial:     # no token: the final state is the initial one
            if final:
                ds0.copy_(final[0])
            else:
                ds0.zero_()
            dz16.zero_()
    if DV > vw:     # contiguous, as the op's fake says (a compiled graph checks the strides)
        dq, dk = (t.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format)
                  for t in (dq_acc, dk_acc))
    dz0 = dz16[..., 0].contiguous() if initial else None
    if dz1 is not None:
        dk = (dk.float() + _feature_vjp(k.float(), dz1.float(), feature_map)).to(k.dtype)
        if initial:
            dz0 = dz0 + dz1
    return dq, dk, dv, ds0, dz0


def _feature_vjp(x, dz, feature_map: str):
    """The gradient of keys x (B, N, H, D) f32 given dz (B, H, D_φ), that of
    every token's φ(x) (torch), as `feature_grad` and taylor2's input_grad
    make it in the kernels."""
    import torch
    if feature_map == "taylor2":
        return taylor.feature_vjp(x, dz)
    dphi = dz[:, None]
    if feature_map == "elu1":
        return torch.where(x > 0, dphi, dphi * x.exp())
    if feature_map == "relu":
        return torch.where(x > 0, dphi, 0.0)
    return dphi.expand_as(x)


def grad_states(q, do, den, feature_map: str, causal: bool, normalize: bool, scale: float,
                seg: int, DV: int, final=None):
    """Each segment's starting state gradient for linear_attention_dkdv_kernel's
    INITIAL: (dH (B, H, segments·D_k, D_v), dZ (B, H, segments·D_k, 16)) f32,
    causal the sums of the segments after it, not causal the whole
    sequence's; and the whole sequence's (dH (B, H, D_k, D_v), dZ (B, H,
    D_k, 16)): the initial state's gradient. final: the gradient (dH, dZ) the
    reverse walk starts from (the final state's), or None (zero)."""
    DK = feature_columns(q, feature_map)
    sums, zsums, grid = _segment_buffers(q, DK, DV, seg, v_block(feature_map))
    linear_attention_segment_grad_sums_kernel[grid](
        _heads_first(q), _heads_first(do), den, *_stacked(sums, zsums), _tables(q, feature_map),
        scale, seg, DK=DK, MAP=feature_map, NORMALIZE=normalize)
    return _prefix(sums, zsums, *(final or (None, None)), causal, reverse=True)


# ------------------------------------------------------------------ decode

@tk.kernel(num_warps=4)
def linear_attention_step_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, O: tk.gl, S0: tk.gl, Z0: tk.gl,
                                 S1: tk.gl, Z1: tk.gl, scale: float, DK: tk.constexpr = 64,
                                 MAP: tk.constexpr = "none", NORMALIZE: tk.constexpr = True):
    """One token of causal linear attention for the 64 columns vb of v: S1 =
    S0 + φ(k)·vᵀ, z1 = z0 + φ(k), o = φ(q·scale)ᵀ·S1 (/ (φ(q·scale)·z1 +
    1e-6)). Q, K: (B, H, DK); V, O: (B, H, DV); S0, S1: (B, H, DK, DV) and
    Z0, Z1: (B, H, DK) f32. Grid (DV / 64, H, B)."""
    vb, h, b = tk.block_id(0), tk.block_id(1), tk.block_id(2)
    k = feature(tk.load(K, (b, h, 0), (DK,)).to(f32), MAP)
    q = feature(tk.load(Q, (b, h, 0), (DK,)).to(f32) * scale, MAP)
    v = tk.load(V, (b, h, vb), (64,)).to(f32)
    S = tk.load(S0, (b, h, 0, vb), (DK, 64)) + tk.zeros((DK, 64), f32).add_row(k).mul_col(v)
    tk.store(S1, S, (b, h, 0, vb))
    o = S.mul_row(q).col_sum()
    z = tk.load(Z0, (b, h, 0), (DK,)) + k
    if NORMALIZE:       # φ(q)·z in every column (a sum over rows, as o's)
        o = o / (tk.zeros((DK, 64), f32).add_row(z * q).col_sum() + EPS)
    if vb == 0:
        tk.store(Z1, z, (b, h, 0))
    tk.store(O, o.to(O.dtype), (b, h, vb))


def linear_attention_step(q, k, v, state, feature_map: str | None = None,
                          normalize: bool = True, scale: float | None = None):
    """One decoding step of causal linear attention: the new token's (q, k, v),
    each (B, 1, H, D) as linear_attention takes them, and the state (S, z)
    of the tokens before it (as linear_attention(..., return_state=True)
    returns it) -> (o (B, 1, H, D_v), the state with the token added, new
    tensors). The same arithmetic as the chunked kernels, in f32, for
    inference (no gradient)."""
    import torch
    fn = "linear_attention_step"
    if not (isinstance(state, (tuple, list)) and len(state) == 2):
        raise TypeError(f"{fn}: state must be (S, z), got {type(state).__name__}")
    _check(q, k, v, feature_map, True, normalize, state, False, fn, "state")
    if q.shape[1] != 1:
        raise ValueError(f"{fn}: q, k, v hold one new token: (B, 1, H, D), got "
                         f"{tuple(q.shape)}")
    scale = checks.attention_scale(fn, scale, q.shape[-1])
    checks.on_cuda(fn, "q", q)
    if not torch.compiler.is_compiling():
        checks.warn_no_gradient(fn, "use linear_attention (initial_state=, return_state=)", q,
                                k, v, *state)
    if feature_map == "taylor2":      # (the chunked kernels expand its features)
        with torch.no_grad():
            return linear_attention(q, k, v, "taylor2", True, normalize, scale, state, True)
    if torch.compiler.is_compiling():
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        o, s1, z1 = torch.ops.tk_mlir.linear_attention_step(q, k, v, state[0], state[1],
                                                             feature_map or "none", normalize,
                                                             scale)
        return o, (s1, z1)
    o, s1, z1 = step(q, k, v, state[0], state[1], feature_map or "none", normalize, scale)
    return o, (s1, z1)


def step(q, k, v, s0, z0, feature_map: str, normalize: bool, scale: float):
    """(o, S, z) of linear_attention_step on checked tensors."""
    import torch
    B, _, H, DK = q.shape
    DV = v.shape[3]
    s0, z0 = (checks.kernel_operand(t.contiguous()) for t in (s0, z0))   # (and aligned)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    s1, z1 = torch.empty_like(s0), torch.empty_like(z0)
    if B and H:
        linear_attention_step_kernel[(DV // 64, H, B)](
            *(checks.kernel_operand(t[:, 0]) for t in (q, k, v)), o[:, 0], s0, z0, s1, z1,
            scale, DK=DK, MAP=feature_map, NORMALIZE=normalize)
    return o, s1, z1
