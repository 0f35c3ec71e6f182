"""Kernel templates, written in the kernel language itself (tk.func).

`lcf` is ThunderKittens' load-compute-finish pattern for Hopper: a producer
warpgroup streams input tiles into a ring of shared-memory stages with TMA,
consumer warpgroups compute on each stage with wgmma as soon as it lands and
hand it back, and a persistent grid walks the output tiles. The kernel
supplies four small callbacks (functions defined in the kernel body):

    load(task, k, *stage, sem)     issue the TMA loads of iteration k of a task
                                   (one elected producer thread runs it)
    setup(task, consumer)          the consumer's state for a task (an accumulator)
    compute(state, consumer, *stage) -> state   (issue the MMAs on one stage)
    finish(state, task, consumer)  write the task's result

and gets the pipeline: semaphores and their phases, warp specialization with
register reallocation, the release of each stage once the MMA reading it is
known complete, and the persistent task loop (task = block, block + grid, ...).
"""
from __future__ import annotations

import tk_mlir as tk

from .language import func


@func
def grouped_tile(task, tiles_m, tiles_n, group):
    """(m, n) of output tile `task`, numbered down columns of `group` tile
    rows at a time: tasks that run together share rows of A and columns of B,
    which then stay in L2."""
    width = group * tiles_n
    first_m = (task // width) * group
    rows = min(tiles_m - first_m, group)
    m = first_m + (task % width) % rows
    n = (task % width) // rows
    return m, n


@func
def store_in_pieces(dst, tile, row, col, cols, consumer, staging=None, buffers=1, piece=None,
                    outer=(), add=False):
    """Store a consumer warpgroup's f32 register tile into dst at tile
    coordinates (*outer, row, col) of `cols`-wide pieces, one piece at a time: the
    slice, through `piece(part, h)` when given (e.g. scales), converted to
    dst's dtype. With `staging`, shared tiles of (tile rows, cols) with
    `buffers` per consumer warpgroup (consumer * buffers + i), a piece leaves
    by TMA store; one thread, elected once, issues every store and waits for
    it (TMA bulk groups are per thread), and with 2 buffers a piece is
    written while the last one's store still reads; add=True adds it into dst
    (TMA reduce-add) instead. Without staging, from registers."""
    tile_cols = tile.shape[1]
    assert staging is not None or not add, "add=True adds by TMA: it needs staging tiles"
    pieces = tile_cols // cols
    assert pieces * cols == tile_cols, f"cols={cols} must divide the tile's {tile_cols} columns"
    if staging is not None:
        leader = tk.elect_leader("warpgroup")
    for h in tk.static_range(pieces):
        part = tile.slice(cols=(h * cols, cols))
        if piece is not None:
            part = piece(part, h)
        out = part.to(dst.dtype)
        if staging is None:
            tk.store(dst, out, (*outer, row, col + h))
        else:
            buf = staging[consumer * buffers + h % buffers]
            # The store that last read buf is done. Every thread waits for its
            # own stores: at a tile's first piece all of them (the last tile's
            # may have had another elected thread), then all but buffers - 1.
            tk.tma.store_wait(0 if h == 0 else buffers - 1)
            tk.named_barrier(1 + consumer, warps=4)
            tk.store(buf, out)
            tk.named_barrier(1 + consumer, warps=4)  # all of it written
            if leader:
                if add:
                    tk.tma.reduce_add_async(dst, buf, (*outer, row, col + h))
                else:
                    tk.tma.store_async(dst, buf, (*outer, row, col + h))
                tk.tma.store_commit()


@func
def _check_sliced(consumers, stages, pingpong, prepare):
    """lcf(sliced=True)'s rules, each with its reason."""
    assert consumers >= 2, \
        f"lcf(sliced=True) shares a task's iterations among consumer warpgroups: consumers " \
        f">= 2, got {consumers}"
    assert not pingpong, \
        "lcf(sliced=True) and pingpong=True are two schedules (consumers taking a task's " \
        "iterations in turn, or whole tasks in turn): pick one"
    assert prepare is None, \
        "lcf(sliced=True) takes no prepare= (it fixes a task's first and last stages, which " \
        "belong to different consumers here)"
    assert stages % consumers == 0 and stages >= 2 * consumers, \
        f"lcf(sliced=True) needs stages a multiple of the consumers (a stage always goes to " \
        f"the same one) and at least two stages per consumer (one hands a stage back once its " \
        f"next is issued): stages={stages} with consumers={consumers}; try " \
        f"{_sliced_stages_hint(stages, consumers)}"


def _sliced_stages_hint(stages, consumers):
    """The valid stage counts nearest `stages` for lcf(sliced=True): the
    multiple of the consumers below it first (more stages may not fit in
    shared memory), else the smallest allowed."""
    below, lowest = stages // consumers * consumers, 2 * consumers
    if below >= lowest:
        return f"{below} (or {below + consumers} if shared memory holds it)"
    return f"{lowest}"


@func
def register_split(consumers, consumer_registers, producer_registers):
    """Check that `consumers` warpgroups at consumer_registers per thread and
    one producer at producer_registers fit the registers the block starts
    with: setmaxnreg only moves registers between warpgroups, and an increase
    that cannot be met waits forever."""
    have = (consumers + 1) * tk.registers_per_thread()
    assert consumers * consumer_registers + producer_registers <= have, \
        f"{consumers} x {consumer_registers} + {producer_registers} registers per thread exceed " \
        f"the block's {have} (setmaxnreg would wait forever): give fewer (the consumer and " \
        f"producer counts of this split, or tk.lcf's consumer_registers= and " \
        f"producer_registers=; multiples of 8 from 24 to 256)"


@func
def lcf(tasks, iters, inputs, load, setup, compute, finish, stages=4, consumers=2,
        producer_registers=40, consumer_registers=232, cluster=1, plan=None, active=None,
        task_iters=None, prepare=None, pingpong=False, shared_stages=True, sliced=False):
    """Run `tasks` tasks of `iters` pipelined iterations each on a persistent
    grid (launch one block per SM), or task_iters(task) iterations each when
    that is given (read by the producer and the consumers; a task of none
    loads nothing, its result is set up and finished as it is). `inputs`
    lists each stage's shared tiles as (dtype, (rows, cols), swizzle). The
    kernel has consumers + 1 warpgroups: warpgroups 0 .. consumers-1
    compute, the last one loads.

    cluster=n runs the blocks in clusters of n that take each task together
    (`load` may multicast a shared input to all of them with tk.tma.load_async
    (..., multicast=)): a stage is handed back to the producers only when the
    consumers of every block of the cluster are done with it. With
    shared_stages=False each block's stages are its own (nothing is
    multicast: the cluster only groups the blocks that take a task, e.g.
    split-K's slices), handed back to its own producer.

    plan(task), when given, runs once per task in the producer, and `load`
    gets what it returns in place of the task (work shared by a task's
    loads, e.g. finding a grouped product's tile, not redone per stage).
    active(task), when given, says whether a task has work: the producer
    and the consumers both skip one that has none (no stage is used; its
    result is never set up or finished).
    prepare(where, k, consumer, *stage), when given, runs in each consumer
    in a task's first and last iterations, once their stage has landed and
    the MMAs before are done, before compute (`where` as `load` gets it,
    plan(task) found once per task in the consumers too): it may rewrite the
    consumer's own part of the stage (zero rows that are not the task's,
    say), synchronising its warpgroup before the MMAs read it.

    pingpong=True (CUTLASS's ping-pong schedule): each consumer takes whole
    tasks in turn (the block's active tasks 0, 2, 4, ... the first of two,
    1, 3, 5, ... the second), so one's epilogue (`finish`) runs while the
    next one's MMAs do. `setup`, `compute` and `finish` then work on the
    whole task's tile in one warpgroup (M = 64·m per warpgroup). The main
    loops take turns (named barriers 15 - consumer, 8 warps): a consumer
    waits for a stage only once the one before it has waited for all of its
    own, so each stage it waits for is at most one phase behind (a parity
    cannot tell phases two apart; the interpreter reports that).

    sliced=True (CUTLASS 2's sliced-K): the consumers take each task's
    iterations in turn, consumer c those at ring positions c, c + consumers,
    ... (stages a multiple of consumers, so a stage always goes to one
    consumer, which never waits for a phase of it without having seen the
    one before; two stages at least for each, as a consumer hands a stage
    back once its next one's MMAs are issued). Each ends the task with a
    partial result: `finish` runs in every consumer, and summing them is the
    kernel's (gemm's SLICED_K)."""
    if sliced:
        _check_sliced(consumers, stages, pingpong, prepare)
    assert tk.num_warps() == 4 * (consumers + 1), \
        f"lcf with {consumers} consumer warpgroups needs num_warps={4 * (consumers + 1)} " \
        f"(one more warpgroup loads), the kernel has {tk.num_warps()}"
    assert consumers >= 2 or not pingpong, \
        f"lcf(pingpong=True) takes turns between consumer warpgroups: consumers >= 2, got " \
        f"{consumers}"
    assert stages >= 2, \
        f"lcf needs stages >= 2 (one stage loads while the consumers compute on another; " \
        f"with one the producer and the consumers wait for each other), got {stages}"
    register_split(consumers, consumer_registers, producer_registers)
    tk.use_cluster(cluster)
    ring = [tk.shared_tiles(dtype, shape, stages, swizzle=swizzle)
            for dtype, shape, swizzle in inputs]
    full = tk.semaphores(stages)                       # the producer's expect_bytes
    # Each stage is released by every consumer (by its one: pingpong, sliced) of each block.
    sharing = cluster if shared_stages else 1          # the blocks a stage goes back to
    empty = tk.semaphores(stages, arrivals=(1 if pingpong or sliced else consumers) * sharing)
    first_task, task_step = tk.block_id(0) // cluster, tk.grid_dim(0) // cluster
    if tk.warpgroup_id() == consumers:
        tk.decrease_registers(producer_registers)
        if tk.elect_leader("warpgroup"):
            it = 0
            for task in range(first_task, tasks, task_step):
                if True if active is None else active(task):
                    where = task if plan is None else plan(task)
                    for k in range(iters if task_iters is None else task_iters(task)):
                        s = it % stages
                        # A fresh semaphore passes a wait for parity 1: the first
                        # `stages` iterations find their stage free.
                        tk.wait(empty[s], tk.ring_phase(it, stages) ^ 1)
                        stage = [tiles[s] for tiles in ring]
                        tk.tma.expect(full[s], *stage)
                        load(where, k, *stage, full[s])
                        it += 1
    else:
        tk.increase_registers(consumer_registers)
        consumer = tk.warpgroup_id()
        leader = tk.elect_leader("warpgroup")
        it = 0

        def consume(state, where, k, it, fix):
            """Iteration k of a task at ring position it (fix: after `prepare`)."""
            s = it % stages
            # (By number: a ping-pong consumer skips the other's phases.)
            tk.wait_phase(full[s], it // stages)
            if fix:
                tk.mma_wait(0)
                prepare(where, k, consumer, *[tiles[s] for tiles in ring])
            state = compute(state, consumer, *[tiles[s] for tiles in ring])
            # The MMAs of the previous stage are done once at most this
            # stage's group is in flight: hand that stage back.
            tk.mma_wait(1)
            if k > 0 and leader:
                release(empty[(it + stages - 1) % stages], sharing)
            return state

        def run_task(task, n, it, turn):
            """A task of n iterations from ring position it (pingpong: the
            block's turn-th active task): its result set up, computed and
            finished; returns the position after it."""
            state = setup(task, consumer)
            if pingpong:
                if turn > 0:        # the previous turn's consumer is done waiting
                    tk.named_barrier(15 - consumer, warps=8)
            if prepare is None:
                for k in range(n):
                    state = consume(state, task, k, it, False)
                    it += 1
            else:
                # prepare runs in the first and last iterations only, peeled,
                # with no MMA in flight in them or when they end: a branch in
                # the middle of the MMA pipeline, or an accumulator leaving
                # one in flight, makes ptxas serialize every wgmma (C7514).
                where = task if plan is None else plan(task)
                if n > 0:
                    state = consume(state, where, 0, it, True)
                    tk.mma_wait(0)
                    it += 1
                for k in range(1, n - 1):
                    state = consume(state, where, k, it, False)
                    it += 1
                tk.mma_wait(0)
                if n > 1:
                    state = consume(state, where, n - 1, it, True)
                    tk.mma_wait(0)
                    it += 1
            if pingpong:            # the next consumer's turn (its main loop)
                tk.named_barrier_arrive(15 - (consumer + 1) % consumers, warps=8)
            tk.mma_wait(0)
            if leader:
                if n > 0:           # (a task of no iterations used no stage)
                    release(empty[(it + stages - 1) % stages], sharing)
            finish(state, task, consumer)
            return it

        def run_slices(task, n, it):
            """sliced: this consumer's iterations of a task of n iterations
            from ring position it (those at positions it + k = consumer mod
            consumers), its partial result set up, computed and finished;
            returns the position after the task."""
            state = setup(task, consumer)
            start = (consumer - it) % consumers     # its first iteration of the task
            for k in range(start, n, consumers):
                s = (it + k) % stages
                tk.wait_phase(full[s], (it + k) // stages)
                state = compute(state, consumer, *[tiles[s] for tiles in ring])
                # Its MMAs on its stage before are done: hand that stage back.
                tk.mma_wait(1)
                if k > start and leader:
                    release(empty[(it + k - consumers) % stages], sharing)
            tk.mma_wait(0)
            if leader and start < n:                # its last stage of the task
                release(empty[(it + n - 1 - (n - 1 - start) % consumers) % stages], sharing)
            finish(state, task, consumer)
            return it + n

        turn = 0                    # pingpong: the block's active tasks so far
        for task in range(first_task, tasks, task_step):
            if True if active is None else active(task):
                n = iters if task_iters is None else task_iters(task)
                mine = True
                if pingpong:
                    mine = turn % consumers == consumer
                if sliced:
                    it = run_slices(task, n, it)
                elif mine:
                    it = run_task(task, n, it, turn)
                else:
                    it += n         # (another consumer's stages)
                turn += 1
        if pingpong:
            # The last turn's consumer handed a turn on: taken, so that every
            # arrival on a barrier meets its wait.
            if turn > 0 and turn % consumers == consumer:
                tk.named_barrier(15 - consumer, warps=8)
        # TMA stores `finish` issued must have read their shared tiles before
        # the block exits (a no-op for threads that issued none).
        tk.tma.store_wait(0)
    if sharing > 1:
        # No block may exit while another still arrives on its semaphores.
        tk.cluster_sync()


@func
def release(sem, cluster):
    """Hand a stage back: to this block's producer, or to every producer of
    the cluster (each may multicast into this block's stage)."""
    if cluster == 1:
        tk.arrive(sem)
    else:
        for rank in tk.static_range(cluster):
            tk.arrive(sem, cta=rank)
