"""tk-lint (passes/lint.py): the ThunderKittens 2.0 pitfalls seen without
running, as tk.TkLintWarning at the user's line (found by its `# E:<name>`
marker). Each rule fires on a small wrong kernel, at the offending op, and
not on the corrected one; the library kernels and the examples give none.
(The whole suite also runs clean with -W error::tk_mlir.TkLintWarning.)"""
import runpy
import warnings
from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from tk_mlir import bf16, f32

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


@pytest.fixture(autouse=True)
def always_compile(monkeypatch):
    """Warnings come with a compile: no cache hit may hide them."""
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")


def lint_warnings(compile_it) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_it()
    return [str(w.message) for w in caught if issubclass(w.category, tk.TkLintWarning)]


def assert_one_at(messages: list[str], marker: str, rule: str) -> str:
    line, _ = markers.marked(HERE, marker)
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{HERE}:{line}:"), messages[0]
    assert f": warning: [{rule}]" in messages[0].splitlines()[0], messages[0]
    return messages[0]


def spec(*shape, dtype=bf16):
    return tk.spec(shape, dtype)


# ------------------------------------------------ TMA and arrivals: one thread

@tk.kernel(num_warps=4)
def k_tma_every_thread(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    s = tk.semaphore()
    if tk.warp_id() == 0:                      # one warp, but all its 32 lanes
        tk.tma.load_async(a, A, (0, 0), s)     # E:tma_every_thread
    tk.wait(s, 0)


@tk.kernel(num_warps=4)
def k_tma_elected(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    s = tk.semaphore()
    if tk.warp_id() == 0 and tk.elect_leader():
        tk.tma.expect(s, a)
        tk.tma.load_async(a, A, (0, 0), s)
    tk.wait(s, 0)


@tk.kernel(num_warps=4)
def k_expect_every_thread(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    s = tk.semaphore()
    tk.tma.expect(s, a)                        # E:expect_every_thread
    if tk.elect_leader("warpgroup"):
        tk.tma.load_async(a, A, (0, 0), s)
    tk.wait(s, 0)


@tk.kernel(num_warps=4)
def k_arrive_every_thread(A: tk.gl[f32]):
    s = tk.semaphore(arrivals=4)
    tk.arrive(s)                               # E:arrive_every_thread
    tk.wait(s, 0)


@tk.kernel(num_warps=4)
def k_arrive_one_per_warp(A: tk.gl[f32]):
    s = tk.semaphore(arrivals=4)
    if tk.lane_id() == 0:
        tk.arrive(s)
    tk.wait(s, 0)


@tk.kernel(num_warps=4)
def k_arrive_every_thread_counted(A: tk.gl[f32]):
    s = tk.semaphore(arrivals=128)             # one arrival per thread: meant
    tk.arrive(s)
    tk.wait(s, 0)


@tk.kernel(num_warps=4)
def k_store_every_thread(C: tk.gl[bf16]):
    c = tk.shared_tile(bf16, (64, 64), swizzle=128)
    tk.store(c, tk.zeros((64, 64), bf16))
    tk.tma.store_async(C, c, (0, 0))           # E:store_every_thread
    tk.tma.store_commit()
    tk.tma.store_wait(0)


def test_tma_load_by_every_lane_warns_at_its_line():
    messages = lint_warnings(lambda: k_tma_every_thread.compile(spec(128, 128)))
    assert "tk.tma.load_async runs on every thread of the warp" in \
        assert_one_at(messages, "tma_every_thread", "elect")


def test_expect_bytes_by_every_thread_warns():
    messages = lint_warnings(lambda: k_expect_every_thread.compile(spec(128, 128)))
    text = assert_one_at(messages, "expect_every_thread", "elect")
    assert "32x the bytes" in text and "tk.tma.expect," in text      # as the kernel spells it


def test_arrivals_by_every_thread_on_a_small_count_warn():
    messages = lint_warnings(lambda: k_arrive_every_thread.compile(spec(64, 64, dtype=f32)))
    assert "expects 4 arrival(s)" in assert_one_at(messages, "arrive_every_thread", "elect")


def test_tma_store_by_every_thread_warns():
    messages = lint_warnings(lambda: k_store_every_thread.compile(spec(128, 128)))
    assert_one_at(messages, "store_every_thread", "elect")


@pytest.mark.parametrize("kernel, args", [
    (k_tma_elected, (spec(128, 128),)),
    (k_arrive_one_per_warp, (spec(64, 64, dtype=f32),)),
    (k_arrive_every_thread_counted, (spec(64, 64, dtype=f32),))])
def test_elected_or_counted_issue_does_not_warn(kernel, args):
    assert lint_warnings(lambda: kernel.compile(*args)) == []


# ------------------------------------------------------------ setmaxnreg

@tk.kernel(num_warps=16)
def k_increase_too_far(A: tk.gl[f32]):
    if tk.warpgroup_id() == 0:
        tk.increase_registers(160)             # E:increase_too_far
    else:
        tk.decrease_registers(120)


@tk.kernel(num_warps=16)
def k_increase_fits(A: tk.gl[f32]):
    if tk.warpgroup_id() == 0:
        tk.increase_registers(160)
    else:
        tk.decrease_registers(96)


@tk.kernel(num_warps=12)
def k_consumers_overcommit(A: tk.gl[f32]):
    if tk.warpgroup_id() == 2:
        tk.decrease_registers(40)
    else:
        tk.increase_registers(240)             # E:consumers_overcommit


@tk.kernel(num_warps=8)
def k_increase_without_decrease(A: tk.gl[f32]):
    if tk.warpgroup_id() == 1:
        tk.increase_registers(256)             # E:increase_without_decrease


@tk.kernel(num_warps=2)
def k_registers_partial_warpgroup(A: tk.gl[f32]):
    tk.decrease_registers(40)                  # E:registers_partial_warpgroup


def test_an_increase_with_no_decrease_warns():
    # 8 warps start with 248 registers per thread (65536 / 256, at most 255,
    # down to a multiple of 8); nothing gives any back: 256 is never met.
    messages = lint_warnings(lambda: k_increase_without_decrease.compile(
        spec(64, 64, dtype=f32)))
    text = assert_one_at(messages, "increase_without_decrease", "setmaxnreg")
    assert "never decrease from 248" in text and "at most 248" in text


def test_an_increase_beyond_what_the_others_free_warns():
    # 16 warps start with 128 each; the other 3 warpgroups keep 120: 4 * 128 - 3 * 120 = 152.
    messages = lint_warnings(lambda: k_increase_too_far.compile(spec(64, 64, dtype=f32)))
    assert "at most 152" in assert_one_at(messages, "increase_too_far", "setmaxnreg")


def test_consumers_that_together_take_more_than_the_block_has_warn():
    """One warpgroup decreases to 40, the other two increase to 240 each:
    each increase alone fits (at most 424), together 2 x 240 + 40 = 520
    exceed 3 x 168 (tk.register_split's rule, now for hand-written splits)."""
    messages = lint_warnings(lambda: k_consumers_overcommit.compile(spec(64, 64, dtype=f32)))
    text = assert_one_at(messages, "consumers_overcommit", "setmaxnreg")
    assert "2 x 240 + 40 registers per thread exceed the block's 3 x 168 = 504" in text


def test_a_split_that_fits_does_not_warn():
    assert lint_warnings(lambda: k_increase_fits.compile(spec(64, 64, dtype=f32))) == []


def test_setmaxnreg_in_a_kernel_of_partial_warpgroups_warns():
    messages = lint_warnings(lambda: k_registers_partial_warpgroup.compile(
        spec(64, 64, dtype=f32)))
    assert "num_warps=2" in assert_one_at(messages, "registers_partial_warpgroup", "setmaxnreg")


# ------------------------------------------------------------- clusters

@tk.kernel(num_warps=4)
def k_cluster_of_whole_sms(A: tk.gl[bf16], CLUSTER: tk.constexpr = 4):
    tk.use_cluster(CLUSTER)                     # E:cluster_of_whole_sms
    tiles = tk.shared_tiles(bf16, (128, 64), 8, swizzle=128)    # 128 KiB: one block per SM
    s = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(s, tiles[0])
        tk.tma.load_async(tiles[0], A, (tk.block_id(0), 0), s)
    tk.wait(s, 0)
    tk.cluster_sync()


def test_cluster_larger_than_two_of_whole_sm_blocks_warns():
    messages = lint_warnings(lambda: k_cluster_of_whole_sms.compile(spec(1024, 64)))
    text = assert_one_at(messages, "cluster_of_whole_sms", "cluster")
    assert "clusters of 4 blocks" in text and "GPC" in text


def test_cluster_of_two_does_not_warn():
    assert lint_warnings(lambda: k_cluster_of_whole_sms.compile(spec(1024, 64), CLUSTER=2)) == []


# -------------------------------------------------------- named barriers

@tk.kernel(num_warps=8)
def k_barrier_counts_differ(A: tk.gl[f32]):
    if tk.warpgroup_id() == 0:
        tk.named_barrier(1, warps=4)
    tk.named_barrier(1, warps=8)                # E:barrier_counts_differ


@tk.kernel(num_warps=8)
def k_barrier_ids_apart(A: tk.gl[f32]):
    if tk.warpgroup_id() == 0:
        tk.named_barrier(2, warps=4)
    tk.named_barrier(1, warps=8)


def test_one_barrier_id_with_two_thread_counts_warns():
    messages = lint_warnings(lambda: k_barrier_counts_differ.compile(spec(64, 64, dtype=f32)))
    text = assert_one_at(messages, "barrier_counts_differ", "named-barrier")
    assert "warps=8 but with warps=4" in text


def test_barrier_ids_kept_apart_do_not_warn():
    assert lint_warnings(lambda: k_barrier_ids_apart.compile(spec(64, 64, dtype=f32))) == []


# ---------------------------------------------------- filters and rendering

def test_warnings_render_like_errors_and_filter_by_category():
    line, source = markers.marked(HERE, "tma_every_thread")
    (text,) = lint_warnings(lambda: k_tma_every_thread.compile(spec(128, 128)))
    first, shown, caret = text.splitlines()
    assert first.startswith(f"{HERE}:{line}:9: warning: [elect]")
    assert shown.strip() == source.strip() and caret.strip() == "^"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=tk.TkLintWarning)
        k_tma_every_thread.compile(spec(128, 128))
    assert not [w for w in caught if issubclass(w.category, tk.TkLintWarning)]
    with warnings.catch_warnings(record=True) as caught:         # one rule, as README says
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=r".*\[elect\]", category=tk.TkLintWarning)
        k_tma_every_thread.compile(spec(128, 128))
        k_barrier_counts_differ.compile(spec(64, 64, dtype=f32))
    assert [str(w.message).split(": warning: ")[1][:15] for w in caught
            if issubclass(w.category, tk.TkLintWarning)] == ["[named-barrier]"]


def test_a_lint_warning_made_an_error_reaches_the_user_as_itself():
    with warnings.catch_warnings():
        warnings.simplefilter("error", tk.TkLintWarning)
        with pytest.raises(tk.TkLintWarning, match=r"\[elect\]"):
            k_tma_every_thread.compile(spec(128, 128))


# ------------------------------------------- the library and the examples

def test_library_kernels_give_no_lint_warning():
    from tk_mlir.kernels import flash_attention, gemm, norms
    from tk_mlir.kernels.flash_attention import (_backward_config, attention_backward_kernel,
                                                  attention_kernel)
    q, kv, lse = spec(2, 16, 1024, 128), spec(2, 16, 1024, 128), spec(2, 16, 1024, dtype=f32)
    compiles = [
        lambda: attention_kernel.compile(q, kv, kv, q, lse, spec(1024, dtype="i32"), 0.125, D=128,
                                           CAUSAL=False),
        lambda: attention_kernel.compile(q, kv, kv, q, lse, spec(1024, dtype="i32"), 0.125, D=128,
                                           CAUSAL=True),
        lambda: attention_backward_kernel.compile(
            spec(2, 8, 1000, 64), spec(2, 2, 777, 64), spec(2, 2, 777, 64), spec(2, 8, 1000, 64),
            spec(2, 8, 1000, dtype=f32), spec(2, 8, 1000, dtype=f32),
            spec(2, 8, 1000, 64, dtype=f32), spec(2, 2, 777, 64), spec(2, 2, 777, 64),
            spec(1024, dtype="i32"), 0.1, 0.1, D=64, CAUSAL=True, **_backward_config(64)),
    ]
    for cluster in (1, 2):
        compiles.append(lambda cluster=cluster: gemm.gemm_kernel.kernel.compile(
            spec(512, 256), spec(512, 256), spec(512, 512), CLUSTER=cluster))
    del flash_attention, norms
    for compile_it in compiles:
        assert lint_warnings(compile_it) == []


EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_give_no_lint_warning(example, capsys):
    from tk_mlir.runtime.driver import has_gpu
    if has_gpu():
        pytest.skip("a GPU is present: the examples run whole in test_examples_gpu.py")
    assert lint_warnings(lambda: runpy.run_path(str(ROOT / "examples" / f"{example}.py"),
                                                run_name="__main__")) == []


# ------------------------------------------------- tile operands that vary in their scope

@tk.kernel(num_warps=4)
def k_tile_at_a_per_thread_row(X: tk.gl[f32], IDX: tk.gl["i32"]):
    r = tk.load(IDX, (tk.thread_id(),))        # one row per thread
    t = tk.load(X, (r, 0), (16, 64))          # E:tile_at_a_per_thread_row
    tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=4)
