"""Register layouts: which thread holds which element of a register tile.

A layout maps the bits of (register index, lane, warp) to element positions:
every basis is one power of two on one axis (or None: that bit replicates),
and register r of lane l in warp w holds the element at the sum of the bases
of the set bits of r, l and w. This is the linear-layout idea restricted to
permutations of bits (all ThunderKittens' tiles need), and it lets the
lowering *derive* what it would otherwise special-case per tile shape:
vector accesses (registers whose low bits step along columns by 1, 2, 4...),
row reductions (registers, then shuffles across lane bits, then shared memory
across warp bits along columns) and broadcasts (the per-row vector is the
tile layout with its column bases dropped: `slice`).

A tile side of m·2^k elements (m odd: 48 = 3·16, 176 = 11·16) adds one
*repeat* to the register index, CuTe's outer mode: the register index is a
mixed-radix number whose digits are the bits and, above the bits along that
axis, one digit of radix m stepping 2^k along it. Lanes and warps stay bits.
Placing a column repeat above the column bits and below the row bits keeps the
`row` layout's registers in wgmma's accumulator and A-fragment order (64x16
blocks along K, then 64-row blocks: lowering/mma.py).

Named tile layouts:
  vec  runs of 8 elements along a row per thread (shorter, down to 2, in a
       tile of several rows whose threads would otherwise hold copies, where
       the warps can stay on rows); lanes along columns first, then rows; warps along rows, then
       columns. Wide, coalesced accesses: the default for elementwise and
       normalization kernels.
  row  ThunderKittens' MMA fragment layout (16x16 base tiles: lane/4 picks
       the row, lane%4 a column pair); warps stack along rows.
  col  `row` transposed.
  tmem one row per thread, its columns in consecutive registers: Blackwell
       tensor memory's lanes as tcgen05.ld/st (32x32b) move them, thread t of
       warp w holding row 32·w + t of a 128-row tile (a warpgroup's tile).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

# (axis, log2 of the step): one bit; None: that bit replicates; (axis, log2 of
# the step, count): a register digit of radix count (a repeat, count odd > 1).
Basis = tuple[int, int] | tuple[int, int, int] | None

VEC_RUN = 8   # elements a `vec` thread holds contiguously along a row


class LayoutError(ValueError):
    pass


def radix(b: Basis) -> int:
    """How many values a register digit takes: 2 for a bit, count for a repeat."""
    return 2 if b is None or len(b) == 2 else b[2]


def _digits(r: int, bases: tuple[Basis, ...]):
    """(basis, digit) of each register digit of register index r, lowest first."""
    for b in bases:
        r, d = divmod(r, radix(b))
        yield b, d


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    reg: tuple[Basis, ...]
    lane: tuple[Basis, ...]    # 5 bits
    warp: tuple[Basis, ...]

    @property
    def num_regs(self) -> int:
        n = 1
        for b in self.reg:
            n *= radix(b)
        return n

    def offset(self, basis: Basis) -> tuple[int, ...]:
        out = [0] * len(self.shape)
        if basis is not None:
            out[basis[0]] = 1 << basis[1]
        return tuple(out)

    def reg_position(self, r: int) -> tuple[int, ...]:
        """The element register r holds in lane 0 of warp 0."""
        pos = [0] * len(self.shape)
        for b, d in _digits(r, self.reg):
            if b is not None:
                pos[b[0]] += d << b[1]
        return tuple(pos)

    def position(self, r: int, lane: int = 0, warp: int = 0) -> tuple[int, ...]:
        """The element register r of `lane` in `warp` holds."""
        pos = list(self.reg_position(r))
        for bits, bases in ((lane, self.lane), (warp, self.warp)):
            for i, b in enumerate(bases):
                if b is not None and bits >> i & 1:
                    pos[b[0]] += 1 << b[1]
        return tuple(pos)

    def vector_run(self, axis: int) -> int:
        """How many consecutive registers step by 1 along `axis` (a power of 2)."""
        n = 0
        while n < len(self.reg) and self.reg[n] == (axis, n):
            n += 1
        return 1 << n

    def replicated_bits(self, kind: str) -> list[int]:
        return [i for i, b in enumerate(getattr(self, kind)) if b is None]

    def warp_bits_along(self, axis: int) -> list[int]:
        """Warp bits stepping along `axis`: a reduction over it crosses warps there."""
        return [i for i, b in enumerate(self.warp) if b is not None and b[0] == axis]

    # ---- slices: the layout of per-row / per-column vectors

    def slice(self, keep_axis: int) -> Layout:
        """Project onto one axis: the layout of a vector of per-row (keep 0)
        or per-column (keep 1) values. Registers whose bases leave the axis
        are dropped (they would hold copies); lane and warp bits that leave it
        become replicated."""
        def project(b: Basis) -> Basis:
            return (0, *b[1:]) if b is not None and b[0] == keep_axis else None
        reg = tuple(project(b) for b in self.reg if project(b) is not None)
        return Layout((self.shape[keep_axis],), reg,
                      tuple(project(b) for b in self.lane),
                      tuple(project(b) for b in self.warp))

    def slice_register(self, keep_axis: int, r: int) -> int:
        """The register of `self.slice(keep_axis)` holding tile register r's value."""
        out, weight = 0, 1
        for b, d in _digits(r, self.reg):
            if b is not None and b[0] == keep_axis:
                out += d * weight
                weight *= radix(b)
        return out

    # ---- lane exchanges: registers traded between lanes by warp shuffles

    def exchanged(self, digit: int, lane_bit: int) -> Layout:
        """The layout after register digit `digit` (a bit) and lane bit
        `lane_bit` trade bases: each thread keeps the register whose digit
        equals its lane bit and trades the other with the lane across that
        bit (lowering/lane_exchange.py moves the data)."""
        reg, lane = list(self.reg), list(self.lane)
        reg[digit], lane[lane_bit] = lane[lane_bit], reg[digit]
        return Layout(self.shape, tuple(reg), tuple(lane), self.warp)

    def digit_strides(self) -> list[int]:
        """For each register digit, how far apart (in registers) two
        registers differing by one in it are."""
        strides, s = [], 1
        for b in self.reg:
            strides.append(s)
            s *= radix(b)
        return strides

    def reordered(self, order: list[int]) -> tuple[Layout, list[int]]:
        """The layout whose register digit i is this one's digit order[i],
        and for each of its registers the register of this layout that holds
        the same element (a renumbering: no data moves)."""
        strides = self.digit_strides()
        new = Layout(self.shape, tuple(self.reg[i] for i in order), self.lane, self.warp)
        picked = [sum(d * strides[i] for (_, d), i in zip(_digits(r, new.reg), order))
                  for r in range(new.num_regs)]
        return new, picked

    def widening(self, axis: int, max_run: int) -> tuple[list[tuple[int, int]], list[int]]:
        """How to give each thread runs of up to `max_run` consecutive
        elements along `axis` (wider memory accesses): the (register digit,
        lane bit) exchanges to make in turn, then the digit order that puts
        the run's digits lowest (`reordered`). A lane bit stepping just past
        the run trades places with the smallest register bit along `axis`
        that steps beyond every lane's, where the lanes along `axis` then
        still cover one contiguous span with the run (row layout, 16-bit:
        the quad's 4 x 4 bytes of a row become 4 x 16); it stops where no
        exchange keeps that."""
        layout, steps = self, []
        while True:
            run_digits = layout._run_digits(axis)
            run = 1 << len(run_digits)
            if run >= max_run:
                break
            lane_bits = [k for k, b in enumerate(layout.lane) if b == (axis, len(run_digits))]
            free = [(b[1], j) for j, b in enumerate(layout.reg) if b is not None and len(b) == 2
                    and b[0] == axis and b[1] > max(layout._lane_steps(axis), default=-1)]
            if not lane_bits or not free:
                break
            step = (min(free)[1], lane_bits[0])
            trial = layout.exchanged(*step)
            along = sorted(trial._lane_steps(axis))
            if along != list(range(len(run_digits) + 1, len(run_digits) + 1 + len(along))):
                break           # the lanes' elements would no longer adjoin
            steps.append(step)
            layout = trial
        run_digits = layout._run_digits(axis)
        return steps, run_digits + [j for j in range(len(layout.reg)) if j not in run_digits]

    def warp_span(self, axis: int) -> int:
        """How many consecutive elements along `axis`, from a run's start,
        one access of a warp's lanes covers (a run and the lanes stepping
        just past it): for a store, the bytes of a row that one instruction
        writes together."""
        steps = set(self._lane_steps(axis))
        n = len(self._run_digits(axis))
        while n in steps:
            n += 1
        return 1 << n

    def _lane_steps(self, axis: int) -> list[int]:
        """log2 of the step of each lane bit along `axis`."""
        return [b[1] for b in self.lane if b is not None and b[0] == axis]

    def _run_digits(self, axis: int) -> list[int]:
        """The register digits stepping 1, 2, 4... along `axis`, in that order,
        as far as they go."""
        where = {b: j for j, b in enumerate(self.reg) if b is not None and len(b) == 2}
        digits = []
        while (axis, len(digits)) in where:
            digits.append(where[(axis, len(digits))])
        return digits

    # ---- text form, used as the layout parameter of !tk.rv

    def encode(self) -> str:
        assert len(self.shape) == 1, "only vector layouts are spelled out"
        def enc(bases):
            return ",".join("x" if b is None else str(1 << b[1]) +
                            (f"*{b[2]}" if len(b) == 3 else "") for b in bases)
        return f"r[{enc(self.reg)}]l[{enc(self.lane)}]w[{enc(self.warp)}]"


