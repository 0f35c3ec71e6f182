"""Based's feature map for linear attention: feature_map="taylor2".

    o = linear_attention(q, k, v, feature_map="taylor2")   # q, k: (B, N, H, d), d <= 16

φ(x) = [1, x, vec(x ⊗ x) / √2], D_φ = 1 + d + d² features, of q·scale and
of k (scale multiplies q, as for every feature map): φ(q·s)·φ(k) = 1 + s q·k
+ (s q·k)² / 2, the second-order Taylor expansion of exp(s q·k). (Based
scales both q and k by √s: the same dot products.)

The chunked kernels (chunked_linear_attention.py, MAP="taylor2") expand the
features themselves, from q and k zero-padded to WIDTH columns, into a
compact basis of the same dot products: 153 features where vec(x ⊗ x) has
each pair twice, laid out in FEATURES (192) columns, three 64-column blocks
of a state of the kernels' shape. A key's features are x_a·x_b once per
pair a < b, x_a², x and 1; a query's the same but x_a²/2 (so φ(q)·φ(k) is
unchanged, with no factor that bf16 would round). Feature j is u_j·v_j,
u = x·E + 1·CU and v = x·F + 1·CV: two small MMAs each (x in two bf16
halves, E, F, CU, CV of 0, 1 and 1/2, exact), no per-column constants in
registers. The quadratic features sit at j = 16·δ + a for the pair (a, (a +
δ) mod 16), δ = 0 … 8 (δ = 8 only for a < 8: the rest are those pairs
again), the linear ones at 144 + a, the constant at 160; the rest are zero.

States cross the kernels' boundary in the full basis the API promises. A
state the recurrence builds is R·S_c in it (R: each full feature is 1/√2
times its compact key feature, or 1 for x and the constant); a full state
S0 acts on the queries as Q·S0 in the compact basis (Q sums each feature
and its transposed twin, with √2 on the diagonal). R·Q keeps what is
symmetric in (a, b); the rest of an initial state (S0 - R·Q·S0) no query
reads, and the final state holds it unchanged.

Known limit: the causal kernels spill (ptxas, sm_90a, with the normaliser:
forward ~420, dq ~490, dk/dv ~660 bytes a thread): the 192 x 64 f32 state
and its z take 104 registers beside a chunk's tiles and the expansion's.
Blocks take 64 columns of v (chunked_linear_attention.TAYLOR_V_COLUMNS);
32 spills little but re-expands q and k in twice the blocks, and measured
slower (BENCHMARKS.md).
"""
from __future__ import annotations

import functools
import math

import tk_mlir as tk
from tk_mlir import f32

MAX_DK = 16             # Based's feature dim: D_φ = 1 + 16 + 256 = 273
WIDTH = 16              # q and k as the kernels read them (zero-padded)
FEATURES = 192          # the compact features' columns (153 used)
_LINEAR, _CONSTANT = 144, 160
OPERAND = tk.bf16


def feature_dim(d: int) -> int:
    """D_φ of taylor2 on d-dimensional q and k."""
    return 1 + d + d * d


def _pair_column(a: int, b: int) -> int:
    """The compact column of the quadratic feature of the pair (a, b)."""
    delta = (b - a) % WIDTH
    if delta > WIDTH // 2 or (delta == WIDTH // 2 and a >= WIDTH // 2):
        a, delta = b, WIDTH - delta
    return WIDTH * delta + a


E_QUERY, E_KEY, F, CU, CV = range(5)        # FX's tables