def k_warp_tile_at_its_warps_row(X: tk.gl[f32], IDX: tk.gl["i32"]):
    r = tk.load(IDX, (tk.warp_id(),))          # one row per warp: uniform over a warp
    t = tk.load(X, (r, 0), (16, 64), scope="warp")
    for i in range(tk.thread_id() // 128, 1):  # one value in the block
        tk.store(X, t * 2.0, (r + i, 0))


@tk.kernel(num_warps=8)
def k_warpgroup_tiles_at_rows_uniform_over_it(X: tk.gl[f32]):
    if tk.warp_id() >= 4:                      # an if's result, one value per warpgroup
        row = 1
    else:
        row = 0
    t = tk.load(X, (row + (tk.thread_id() // 128) % 3, 0), (64, 64), scope="warpgroup")
    carried = tk.warp_id() // 4                # carried by a loop, one value per warpgroup
    for k in range(2):
        tk.store(X, t + 1.0, (carried * carried, 0))
        carried = carried + 2


def test_a_tile_coordinate_that_varies_in_its_scope_warns_at_its_line():
    """Each thread would take its part of the tile from its own row: the
    interpreter stops there, the lint says so at compile time."""
    messages = lint_warnings(lambda: k_tile_at_a_per_thread_row.compile(
        spec(2048, 64, dtype=f32), spec(128, dtype="i32")))
    assert "coordinates and scalars must be one value" in assert_one_at(
        messages, "tile_at_a_per_thread_row", "varying-operand")
    assert lint_warnings(lambda: k_warp_tile_at_its_warps_row.compile(
        spec(2048, 64, dtype=f32), spec(128, dtype="i32"))) == []
    assert lint_warnings(lambda: k_warpgroup_tiles_at_rows_uniform_over_it.compile(
        spec(2048, 64, dtype=f32))) == []
    import torch
    from tk_mlir.interpreter import InterpretError
    with warnings.catch_warnings(), pytest.raises(
            InterpretError, match="coordinates and scalars are one value over its block"):
        warnings.simplefilter("ignore", tk.TkLintWarning)     # (its compile warns, above)
        k_tile_at_a_per_thread_row.interpret[(1,)](torch.rand(2048, 64),
                                                   torch.arange(128, dtype=torch.int32))


# ------------------------------------------------- tiles reached by part of their scope

@tk.kernel(num_warps=8)
def k_block_tile_in_one_warpgroup(X: tk.gl[f32]):
    if tk.warpgroup_id() == 0:
        t = tk.load(X, (0, 0), (64, 64))      # E:block_tile_in_one_warpgroup
        tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=4)
def k_warp_tile_in_half_its_lanes(X: tk.gl[f32]):
    t = tk.load(X, (0, 0), (16, 64), scope="warp")
    if tk.lane_id() < 16:
        tk.store(X, t + 1.0, (0, 0))          # E:warp_tile_in_half_its_lanes


@tk.kernel(num_warps=8)
def k_warpgroup_tile_by_one_thread(X: tk.gl[f32]):
    if tk.elect_leader("warpgroup"):
        t = tk.load(X, (0, 0), (64, 64), scope="warpgroup")   # E:warpgroup_tile_by_one_thread
        tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=8)
def k_warpgroup_tile_in_its_warpgroup(X: tk.gl[f32]):
    if tk.warp_id() >= 4:                     # uniform over each warpgroup
        t = tk.load(X, (0, 0), (64, 64), scope="warpgroup")
        tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=2)
def k_block_tile_in_the_only_warpgroup(X: tk.gl[f32]):
    if tk.warpgroup_id() == 0:                # the block is one (partial) warpgroup
        t = tk.load(X, (0, 0), (32, 64))
        tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=4)