@functools.lru_cache(maxsize=1024)
def decode(text: str, length: int) -> Layout:
    m = re.fullmatch(r"r\[(.*)\]l\[(.*)\]w\[(.*)\]", text)
    if not m:
        raise LayoutError(f"not a vector layout: {text!r}")
    def basis(x: str) -> Basis:
        if x == "x":
            return None
        step, _, count = x.partition("*")
        return (0, int(step).bit_length() - 1, *((int(count),) if count else ()))
    def dec(s):
        return tuple(basis(x) for x in s.split(",") if x)
    return Layout((length,), *(dec(g) for g in m.groups()))


# ------------------------------------------------------------ constructors

def _log2(n: int, what: str) -> int:
    if n <= 0 or n & (n - 1):
        raise LayoutError(f"{what} must be a power of two, got {n}")
    return n.bit_length() - 1


def _warp_bits(num_warps: int) -> int:
    """log2 of a tile's warps; a count that is not a power of two (a
    block-scope tile in a kernel of 6 or 12 warps) is refused with the fix."""
    if num_warps > 0 and num_warps & (num_warps - 1):
        raise LayoutError(f"warps must be a power of two, got {num_warps}: a tile spreads over "
                          f"a power of two of warps; in a kernel of {num_warps} warps give it "
                          f"scope=\"warpgroup\" (4 warps) or scope=\"warp\"")
    return _log2(num_warps, "warps")