@functools.lru_cache(maxsize=None)
def _host_tables():
    """FX: the five (WIDTH, FEATURES) tables E_QUERY, E_KEY, F, CU, CV stacked,
    bf16 on the CPU (CU, CV: the constants, in row 0, that a ones column
    picks)."""
    import torch
    t = torch.zeros(5, WIDTH, FEATURES)
    for a in range(WIDTH):
        for b in range(a, WIDTH):
            j = _pair_column(a, b)
            t[E_KEY, a, j] = 1.0
            t[E_QUERY, a, j] = 0.5 if a == b else 1.0
            t[F, b, j] = 1.0
        t[E_KEY, a, _LINEAR + a] = t[E_QUERY, a, _LINEAR + a] = 1.0     # x_a · 1
        t[CV, 0, _LINEAR + a] = 1.0
    t[CU, 0, _CONSTANT] = t[CV, 0, _CONSTANT] = 1.0                       # 1 · 1
    return t.to(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def tables(device):
    """The kernels' FX on `device`."""
    return _host_tables().to(device)


@functools.lru_cache(maxsize=None)
def _basis(d: int, device):
    """(each full feature's compact column (D_φ,) int64, R's value (1/√2 for
    the quadratic features, else 1), Q's (√2 on the diagonal, 1/√2 off it,
    else 1)) f32, on `device` (kept: no copy per call, none while a CUDA
    graph captures)."""
    import torch
    column, r, q = [_CONSTANT], [1.0], [1.0]
    column += [_LINEAR + a for a in range(d)]
    r += [1.0] * d
    q += [1.0] * d
    for a in range(d):
        for b in range(d):
            column.append(_pair_column(a, b))
            r.append(1 / math.sqrt(2))
            q.append(math.sqrt(2) if a == b else 1 / math.sqrt(2))
    return (torch.tensor(column, device=device),
            torch.tensor(r, dtype=torch.float32, device=device),
            torch.tensor(q, dtype=torch.float32, device=device))


_R, _Q = 1, 2


def _gather(s, which: int, d: int):
    """Full-basis rows from compact ones: s[..., column_i, ...] times value_i."""
    basis = _basis(d, s.device)
    return s.index_select(2, basis[0]) * basis[which].view(-1, *[1] * (s.dim() - 3))


def _scatter(s, which: int, d: int):
    """Compact rows from full-basis ones: Σ value_i·s_i into column_i."""
    basis = _basis(d, s.device)
    value = basis[which].view(-1, *[1] * (s.dim() - 3))
    return s.new_zeros(*s.shape[:2], FEATURES, *s.shape[3:]).index_add(2, basis[0], s * value)


def to_compact(s0, d: int):
    """Q·s0: a full-basis state (B, H, D_φ, ...) as the queries read it in the
    compact basis (B, H, FEATURES, ...); z (B, H, D_φ) too."""
    return _scatter(s0, _Q, d)


def to_full(s, d: int, s0=None, s0_compact=None):
    """R·s: a compact state the kernels built, in the full basis; with the
    initial full-basis state s0 (and its to_compact), s0 + R·(s - Q·s0), which
    keeps the part of s0 no query reads (and is s0 exactly when no token
    came). Contiguous."""
    if s0 is None:
        return _gather(s, _R, d).contiguous()
    return (_gather(s - s0_compact, _R, d) + s0).contiguous()


def grad_to_compact(ds1, d: int):
    """Rᵀ·ds1: the final state's gradient (full basis) in the compact one."""
    return _scatter(ds1, _R, d)


def grad_to_full(ds0, d: int, ds1=None, ds1_compact=None):
    """The initial state's gradient in the full basis from the compact one
    ds0 (Qᵀ·ds0), plus, with the final state's gradient ds1 (and its
    grad_to_compact), the path through what the final state holds
    unchanged: (I - R·Q)ᵀ·ds1. Contiguous."""
    if ds1 is None:
        return _gather(ds0, _Q, d).contiguous()
    return (_gather(ds0 - ds1_compact, _Q, d) + ds1).contiguous()


def padded(x):
    """q or k (B, N, H, d) as the kernels read them: (B, N, H, WIDTH), rows
    the kernels can read (checks.kernel_operand)."""
    import torch
    from tk_mlir.kernels import checks
    if x.shape[-1] == WIDTH:
        return checks.kernel_operand(x)
    return torch.nn.functional.pad(x, (0, WIDTH - x.shape[-1]))


def feature_vjp(x, dz):
    """Σ_j dz_j·∂φ_j(x)/∂x for keys x (B, N, H, WIDTH) f32 and dz (B, H,
    FEATURES) in the compact basis (the final normaliser's gradient, for
    every token): φ_j = (x·E_j + cu_j)(x·F_j + cv_j), so it is affine in x,
    x·M + c with M = F·diag(dz)·Eᵀ + E·diag(dz)·Fᵀ (WIDTH x WIDTH per batch
    and head): no (tokens x FEATURES) temporaries."""
    import torch
    t = tables(x.device).float()
    e, f, cu, cv = t[E_KEY], t[F], t[CU, 0], t[CV, 0]
    m = torch.einsum("rj,bhj,sj->bhrs", f, dz, e)
    m = m + m.transpose(-1, -2)
    c = (dz * cv) @ e.T + (dz * cu) @ f.T                          # (B, H, WIDTH)
    return torch.einsum("bnhr,bhrs->bnhs", x, m) + c[:, None]


# --------------------------------------------------------- in the kernels

@tk.func
def shared_tables(FX):
    """FX's five tables in shared memory, a ones column (the constants'
    input), and two pairs of staging tiles for the x the expansion reads
    (its bf16 high and low halves): one for queries, one for keys. The
    tuple the other functions here take."""
    tabs = tk.shared_tiles(OPERAND, (WIDTH, FEATURES), 5, swizzle=128)
    for i in tk.static_range(5):
        tk.store(tabs[i], tk.load(FX, (i, 0, 0), (WIDTH, FEATURES)))
    ones = tk.shared_tile(OPERAND, (64, WIDTH), swizzle=32)
    t = tk.zeros((64, WIDTH), f32, layout="row", scope="warpgroup")
    tk.store(ones, tk.where(t.col_indices() == 0, 1.0, t).to(OPERAND))
    xq = tk.shared_tiles(OPERAND, (64, WIDTH), 2, swizzle=32)
    xk = tk.shared_tiles(OPERAND, (64, WIDTH), 2, swizzle=32)
    tk.barrier()
    return tabs, ones, xq, xk


@tk.func
def staging(fx, KEYS):
    """The staging tiles of queries, or KEYS."""
    tabs, ones, xq, xk = fx
    if KEYS:
        return xk
    return xq


@tk.func
def factor(fx, e, c, j, KEYS):
    """x·e + 1·c over column block j for the staged x (queries', or KEYS'),
    complete: u with e = E, c = CU; v with e = F, c = CV."""
    tabs, ones, xq, xk = fx
    xs = staging(fx, KEYS)
    t = tk.mma_AB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), xs[0],
                  e.column_block(j))
    t = tk.mma_AB(t, xs[1], e.column_block(j))
    t = tk.mma_AB(t, ones, c.column_block(j))
    tk.mma_wait(0)
    return t