def k_warp_tile_in_one_warp(X: tk.gl[f32]):
    if tk.warp_id() == 1:
        t = tk.load(X, (0, 0), (16, 64), scope="warp")
        tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=4)
def k_warp_tile_by_divided_thread_id(X: tk.gl[f32]):
    w = tk.thread_id() // 32                  # one value per warp
    if w == 1:
        t = tk.load(X, (w, 0), (16, 64), scope="warp")
        tk.store(X, t + 1.0, (w, 0))
    for i in range(tk.warp_id() // 4, 1):     # 0 in every warp of this block
        t = tk.load(X, (i, 0), (64, 64))
        tk.store(X, t + 1.0, (i, 0))
    if tk.thread_id() < 128:                  # every thread of this block
        t = tk.load(X, (0, 0), (64, 64))
        tk.store(X, t + 1.0, (0, 0))


@tk.kernel(num_warps=4)
def k_block_tile_in_half_the_block(X: tk.gl[f32]):
    if tk.thread_id() < 64:                   # warps 0 and 1 only
        t = tk.load(X, (0, 0), (64, 64))      # E:block_tile_in_half_the_block
        tk.store(X, t + 1.0, (0, 0))


@pytest.mark.parametrize("kernel,marker", [
    (k_block_tile_in_half_the_block, "block_tile_in_half_the_block"),
    (k_block_tile_in_one_warpgroup, "block_tile_in_one_warpgroup"),
    (k_warp_tile_in_half_its_lanes, "warp_tile_in_half_its_lanes"),
    (k_warpgroup_tile_by_one_thread, "warpgroup_tile_by_one_thread")])
def test_a_tile_op_some_threads_of_its_scope_skip_warns_once_at_its_line(kernel, marker):
    """Each thread holds a part of the tile: the interpreter reports the
    partial tile at run time, the lint at compile time (once per if)."""
    messages = lint_warnings(lambda: kernel.compile(spec(64, 64, dtype=f32)))
    assert "leave their part undone" in assert_one_at(messages, marker, "partial-tile")


@pytest.mark.parametrize("kernel", [k_warpgroup_tile_in_its_warpgroup,
                                    k_block_tile_in_the_only_warpgroup, k_warp_tile_in_one_warp,
                                    k_warp_tile_by_divided_thread_id])
def test_a_tile_op_under_a_condition_uniform_over_its_scope_does_not_warn(kernel):
    assert lint_warnings(lambda: kernel.compile(spec(64, 64, dtype=f32))) == []