def split(n: int, what: str) -> tuple[int, int]:
    """n = m·2^k with m odd, as (k, m): a side's bits and its repeat count.
    A side is a power of two or a multiple of 16 (wgmma's and ldmatrix's
    granule; the layouts below may ask for more)."""
    if n <= 0 or (n & (n - 1) and n % 16):
        fix = "" if n <= 0 else (
            f"; use {min(1 << n.bit_length(), -(-n // 16) * 16)}: past a tensor's edge a tile "
            f"is masked (tk.load reads fill=, tk.store skips), so a larger tile covers {n} "
            f"exactly")
        raise LayoutError(f"{what} must be a power of two or a multiple of 16, got {n}{fix}")
    k = (n & -n).bit_length() - 1
    return k, n >> k


def _repeat(axis: int, k: int, m: int) -> tuple[Basis, ...]:
    return ((axis, k, m),) if m > 1 else ()


def _fill(bits_needed: dict[int, int], next_bit: dict[int, int], count: int,
          order: tuple[int, ...]) -> tuple[Basis, ...]:
    """Assign `count` hardware bits to the axes in `order` while they still
    have unassigned element bits; what is left over replicates."""
    out: list[Basis] = []
    for _ in range(count):
        for axis in order:
            if next_bit[axis] < bits_needed[axis]:
                out.append((axis, next_bit[axis]))
                next_bit[axis] += 1
                break
        else:
            out.append(None)
    return tuple(out)


def _registers(low: tuple[Basis, ...], need: dict[int, int], nxt: dict[int, int],
               repeats: dict[int, int]) -> tuple[Basis, ...]:
    """The register digits after `low`: the column bits left, the column
    repeat, the row bits left, the row repeat (columns first: consecutive
    registers along a row make vector accesses and wgmma's fragment order)."""
    reg = low
    for axis in (1, 0):
        reg += _fill(need, nxt, need[axis] - nxt[axis], (axis,))
        reg += _repeat(axis, need[axis], repeats[axis])
    return reg


def vec(rows: int, cols: int, num_warps: int) -> Layout:
    (rb, rm), (cb, cm) = split(rows, "rows"), split(cols, "cols")
    wb = _warp_bits(num_warps)
    if cols < VEC_RUN or cb < 3:
        raise LayoutError(f"a vec tile needs a multiple of {VEC_RUN} columns, got {cols}")
    run = _vec_run_bits(rb, cb, wb)
    need, nxt = {0: rb, 1: cb}, {0: 0, 1: run}
    lane = _fill(need, nxt, 5, (1, 0))
    warp = _fill(need, nxt, wb, (0, 1))
    reg = _registers(tuple((1, i) for i in range(run)), need, nxt, {0: rm, 1: cm})
    return Layout((rows, cols), reg, lane, warp)


