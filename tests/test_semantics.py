"""What a kernel's Python means, by the frontend's and the verifier's rules:
each rule is either compiled right, checked in the tk IR or the PTX here (on
the GPU in test_runtime_gpu.py), or refused at the user's line rather than
compiled wrong.

Compiled: constants assigned under a run-time if are yielded from it, a
bool in arithmetic counts as one (not as -1), True and 1 are different
constexprs, a block barrier under a uniform if. Refused: a tuple carried by
a loop, vectors shorter than a thread's run, a vector of another scope
applied to a tile, a block barrier under a thread-dependent if, a tile
beyond the register file, a load from a shared tile that would ignore its
coordinates and shape."""
import pytest
import torch

import tk_mlir as tk
from tk_mlir import f32

S = tk.spec
T64 = (S((16, 64), "f32"), S((16, 64), "f32"))


def _refused(kernel, args, match, **const):
    with pytest.raises(tk.CompilationError, match=match) as e:
        kernel.compile(*args, **const)
    assert e.value.filename.endswith("test_semantics.py") and e.value.line
    return e.value


@tk.kernel(num_warps=4)
def if_constants(X: tk.gl[f32], Y: tk.gl[f32]):
    s = 1.0
    if tk.block_id(0) > 0:
        s = 2.0
    else:
        s = 3.0
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * s, (0, 0))


def test_constants_assigned_under_a_runtime_if_are_yielded():
    tk_ir = if_constants.compile(*T64).asm["tk"]
    assert "scf.if" in tk_ir and "-> (f32)" in tk_ir
    assert "2.000000e+00" in tk_ir and "3.000000e+00" in tk_ir


@tk.kernel(num_warps=4)
def loop_tuple(X: tk.gl[f32], Y: tk.gl[f32]):
    acc = (tk.zeros((16, 64)), tk.zeros((16, 64)))
    for j in range(4):
        acc = (acc[0] + tk.load(X, (0, 0), (16, 64)), acc[1])
    tk.store(Y, acc[0], (0, 0))


def test_a_tuple_cannot_be_loop_carried():
    _refused(loop_tuple, T64, "only tiles, vectors and numbers can be carried")


@tk.kernel(num_warps=4)
def short_vector(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (1,), (4,)), (0,))


def test_vectors_shorter_than_a_thread_run_are_refused():
    _refused(short_vector, (S((16,), "f32"), S((16,), "f32")), "at least 8")


@tk.kernel(num_warps=4)
def mixed_scopes(X: tk.gl[f32], W: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (1, 1024))
    tk.store(Y, x.mul_col(tk.load(W, (0,), (1024,), scope="warp")), (0, 0))


def test_a_vector_of_another_scope_is_refused():
    _refused(mixed_scopes, (S((1, 1024), "f32"), S((1024,), "f32"), S((1, 1024), "f32")),
             "warp-scope vector cannot be applied to a block-scope tile")


@tk.kernel(num_warps=4)
def divergent_barrier(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (1, 1024))
    if tk.warp_id() == 0:
        tk.store(Y, x.sub_row(x.row_sum()), (0, 0))


@tk.kernel(num_warps=4)
def uniform_barrier(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (1, 1024))
    if tk.block_id(0) == 0:
        tk.store(Y, x.sub_row(x.row_sum()), (0, 0))


def test_block_barrier_under_thread_dependent_if_is_refused():
    args = (S((1, 1024), "f32"), S((1, 1024), "f32"))
    _refused(divergent_barrier, args, "depends on the thread, lane or warp id")
    assert "bar.sync" in uniform_barrier.compile(*args).asm["ptx"]


@tk.kernel(num_warps=1)
def huge_tile(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (64, 1024)), (0, 0))


@tk.kernel(num_warps=1)
def wide_tile(X: tk.gl, Y: tk.gl, ROWS: tk.constexpr = 16, COLS: tk.constexpr = 512,
              LAYOUT: tk.constexpr = "vec"):
    tk.store(Y, tk.load(X, (0, 0), (ROWS, COLS), layout=LAYOUT), (0, 0))