@tk.func
def expansion(fx, KEYS):
    """The E table of queries, or KEYS."""
    tabs, ones, xq, xk = fx
    if KEYS:
        return tabs[E_KEY]
    return tabs[E_QUERY]


@tk.func
def expand(x, fx, out, rows, KEYS):
    """φ of x (an f32 chunk of WIDTH columns: queries', or KEYS') into the
    chunk's FEATURES-column shared tile `out`, in its dtype, rows from `rows`
    on zeroed (φ(0) is not: the constant). The warpgroup's MMAs that read
    the staging tiles before are complete (each thread's mma_wait)."""
    tabs, ones, xq, xk = fx
    xs = staging(fx, KEYS)
    top = x.to(OPERAND)
    tk.barrier()
    tk.store(xs[0], top)
    tk.store(xs[1], (x - top.to(f32)).to(OPERAND))
    tk.barrier()
    for j in tk.static_range(FEATURES // 64):
        phi = factor(fx, expansion(fx, KEYS), tabs[CU], j, KEYS) * \
            factor(fx, tabs[F], tabs[CV], j, KEYS)
        tk.store(out.column_block(j), tk.where(phi.row_indices() < rows, phi, 0.0)
                 .to(out.dtype))


@tk.func
def through(dx, t, e, j):
    """dx + t·e_jᵀ (t: 64 x 64 f32, in two bf16 halves; issued)."""
    top = t.to(OPERAND)
    dx = tk.mma_ABt(dx, top, e.column_block(j))
    return tk.mma_ABt(dx, (t - top.to(f32)).to(OPERAND), e.column_block(j))


@tk.func
def input_grad(dphi, fx, j, KEYS):
    """The gradient of x (64 x WIDTH f32, complete) from dφ's column block j
    (64 x 64 f32), x as expand staged it: (dφ∘v)·E_jᵀ + (dφ∘u)·F_jᵀ, one
    factor at a time (registers)."""
    tabs, ones, xq, xk = fx
    e = expansion(fx, KEYS)
    dx = tk.zeros((64, WIDTH), f32, layout="row", scope="warpgroup")
    dx = through(dx, dphi * factor(fx, tabs[F], tabs[CV], j, KEYS), e, j)
    tk.mma_wait(0)
    dx = through(dx, dphi * factor(fx, e, tabs[CU], j, KEYS), tabs[F], j)
    tk.mma_wait(0)
    return dx