def _vec_run_bits(rb: int, cb: int, wb: int) -> int:
    """log2 of a vec thread's run along a row, for a tile of 2^rb x 2^cb
    elements in its power-of-two part over 2^wb warps: VEC_RUN, but where the
    lanes and warps would hold copies, each bit taken off the run goes to a
    thread instead (a (48, 80) tile over 4 warps: 8 element bits for 10
    thread bits; each copy holds every repeat: 120 registers a thread at a
    run of 8, 30 at 2), as long as the warps stay on rows: a row's sum
    stays within a warp (no exchange through shared memory). The run depends
    on the power-of-two part alone: a slice along a repeat ((16, 16) of
    (16, 80)) keeps its parent's lanes and warps. It stays at least 2 (column
    pairs: 32-bit registers of 16-bit elements, swap_pairs). One-row tiles
    and vectors (rb = 0; a side of 16·m has rb >= 4) keep runs of 8: 16-byte
    accesses of the norms' rows, one default layout for a vector whatever
    its length."""
    run = VEC_RUN.bit_length() - 1
    if rb == 0:
        return run
    while run > 1 and 5 + wb + run > rb + cb and not _warps_on_columns(rb, cb, wb, run - 1):
        run -= 1
    return run


def _warps_on_columns(rb: int, cb: int, wb: int, run: int) -> bool:
    """Whether vec's warps would step along columns at this run (lanes take
    the columns past the run first, then rows; warps rows, then columns)."""
    lane_cols = min(5, cb - run)
    warp_rows = min(wb, rb - min(5 - lane_cols, rb))
    return wb > warp_rows and cb - run - lane_cols > 0


def mma_row(rows: int, cols: int, num_warps: int) -> Layout:
    (rb, rm), (cb, cm) = split(rows, "rows"), split(cols, "cols")
    wb = _warp_bits(num_warps)
    if rb < 4 + wb or cb < 4:
        raise LayoutError(f"a row/col layout tile over {num_warps} warp(s) needs a multiple of "
                          f"{16 * num_warps} rows and of 16 columns, got {rows}x{cols}")
    lane = ((1, 1), (1, 2), (0, 0), (0, 1), (0, 2))
    warp = tuple((0, 4 + i) for i in range(wb))
    need, nxt = {0: rb, 1: cb}, {0: 4 + wb, 1: 4}
    reg = _registers(((1, 0), (0, 3), (1, 3)), need, nxt, {0: rm, 1: cm})
    return Layout((rows, cols), reg, lane, warp)


def tmem(rows: int, cols: int, num_warps: int) -> Layout:
    cb, cm = split(cols, "cols")
    if num_warps != 4 or rows != 128:
        raise LayoutError(f"a tmem layout tile is 128 rows over 4 warps (a warpgroup: warp w "
                          f"reaches tensor-memory lanes 32w..32w+31), got {rows}x{cols} over "
                          f"{num_warps} warp(s)")
    lane = tuple((0, i) for i in range(5))
    reg = tuple((1, i) for i in range(cb)) + _repeat(1, cb, cm)
    return Layout((rows, cols), reg, lane, ((0, 5), (0, 6)))


# The named layout of a tile's transpose holding the same registers (tk.transpose).
TRANSPOSED = {"row": "col", "col": "row"}


def _transpose(layout: Layout) -> Layout:
    def t(b: Basis) -> Basis:
        return None if b is None else (1 - b[0], *b[1:])
    return Layout(layout.shape[::-1], *(tuple(map(t, bs))
                                        for bs in (layout.reg, layout.lane, layout.warp)))


@functools.lru_cache(maxsize=1024)
def tile_layout(name: str, rows: int, cols: int, num_warps: int) -> Layout:
    if name == "vec":
        return vec(rows, cols, num_warps)
    if name == "row":
        return mma_row(rows, cols, num_warps)
    if name == "tmem":
        return tmem(rows, cols, num_warps)
    if name == "col":
        split(rows, "rows"), split(cols, "cols")
        try:
            return _transpose(mma_row(cols, rows, num_warps))
        except LayoutError:
            raise LayoutError(f"a col layout tile over {num_warps} warp(s) needs a multiple of "
                              f"16 rows and of {16 * num_warps} columns, got {rows}x{cols}") from None
    raise LayoutError(f"unknown tile layout {name!r} (expected vec, row, col or tmem)")


def layout_of(t, num_warps: int) -> Layout:
    """The layout of a register tile or vector type (dialects/types.py)."""
    from . import types as T
    warps = T.scope_warps(t.scope, num_warps)
    if isinstance(t, T.RT):
        return tile_layout(t.layout, t.rows, t.cols, warps)
    return decode(t.layout, t.length)


def default_vector_layout(length: int, num_warps: int) -> Layout:
    """A vector used on its own (no tile to match): the columns of a 1-row vec tile."""
    return vec(1, max(length, VEC_RUN), num_warps).slice(1)