def test_a_tile_beyond_the_register_file_is_refused():
    _refused(huge_tile, (S((64, 1024), "f32"), S((64, 1024), "f32")), "registers per thread")
    # 16-bit elements pack two to a register: 2048 a thread need 1024
    _refused(wide_tile, (S((64, 1024), "bf16"), S((64, 1024), "bf16")),
             "bf16 64x1024 tile .* needs 1024 registers per thread", ROWS=64, COLS=1024)


def test_a_16_bit_tile_counts_its_registers_packed():
    """256 bf16 elements a thread (a 16x512 tile over one warp) fit in 128
    registers in the row and vec layouts: compiled (counted one to a register
    they were refused)."""
    for layout in ("vec", "row"):
        c = wide_tile.compile(S((16, 512), "bf16"), S((16, 512), "bf16"), LAYOUT=layout)
        assert c.info["spill stores (bytes)"] == 0, layout
    # col's elements sit a column apart, one to a register (it would spill)
    _refused(wide_tile, (S((16, 512), "bf16"), S((16, 512), "bf16")),
             "needs 256 registers per thread", LAYOUT="col")


@tk.kernel(num_warps=4)
def shared_subtile(X: tk.gl[f32], Y: tk.gl[f32]):
    s = tk.shared_tile(f32, (64, 32))
    tk.copy(s, X, (0, 0))
    tk.store(Y, tk.load(s, (1, 0), (16, 32)), (0, 0))


def test_shared_tile_load_does_not_ignore_its_arguments():
    _refused(shared_subtile, (S((64, 32), "f32"), S((64, 32), "f32")), "reads the whole tile")


@tk.kernel(num_warps=4)
def bool_arith(X: tk.gl[f32], Y: tk.gl[f32]):
    flag = tk.block_id(0) > 0
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * float(flag + 1), (0, 0))


def test_bool_in_arithmetic_counts_as_one():
    ir_text = bool_arith.compile(*T64).asm["tk"]
    assert "arith.extui" in ir_text      # i1 -> 0/1, where sitofp would give True = -1.0


@tk.kernel(num_warps=4)
def flag_kernel(X: tk.gl[f32], Y: tk.gl[f32], F: tk.constexpr):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * (2.0 if F else 1.0), (0, 0))


def test_true_and_one_are_different_constexprs():
    assert flag_kernel.compile(*T64, F=True) is not flag_kernel.compile(*T64, F=1)



@tk.kernel(num_warps=4)
def chained(X: tk.gl[f32], Y: tk.gl[f32], a: int, b: int, LO: tk.constexpr = 0):
    x = tk.load(X, (0, 0), (16, 64))
    if LO < a <= b < 10:                      # run-time: (LO < a) and (a <= b) and (b < 10)
        x = x * 2.0
    if 0 <= LO < 1 < 2:                       # compile time
        x = x + 1.0
    tk.store(Y, x, (0, 0))


@tk.kernel(num_warps=4)
def short_circuit(X: tk.gl[f32], Y: tk.gl[f32], n: int, K: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 64))
    if 0 < K <= n:                            # K = 0: false at compile time, the rest unread
        tk.store(Y, tk.load(X, (0, 0), (16, K)), (0, 0))
    if K > 0 and n >= K:                      # likewise
        tk.store(Y, tk.load(X, (0, 0), (16, K)), (0, 0))
    if K == 0 or n > 0:                       # K = 0: true at compile time
        x = x * 2.0
    tk.store(Y, x, (0, 0))


@tk.kernel(num_warps=4)
def chained_tiles(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, tk.where(0.0 < x < 1.0, x, 0.0), (0, 0))


