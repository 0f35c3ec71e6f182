"""grouped_matmul and grouped_mm: the experts of a mixture of experts, G
products of different row counts, in one launch.

The capacity layout: a is (G, M, K), each product's rows padded to M, and
`sizes` says how many rows of each are real. The kernel is gemm.gemm over 3-D
tensors; only the 128-row tiles that hold rows are computed, by one of two
schedules (dense_schedule chooses):
- packed (DENSE): the tiles holding rows are the tasks, numbered product
  after product: STARTS[g] counts the tile rows before product g, made on
  the GPU from the sizes in three torch ops (nothing waits for the host); a
  task finds its product by binary search over STARTS. Every block of the
  persistent grid gets its share of the work;
- in place: the kernel reads the sizes itself and skips each tile past its
  product's size (one load of SIZES[g] per task): an eager call is one
  launch, but the blocks' shares of the skipped tiles differ (up to 1.3x
  the packed kernel's time at many waves of tiles, BENCHMARKS.md).

The packed (ragged) layout, as torch._grouped_mm takes it: a is (T, K), the
rows of every product one after another, `offs[g]` the end of product g's
rows. grouped_mm's kernel (gemm.gemm with OFFS) walks 128-row tiles of a and
c: a tile two products share is computed once for each. A consumer's 64 rows
that are all one product's are stored; 64 rows that products share are
zeroed first (ragged_zero_kernel, with the rows past the last product), and
each adds its own rows (the others as zeros) by TMA reduce-add. A task finds
its product by binary search over offs itself: no schedule is made on the
host or in torch. Its gradients (ragged_grads): dA by the same kernel with b
read transposed, dB by ragged_weight_grad_kernel, a sum over each product's
rows.
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks, eager, gemm
from tk_mlir.kernels.device import num_sms
from tk_mlir.runtime.arguments import contiguous_strides


@tk.kernel(num_warps=12)
def grouped_gemm_kernel(A: tk.gl, B: tk.gl, C: tk.gl, TABLE: tk.gl["i32"],
                        DENSE: tk.constexpr = False, LOG_G: tk.constexpr = 0,
                        B_KN: tk.constexpr = False, BN: tk.constexpr = 256,
                        STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                        EPI_N: tk.constexpr = 64, EPI_BUFFERS: tk.constexpr = 2):
    """`gemm` over G products (A and C padded to M rows per product), only
    the 128-row tiles holding each product's rows computed and stored.
    TABLE: with DENSE, STARTS (grouped_schedule: product g's tiles are the
    STARTS[g]-th to the STARTS[g + 1] - 1-th of all; LOG_G >= 1 the bits of
    G - 1: fewer find the wrong products);
    else the G sizes (sizes_operand; each clamped to [0, M])."""
    assert not DENSE or LOG_G >= 1, \
        f"DENSE takes LOG_G >= 1, the bits of G - 1 (at least 1: its binary search over " \
        f"STARTS), got LOG_G={LOG_G}"
    gemm.gemm(A, B, C, B_KN, 128, BN, 64, STAGES, GROUP_M, True, EPI_N, 1,
              EPI_BUFFERS=EPI_BUFFERS, LOG_G=LOG_G,
              STARTS=TABLE if DENSE else None, SIZES=None if DENSE else TABLE)


@tk.kernel(num_warps=12)
def ragged_gemm_kernel(A: tk.gl, B: tk.gl, C: tk.gl, OFFS: tk.gl["i32"], LOG_G: tk.constexpr,
                       B_KN: tk.constexpr = False, BN: tk.constexpr = 256,
                       STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                       EPI_N: tk.constexpr = 64, EPI_BUFFERS: tk.constexpr = 2,
                       SKIP_EMPTY: tk.constexpr = False):
    """C[rows of g] = A[rows of g] @ B[g].T (B[g] with B_KN) for the G
    products whose rows end at OFFS[g] (`gemm` with OFFS): 64-row tiles of C
    all of one product's rows are stored, those products share are added
    into (they must hold zeros: ragged_zero_kernel); LOG_G the bits of G.
    SKIP_EMPTY skips tiles without rows of their product (empty products'
    slots): it pays when most products have few rows (a decode step), and
    costs a binary search at each task's start in the consumers otherwise
    (ragged_launch chooses it)."""
    gemm.gemm(A, B, C, B_KN, 128, BN, 64, STAGES, GROUP_M, True, EPI_N, 1,
              EPI_BUFFERS=EPI_BUFFERS, OFFS=OFFS, LOG_G=LOG_G, SKIP_EMPTY=SKIP_EMPTY)


@tk.kernel(num_warps=4)
def ragged_zero_kernel(C: tk.gl, OFFS: tk.gl["i32"], COLS: tk.constexpr = 128):
    """Zero the 64-row tiles of C that ragged_gemm_kernel adds into: those a
    product's rows end inside (OFFS[g], clamped to [0, M], not a multiple of
    64; zeroed by the first product ending there) and those past the last
    product's end. One block per product (grid G): block g takes its end's
    tile, then every G-th tile past the last end."""
    M, N = C.shape
    g, G = tk.block_id(0), tk.grid_dim(0)

    def row_end(i):                 # OFFS[i] as the GEMM reads it (i = -1: 0, before the start)
        return min(max(tk.load(OFFS, (i,)), 0), M)

    end, before = row_end(g), row_end(g - 1)
    zeros = tk.zeros((64, COLS), C.dtype)
    if end % 64 != 0:
        if before % 64 == 0 or before // 64 != end // 64:
            for j in range(tk.cdiv(N, COLS)):
                tk.store(C, zeros, (end // 64, j))
    last = row_end(G - 1)
    for t in range(tk.cdiv(last, 64) + g, tk.cdiv(M, 64), G):
        for j in range(tk.cdiv(N, COLS)):
            tk.store(C, zeros, (t, j))


@tk.kernel(num_warps=12)
def ragged_weight_grad_kernel(A: tk.gl, DC: tk.gl, DB: tk.gl, OFFS: tk.gl["i32"],
                              BN: tk.constexpr = 128, STAGES: tk.constexpr = 4):
    """DB[g] = A[rows of g]ᵀ @ DC[rows of g] for the G products whose rows end
    at OFFS[g] (clamped to [0, T]): grouped_mm's gradient for b, a sum over
    each product's rows. A task is one 128 x BN tile of one DB[g] (K x N);
    it walks the 64-row windows of A and DC that hold g's rows, and zeroes
    the other products' rows of its first and last windows in A and in DC
    (each consumer its own 64 columns of A and half of DC's, so a non-finite
    value there stays out of g's sum) before their MMA. A product without
    rows gets zeros."""
    T, K = A.shape
    N = DB.shape[2]
    tiles_m, tiles_n = tk.cdiv(K, 128), tk.cdiv(N, BN)
    # DB leaves by TMA stores, 64 columns at a time through two staging tiles
    # per consumer (with few rows per product the kernel is bound by them)
    staging = tk.shared_tiles(DB.dtype, (64, 64), 4, swizzle=128)

    def row_end(g):                 # OFFS[g] clamped to [0, T] (g = -1: 0, before the start)
        return min(max(tk.load(OFFS, (g,)), 0), T)

    def tile_of(task):
        """(g, m, n, first, end): the task's product, its tile of DB[g] and
        g's rows [first, end)."""
        g = task // (tiles_m * tiles_n)
        m, n = tk.grouped_tile(task % (tiles_m * tiles_n), tiles_m, tiles_n, 8)
        return g, m, n, row_end(g - 1), row_end(g)

    def windows(task):
        """The 64-row windows holding the task's product's rows (none when it
        has no rows, or its end is before its start)."""
        _, _, _, first, end = tile_of(task)
        return (tk.cdiv(end, 64) - first // 64) * (first < end)

    def load(where, k, a, b, sem):
        _, m, n, first, _ = where
        tk.tma.load_async(a, A, (first // 64 + k, m), sem)
        tk.tma.load_async(b, DC, (first // 64 + k, n), sem)

    def prepare(where, k, wg, a, b):
        _, _, _, first, end = where
        top = (first // 64 + k) * 64
        if (top < first) | (top + 64 > end):        # other products' rows: zeros
            # in DC too: 0 times an inf or NaN there would still reach this sum
            blocks = [a.column_block(wg)] + [b.column_block(wg * (BN // 128) + j)
                                             for j in tk.static_range(BN // 128)]
            for columns in blocks:
                x = tk.load(columns, layout="row", scope="warpgroup")
                rows = x.row_indices() + top
                tk.store(columns, tk.where((rows >= first) & (rows < end), x, 0.0))
            tk.named_barrier(3, warps=8)            # (both halves of DC, before either MMA)

    def setup(task, wg):
        return tk.zeros((64, BN), f32, layout="row", scope="warpgroup")

    def compute(acc, wg, a, b):     # the warpgroup's 64 rows of DB[g]: 64 columns of A's window
        return tk.mma_AtB(acc, a.column_block(wg), b)

    def finish(acc, task, wg):
        g, m, n, _, _ = tile_of(task)
        tk.store_in_pieces(DB, acc, 2 * m + wg, n * (BN // 64), 64, wg, staging, 2, outer=(g,))

    tk.lcf(DB.shape[0] * tiles_m * tiles_n, 0,
           [(A.dtype, (64, 128), 128), (DC.dtype, (64, BN), 128)], load, setup, compute, finish,
           stages=STAGES, consumers=2, plan=tile_of, task_iters=windows, prepare=prepare)


def grouped_mm(a, b, offs, bias=None, out_dtype=None):
    """G products of different row counts packed in one tensor (an MoE's
    experts, tokens sorted by expert), as torch._grouped_mm(a, b, offs) with a
    2-D a and a 3-D b: out[rows of g] = a[rows of g] @ b[g], where product g's
    rows are offs[g - 1] (0 for g = 0) up to offs[g].

    a: (T, K) torch.bfloat16 or torch.float16 on a CUDA device; b: (G, K, N),
    a's dtype and device, in either layout: row-major, or the transpose of a
    contiguous (G, N, K) tensor (an expert's weight as a Linear keeps it,
    `w.transpose(1, 2)`); another layout is copied. K and N multiples of 8
    (rows of whole 16-byte vectors).
    offs: G nondecreasing ends in [0, T], int32. Where they live decides how
    they are checked, as grouped_matmul's sizes: on the host (a list or tuple
    of ints, or a CPU tensor) each is checked and they are copied to a's
    device; on a's device (the router's cumulative counts) they are read by
    the GPU only, each clamped to [0, T], and not checked (that would wait
    for the GPU): decreasing device offs give undefined rows (never memory
    outside a, b and the result). Rows past offs[-1] are zeros.
    bias: None (torch._grouped_mm's argument; not supported). out_dtype: None
    or a's dtype (the result's).

    Returns a new (T, N) tensor. Differentiable in a and b (ragged_grads:
    db[g] sums over g's rows, ragged_weight_grad_kernel). Under
    torch.compile it runs as the custom op torch.ops.tk_mlir.grouped_mm
    (host offs: pass a tensor, or dynamo specializes the compiled graph on
    the list's values)."""
    import torch
    if torch.compiler.is_compiling():
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir on first use
        if isinstance(offs, (list, tuple)) and isinstance(a, torch.Tensor) and a.dim() == 2:
            offs = check_offs(offs, a)          # (the op takes a tensor)
        check_ragged(a, b, offs, bias, out_dtype)
        return torch.ops.tk_mlir.grouped_mm(a, b, offs)
    if isinstance(a, torch.Tensor) and a.dim() == 2 and \
            not (isinstance(offs, torch.Tensor) and offs.is_cuda):
        offs = check_offs(offs, a)             # host offs: their values, on every call
    key = (eager.tensor_key(a), eager.tensor_key(b), eager.tensor_key(offs),
           eager.tensor_key(bias), eager.option_key(out_dtype), torch.is_grad_enabled())
    return _RAGGED.call(key, lambda: _prepare_ragged(a, b, offs, bias, out_dtype), a, b, offs)


_RAGGED = eager.Prepared()


def _prepare_ragged(a, b, offs, bias, out_dtype):
    """After checking an eager grouped_mm call, `run(a, b, offs) -> out` for
    calls like it, through autograd when an input requires grad (grad mode
    on: the key holds both)."""
    import torch
    check_ragged(a, b, offs, bias, out_dtype)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        from tk_mlir.kernels import custom_ops
        return custom_ops.EagerGroupedMm.apply
    return ragged_launch


def check_ragged(a, b, offs, bias=None, out_dtype=None) -> None:
    """The arguments of grouped_mm, each rule with the argument that breaks it
    (offs on the host are checked by check_offs)."""
    import torch
    fn, inputs = "grouped_mm", (torch.bfloat16, torch.float16)
    checks.tensor(fn, "a", a, ndim=2, dtypes=inputs)
    checks.tensor(fn, "b", b, ndim=3, dtypes=inputs)
    checks.like(fn, "b", b, "a", a)
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"{fn}: inner dimensions differ: a is {tuple(a.shape)} (T x K), b is "
                         f"{tuple(b.shape)} (G x K x N)")
    for name, n in (("K", a.shape[1]), ("N", b.shape[2])):
        if n % 8:
            raise ValueError(f"{fn}: {name} must be a multiple of 8 (rows of whole 16-byte "
                             f"vectors, as torch._grouped_mm requires), got a {tuple(a.shape)}, "
                             f"b {tuple(b.shape)}")
    G = b.shape[0]
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{fn}: offs must be a torch.Tensor (int32) or a list or tuple of ints "
                        f"(G={G} row ends), got {type(offs).__module__}.{type(offs).__name__}")
    if offs.dim() != 1 or offs.shape[0] != G or \
            offs.dtype != torch.int32 or offs.device not in (a.device, torch.device("cpu")):
        on = "the CPU" if a.device.type == "cpu" else f"the CPU or {a.device}"
        raise ValueError(f"{fn}: offs must be a 1-D int32 tensor of G={G} row ends (b's "
                         f"first dim) on {on}, got {checks.describe(offs)}")
    if bias is not None:
        raise ValueError(f"{fn}: bias is not supported (add it to the result), got "
                         f"{checks.describe(bias)}")
    if out_dtype is not None and out_dtype != a.dtype:
        raise TypeError(f"{fn}: out_dtype must be None or a's dtype {a.dtype} (the result is "
                        f"added in a's dtype), got {out_dtype}")
    checks.on_cuda(fn, "a", a)


def check_offs(offs, a, fn: str = "grouped_mm"):
    """Host offs (a list or tuple of ints, or a CPU tensor) as an int32 tensor
    after checking each: nondecreasing, in [0, T] for a of T rows. Anything
    else is returned as it is (check_ragged says what is wrong with it)."""
    import torch
    if isinstance(offs, (list, tuple)):
        offs = _host_ints(fn, "offs", offs, "a row end")
        if any(not -2**31 <= n < 2**31 for n in offs):
            raise ValueError(f"{fn}: offs must be int32 row ends, got {list(offs)}")
        offs = torch.tensor(offs, dtype=torch.int32).reshape(len(offs))
    if not isinstance(offs, torch.Tensor) or offs.device.type != "cpu" or offs.dim() != 1 \
            or offs.dtype != torch.int32:
        return offs
    T = a.shape[0]
    previous = torch.cat([offs.new_zeros(1), offs[:-1]])
    bad = ((offs < previous) | (offs > T)).nonzero()
    if len(bad):
        g = int(bad[0, 0])
        raise ValueError(f"{fn}: offs[{g}] is {int(offs[g])}: row ends must be nondecreasing "
                         f"from 0 and at most T = {T} (a's rows), got {offs.tolist()}")
    return offs


def ragged_launch(a, b, offs, out=None):
    """ragged_zero_kernel and ragged_gemm_kernel on checked arguments, into
    out (a (T, N) tensor of a's dtype whose values are not read; a new one
    when None); returns it."""
    import torch
    T, K = a.shape
    G, _, N = b.shape
    if out is None:
        out = torch.empty((T, N), dtype=a.dtype, device=a.device)
    if not (T and N and K and G):
        return out.zero_()
    offs = checks.int32_table(offs.to(a.device, non_blocking=True))
    ragged_zero_kernel[(G,)](out, offs)
    kn = b.stride(2) == 1 and checks.readable(b)
    bt = b if kn else b.transpose(1, 2)
    if not kn and not checks.readable(bt):
        bt, kn = checks.kernel_operand(b), True     # (contiguous() keeps a misaligned b)
    ragged_gemm_kernel[(num_sms(a.get_device()),)](
        checks.kernel_operand(a), bt, out, offs, LOG_G=(G - 1).bit_length(), B_KN=kn,
        BN=256 if N > 128 else 128, SKIP_EMPTY=skip_empty_tiles(T, G))
    return out


def ragged_grads(dc, a, b, offs, need_a: bool = True, need_b: bool = True):
    """(da, db) of out = grouped_mm(a, b, offs) given dc (out's shape), each
    None when not needed, on checked arguments: da = dc[rows of g] @ b[g]ᵀ
    (grouped_mm's kernel with b read transposed, no copy; zeros past the
    last product), db[g] = a[rows of g]ᵀ @ dc[rows of g] (a new (G, K, N)
    tensor; zeros for a product without rows)."""
    dc = checks.kernel_operand(dc, a.dtype)
    offs = checks.int32_table(offs.to(a.device, non_blocking=True))   # (once for both)
    da = ragged_launch(dc, b.transpose(1, 2), offs) if need_a else None
    return da, (ragged_weight_grad(a, dc, offs, b.shape[0]) if need_b else None)


def ragged_weight_grad(a, dc, offs, G: int):
    """ragged_weight_grad_kernel on checked arguments (offs an int32 table on
    a's device, checks.int32_table): the (G, K, N) tensor of a[rows of g]ᵀ @
    dc[rows of g], in a's dtype."""
    import torch
    T, K = a.shape
    N = dc.shape[1]
    db = torch.empty((G, K, N), dtype=a.dtype, device=a.device)
    if not (T and K and N and G):
        return db.zero_()
    ragged_weight_grad_kernel[(num_sms(a.get_device()),)](
        checks.kernel_operand(a), dc, db, offs, BN=256 if N > 128 else 128)
    return db


def skip_empty_tiles(T: int, G: int) -> bool:
    """Whether ragged_gemm_kernel should skip tiles without rows: when the
    products average less than a 128-row tile (T < 128·G), most of the G
    extra slots are empty products' and skipping them pays (a decode step
    of 64 rows over 256 experts: 3.5x); with fuller products the skip's
    per-task search costs more than it saves (BENCHMARKS.md, "Ragged grouped
    GEMM")."""
    return T < 128 * G


def grouped_matmul(a, b, sizes, c=None, *, b_layout: str = "nk"):
    """G products of different row counts in one launch (the experts of a
    mixture of experts, in the capacity layout):
    c[g, :sizes[g]] = a[g, :sizes[g]] @ b[g].T ("nk": b is G x N x K) or
    @ b[g] ("kn": G x K x N).

    a: (G, M, K), each product's rows padded to M; b: bf16/f16 like a;
    c: (G, M, N) of a 16-bit dtype or torch.float32, written in place; by
    default a new tensor of a's dtype.

    sizes: G row counts, each in [0, M]. Where they live decides how they are
    checked:
    - on the host (a list or tuple of ints, or an int32/int64 CPU tensor):
      each is checked, a size outside [0, M] is a ValueError naming sizes[g]
      and its value, then they are copied to a's device (a host-to-device
      copy: not inside a CUDA graph capture);
    - on a's device (an int32/int64 CUDA tensor, e.g. an MoE router's
      counts): read by the GPU only, never checked, clamped to [0, M] (a
      check would wait for the GPU on every call and break CUDA graph
      capture, which is what device sizes are for).

    Only the 128-row tiles that hold rows below sizes[g] are computed: rows
    from sizes[g] to the end of that tile hold the products of a's padding
    rows, later rows are not written. Returns c.

    Differentiable in a and b (without c): as the function computed, the
    rows up to the end of each product's last 128-row tile count
    (grouped_grads). Under torch.compile it runs as the custom op
    torch.ops.tk_mlir.grouped_matmul (into a zeroed tensor, copied into c)."""
    import torch
    recorded = torch.is_grad_enabled() and isinstance(a, torch.Tensor) and \
        isinstance(b, torch.Tensor) and (a.requires_grad or b.requires_grad)
    if recorded and c is not None:
        raise RuntimeError("grouped_matmul: c (the output to write into) does not take part in "
                           "autograd, and an input requires grad; leave out c (or call under "
                           "torch.no_grad())")
    if torch.compiler.is_compiling():
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir on first use
        if isinstance(sizes, (list, tuple)):     # the op takes a tensor; its real run checks it
            sizes = torch.tensor(sizes, dtype=torch.int64)
        out = torch.ops.tk_mlir.grouped_matmul(a, b, sizes, b_layout,
                                               None if c is None else c.dtype)
        return out if c is None else c.copy_(out)
    if isinstance(a, torch.Tensor):
        if a.dim() != 3:
            raise ValueError(f"grouped_matmul: a must be 3-D (G x M x K), got shape "
                             f"{tuple(a.shape)}")
        if not (isinstance(sizes, torch.Tensor) and sizes.is_cuda):
            sizes = check_sizes(sizes, a)      # host sizes: their values, on every call
    # eager: a signature seen before was checked then (eager.py), but for c's memory
    # against a's and b's (the same signature may alias)
    if c is not None:
        checks.written_apart("grouped_matmul", "c", c, a=a, b=b)
    key = (eager.tensor_key(a), eager.tensor_key(b), eager.tensor_key(sizes),
           eager.tensor_key(c), b_layout, torch.is_grad_enabled())
    return _PREPARED.call(key, lambda: _prepare(a, b, sizes, c, b_layout, recorded),
                          a, b, sizes, c)


# Eager calls by signature (eager.py).
_PREPARED = eager.Prepared()


def _prepare(a, b, sizes, c, b_layout: str, recorded: bool):
    """After checking an eager call, `run(a, b, sizes, c) -> c` for calls like
    it (sizes on a's device, or checked host sizes), through autograd when
    it records them."""
    import torch
    if isinstance(a, torch.Tensor):
        check_sizes(sizes, a)
    gemm.check(a, b, c, b_layout, "grouped_matmul")
    checks.output_outside_autograd("grouped_matmul", "c", c)
    if recorded:                                # (c is None: refused with grads)
        from tk_mlir.kernels import custom_ops
        product = _planned(a, b, sizes, None, b_layout)
        gradients = eager.per_layout(lambda a, b, sizes: planned_grads(a, b, b_layout), 3)
        return lambda a, b, sizes, c: custom_ops.EagerGroupedMatmul.apply(
            a, b, sizes.to(a.device), b_layout, product, gradients)
    return _planned(a, b, sizes, c, b_layout)


def _planned(a, b, sizes, c, b_layout: str):
    """`run(a, b, sizes, c) -> c` for checked tensors like these: where the
    kernel reads them as they lie and there is a product to compute, its
    launch chosen here, once (it follows from the shapes; a signature
    launcher); else `launch`, which pads and chooses per call."""
    G, M, K = a.shape
    shape = gemm.output_shape(a, b, b_layout)
    if not (G * M * shape[-1] * K and gemm.read_as_they_lie(a, b, c, shape[-1])):
        return lambda a, b, sizes, c: launch(a, b, sizes, c, b_layout)
    sms, dense, constexprs = _launch_config(G, M, shape[-1], b_layout, a.get_device())
    kernel = grouped_gemm_kernel._signature_launcher((sms,), **constexprs)
    host_sizes = sizes.device != a.device   # (keyed: checked by the wrapper)

    def run(a, b, sizes, c):
        if host_sizes:
            sizes = sizes.to(a.device)
        c = a.new_empty(shape) if c is None else c
        kernel(a, b, c, _table(sizes, M, dense))
        return c
    return run


def launch(a, b, sizes, c, b_layout: str):
    """grouped_gemm_kernel on checked arguments, into c (a new tensor of a's
    dtype when None); returns c. Any N and K (gemm.padded_launch)."""
    import torch
    if sizes.device != a.device:
        sizes = sizes.to(a.device)
    if c is None:
        c = torch.empty(gemm.output_shape(a, b, b_layout), dtype=a.dtype, device=a.device)
    # (the kernel writes each product's tile rows only: the rest keep c's values)
    gemm.padded_launch(lambda a, b, c: _launch(a, b, sizes, c, b_layout), a, b, c, b_layout,
                       partial=True)
    return c


def _launch(a, b, sizes, c, b_layout: str) -> None:
    G, M, K = a.shape
    N = c.shape[-1]
    if not G * M * N:
        return
    if not K:                           # (sums of no products: zeros in the rows it writes)
        c.masked_fill_(written_rows(sizes, M)[..., None], 0)
        return
    sms, dense, constexprs = _launch_config(G, M, N, b_layout, a.get_device())
    grouped_gemm_kernel[(sms,)](a, b, c, _table(sizes, M, dense), **constexprs)


def _launch_config(G: int, M: int, N: int, b_layout: str, device: int):
    """(grid, whether the schedule is packed, grouped_gemm_kernel's
    constexprs) for G products of M x N on `device`."""
    bn = 256 if N > 128 else 128
    sms = num_sms(device)
    dense = dense_schedule(G, M, N, bn, sms)
    return sms, dense, dict(DENSE=dense, LOG_G=max(1, (G - 1).bit_length()) if dense else 0,
                            B_KN=b_layout == "kn", BN=bn)


def _table(sizes, M: int, dense: bool):
    """The kernel's TABLE for sizes on its device: the packed schedule, or
    the sizes themselves."""
    return grouped_schedule(sizes, M) if dense else sizes_operand(sizes, M)


def dense_schedule(G: int, M: int, N: int, bn: int, sms: int) -> bool:
    """Whether grouped_gemm_kernel should take the packed schedule (STARTS)
    rather than skip tiles in place: when the products' tiles fill more than
    four waves of the persistent grid. There the blocks' uneven shares of
    skipped tiles cost up to 1.3x (8 x 2048 x 4096 x 1024: 478 against 610
    TFLOP/s) and the schedule's torch ops are small beside the kernel; below,
    a call is host-bound and one launch is what counts (BENCHMARKS.md)."""
    return G * -(-M // 128) * -(-N // bn) > 4 * sms


def sizes_operand(sizes, M: int):
    """Row counts as grouped_gemm_kernel reads them: int32, rows of whole
    16-byte vectors (as every tensor argument's): sizes itself when it is
    already (int32, G a multiple of 4), else a converted or padded copy
    (int64 sizes clamped to [0, M] first, as the kernel clamps int32 ones:
    a cast alone would wrap sizes past 2**31)."""
    import torch
    if sizes.dtype != torch.int32:
        sizes = sizes.clamp(0, M).to(torch.int32)
    return checks.int32_table(sizes)


def written_rows(sizes, M: int):
    """(G, M) bool on sizes' device: the rows of each product the kernel
    writes, those of its 128-row tiles that hold rows below sizes[g]
    (sizes clamped to [0, M], as the kernel reads them)."""
    import torch
    ends = (row_tiles(sizes, M) * 128).clamp(max=M)
    return torch.arange(M, device=sizes.device)[None, :] < ends[:, None]


def row_tiles(sizes, M: int):
    """The 128-row tiles each product's rows take, sizes clamped to [0, M]
    as the kernel reads them (a tensor like sizes)."""
    return (sizes.clamp(0, M) + 127) // 128


def check_sizes(sizes, a, fn: str = "grouped_matmul"):
    """grouped_matmul's `sizes` for a 3-D tensor a, as a tensor: G int32/int64
    row counts on the CPU or a's device; those on the CPU (or given as a list
    or tuple) each in [0, M]. Those on a CUDA device are not read here (that
    would wait for the GPU)."""
    import torch
    G, M = a.shape[0], a.shape[1]
    if isinstance(sizes, (list, tuple)):
        sizes = _host_ints(fn, "sizes", sizes, "a row count")
        sizes = torch.tensor(sizes, dtype=torch.int64).reshape(len(sizes))
    on = str(a.device) if a.device.type == "cpu" else f"the CPU or {a.device}"
    if not isinstance(sizes, torch.Tensor):
        raise TypeError(f"{fn}: sizes must be G={G} row counts, a list of ints or a 1-D int32 "
                        f"or int64 tensor on {on}, got {checks.describe(sizes)}")
    if sizes.layout != torch.strided or sizes.dim() != 1 or sizes.shape[0] != G or \
            sizes.dtype not in (torch.int32, torch.int64) or \
            sizes.device not in (a.device, torch.device("cpu")):
        raise ValueError(f"{fn}: sizes must be a 1-D int32 or int64 tensor of "
                         f"G={G} row counts on {on}, got {checks.describe(sizes)}")
    if sizes.device.type == "cpu":
        bad = ((sizes < 0) | (sizes > M)).nonzero()
        if len(bad):
            g = int(bad[0, 0])
            n = int(sizes[g])
            raise ValueError(f"{fn}: sizes[{g}] is {n}, outside [0, M] = [0, {M}]: "
                             f"each product has at most M rows (a is G x M x K = "
                             f"{tuple(a.shape)})")
    return sizes


def _host_ints(fn: str, name: str, values, what: str) -> list[int]:
    """A list's values as ints: each an integer (a numpy one too), not a
    bool, else a TypeError naming name[g]."""
    import numbers
    for g, n in enumerate(values):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool):
            raise TypeError(f"{fn}: {name}[{g}] must be an int ({what}), got "
                            f"{type(n).__name__} {n!r}")
    return [int(n) for n in values]


def grouped_schedule(sizes, M: int):
    """grouped_gemm_kernel's STARTS, made on the sizes' device: G + 1 int32s,
    STARTS[g] the 128-row tiles of the products before g (rows clamped to
    [0, M]; the last, the total), padded to a 16-byte row as every tensor
    argument's. Three torch ops (each costs an eager call host time): the
    tiles of each product by bucketing its size against the tiles' first
    rows (ceil(clamp(n, 0, M) / 128) in one op), summed in place."""
    import torch
    G = sizes.shape[0]
    starts = torch.zeros(-(-(G + 1) // 4) * 4, dtype=torch.int32, device=sizes.device)
    tiles = torch.bucketize(sizes, _tile_first_rows(M, sizes), out_int32=True)
    torch.cumsum(tiles, 0, dtype=torch.int32, out=starts[1:G + 1])
    return starts


_FIRST_ROWS: dict = {}
_MAX_FIRST_ROWS = 256


def _tile_first_rows(M: int, sizes):
    """[0, 128, ..., 128 (cdiv(M, 128) - 1)] like sizes (its dtype and device):
    the boundaries n is bucketed against (n <= 0: 0; above the last, every
    tile). Kept per (M, dtype, device) and never dropped (a captured CUDA
    graph may read a kept one at every replay), up to _MAX_FIRST_ROWS; past
    that, and while a graph is captured (its memory is the graph's), made
    for the call."""
    import torch
    key = (M, sizes.dtype, sizes.device)
    first = _FIRST_ROWS.get(key)
    if first is None:
        first = torch.arange(0, M, 128, dtype=sizes.dtype, device=sizes.device)
        if len(_FIRST_ROWS) < _MAX_FIRST_ROWS and \
                not (sizes.is_cuda and torch.cuda.is_current_stream_capturing()):
            _FIRST_ROWS[key] = first
    return first


def planned_grads(a, b, b_layout: str):
    """`run(dc, a, b, sizes, b_layout, need_a, need_b) -> (da or None, db or
    None)`: grouped_grads (its arguments) for an eager signature's a and b (laid out as these on every
    call: autograd's saved inputs; sizes on a's device), its two launches
    chosen once and bound to the signature; dC, whose layout autograd
    chooses, is copied into the product's (contiguous, a's dtype) where it is
    not, and da and db are new contiguous tensors. Sizes that are not whole
    16-byte rows (K or N), operands the kernels cannot read as they lie, or
    no product at all take grouped_grads per call."""
    import torch
    G, M, K = a.shape
    shape = gemm.output_shape(a, b, b_layout)
    N, dtype, device, size = shape[-1], a.dtype, a.device, a.element_size()
    whole = gemm._whole_vectors(N, size) == N and gemm._whole_vectors(K, size) == K
    if not (G * M * N * K and whole and checks.readable(a) and checks.readable(b)):
        return grouped_grads
    nk = b_layout == "nk"
    # da = grouped_matmul(dc, b) into zeros, b read in the other layout (G products
    # of M x K); db = the batched dcᵀ·a (N x K) or aᵀ·dc (K x N), dc's rows past
    # each product's tiles masked, the transposed operand read as K x M
    sms, dense, constexprs = _launch_config(G, M, K, "kn" if nk else "nk", a.get_device())
    product_a = grouped_gemm_kernel._signature_launcher((sms,), **constexprs)
    product_b = gemm.planned_run(gemm._plan(N, K, M, sms, G, None) if nk else
                                 gemm._plan(K, N, M, sms, G, None), "kn", "km", sms,
                                 same_signature=True)
    strides, db_shape = contiguous_strides(shape), (G, N, K) if nk else (G, K, N)

    def run(dc, a, b, sizes, b_layout, need_a, need_b):   # (b_layout: the signature's)
        dc = eager.laid_out(dc, shape, strides, dtype)
        da = db = None
        if need_a:
            da = torch.zeros((G, M, K), dtype=dtype, device=device)
            product_a(dc, b, da, _table(sizes, M, dense))
        if need_b:
            dc, a = _counted_rows(sizes, M, dc, a)
            db = torch.empty(db_shape, dtype=dtype, device=device)
            product_b(*((dc, a) if nk else (a, dc)), db)
        return da, db
    return run


def _counted_rows(sizes, M: int, *tensors):
    """Each (G, M, X) tensor with the rows past each product's last tile
    (written_rows) set to 0: db's GEMM reads all M rows of dc and a, and
    0 times the inf or NaN an uninitialised padding row may hold is NaN."""
    import torch
    rows = written_rows(sizes, M)[..., None]
    return tuple(torch.where(rows, t, 0) for t in tensors)


def grouped_grads(dc, a, b, sizes, b_layout: str, need_a: bool = True, need_b: bool = True):
    """(da, db) of c = grouped_matmul(a, b, sizes) given dc, each None when
    not needed. c's rows below each product's tile end (sizes[g] rounded up
    to 128, at most M) are products of a's rows, the rest are constant: da
    is grouped_matmul(dc, b) over the same rows (zeros beyond), db the
    batched dcᵀ·a over the same rows, dc's and a's others masked to 0 (the
    K x M GEMM, no transposed copy)."""
    import torch
    G, M, _ = a.shape
    dc = checks.kernel_operand(dc, a.dtype)
    da = db = None
    if need_a:
        da = torch.zeros_like(a)
        launch(dc, b, sizes, da, "kn" if b_layout == "nk" else "nk")
    if need_b:
        dc, a = _counted_rows(sizes.to(dc.device), M, dc, a)
        db = torch.empty_like(b)        # nk: dcᵀ·a (N x K); kn: aᵀ·dc (K x N)
        gemm.launch(*((dc, a) if b_layout == "nk" else (a, dc)), db, "kn", a_layout="km")
    return da, db