def test_chained_comparisons_mean_what_python_means():
    g = torch.Generator().manual_seed(5)
    x = torch.rand(16, 64, generator=g) + 0.5
    for a, b, lo in ((1, 2, 0), (0, 2, 0), (3, 2, 0), (2, 10, 0), (2, 9, 0), (1, 5, 1),
                     (2, 5, 1)):
        y = torch.full((16, 64), float("nan"))
        chained.interpret[(1,)](x, y, a, b, LO=lo)
        want = x * (2.0 if lo < a <= b < 10 else 1.0) + (1.0 if 0 <= lo < 1 < 2 else 0.0)
        assert torch.equal(y, want), (a, b, lo)
    _refused(chained_tiles, T64, r"chained comparison of tiles.*\(a < b\) & \(b < c\)")
    y = torch.full((16, 64), float("nan"))
    short_circuit.interpret[(1,)](x, y, 5, K=0)      # (a (16, 0) tile would be refused)
    assert torch.equal(y, x * 2.0)


@tk.kernel(num_warps=1)
def starred(X: tk.gl[f32], Y: tk.gl[f32], SH: tk.constexpr = (2, 3, 4)):
    *outer, M, N = X.shape
    first, *rest = SH
    at = (*[0 for _ in outer], 0, 0)
    tk.store(Y, tk.load(X, at, (16, 16), scope="warp") * (first + len(rest) + len(outer)), at)


@tk.kernel(num_warps=1)
def unpacked_short(X: tk.gl[f32]):
    a, b, c, *rest = X.shape


def test_a_starred_name_takes_the_rest_as_python_does():
    x = torch.randn(3, 16, 16)
    y = torch.full((3, 16, 16), float("nan"))
    starred.interpret[(1,)](x, y)
    assert torch.equal(y[0], x[0] * 5.0) and y[1:].isnan().all()
    _refused(unpacked_short, (S((4, 4), "f32"),), r"cannot unpack \(.*\) into 3 or more names")


@tk.kernel(num_warps=4)
def running_max(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    best = tk.full((16,), float("-inf"))          # no layout yet: the reductions' it takes
    for j in range(n):
        mx = tk.load(X, (0, j), (16, 64)).row_max()
        best = tk.where(mx > best, mx, best)
    tk.store(Y, best, (0,))


@tk.kernel(num_warps=4)
def branch_sum(X: tk.gl[f32], Y: tk.gl[f32], flag: int):
    s = tk.zeros((64,))
    if flag > 0:
        s = tk.load(X, (0, 0), (16, 64)).col_sum()
    tk.store(Y, s, (0,))


def test_a_vector_made_before_a_loop_or_if_takes_the_layout_it_meets():
    """tk.full / tk.zeros vectors have no layout until their uses give one: a
    loop or an if that reassigns them from a reduction carries that layout."""
    x = torch.randn(16, 200)
    y = torch.full((16,), float("nan"))
    running_max.interpret[(1,)](x, y, 4)
    assert torch.equal(y, x.max(1).values)
    y = torch.full((64,), float("nan"))
    for flag, want in ((1, x[:, :64].sum(0)), (0, torch.zeros(64))):
        branch_sum.interpret[(1,)](x, y, flag)
        assert torch.allclose(y, want, atol=1e-5)
    assert "scf.for" in running_max.compile(S((16, 200), "f32"), S((16,), "f32"), 4).asm["tk"]


@tk.kernel(num_warps=4)
def shared_zeros_two_layouts(X: tk.gl[f32], Y: tk.gl[f32], flag: int):
    a = tk.zeros((64,))
    b = a
    if flag > 0:
        t = tk.load(X, (0, 0), (64, 64))
        a = t.row_sum()
        b = t.col_sum()
    tk.store(Y, a, (0,))


def test_one_vector_two_names_two_layouts_after_an_if_is_refused():
    _refused(shared_zeros_two_layouts, (S((64, 64), "f32"), S((64,), "f32"), 1),
             r"'b' holds one vector in a branch of this if that another name holds too")
