"""Distributed shared memory: `tile.in_block(rank)` is a shared tile as it is
in another block of the cluster, which `tk.load` reads and `tk.store` writes
(mapa, ld/st.shared::cluster). Checked here in the interpreter against numpy,
in the PTX and by ptxas; its errors name the line that breaks the rule."""
from __future__ import annotations

import numpy as np
import pytest

import tk_mlir as tk
from tk_mlir import f32, bf16
from tk_mlir.interpreter import InterpretError


@tk.kernel(num_warps=4)
def cluster_sum(X: tk.gl, Y: tk.gl, CLUSTER: tk.constexpr = 2):
    """Split-K's reduction through distributed shared memory: each block of a
    cluster holds one partial 64x64 tile (X's tile b), and block r of the
    cluster sums rows r·64/CLUSTER .. of every block's partial into Y's tile
    of the cluster."""
    tk.use_cluster(CLUSTER)
    b, r = tk.block_id(0), tk.cluster_rank()
    part = tk.shared_tile(X.dtype, (64, 64))
    tk.store(part, tk.load(X, (b, 0), (64, 64)))
    tk.cluster_sync()                       # every partial written before any is read
    mine = part.subtile(r, 64 // CLUSTER)   # this block's rows, in each block
    total = tk.load(mine.in_block(0)).to(f32)
    for k in tk.static_range(1, CLUSTER):
        total = total + tk.load(mine.in_block(k)).to(f32)
    tk.store(Y, total, (b, 0))              # (b = cluster·CLUSTER + r: rows of 64/CLUSTER)
    tk.cluster_sync()                       # no block leaves while another reads its tile


@pytest.mark.parametrize("cluster", [2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, "bf16"])
def test_a_cluster_sums_its_blocks_tiles(cluster, dtype):
    import torch
    clusters = 2
    g = torch.Generator().manual_seed(cluster)
    x = torch.randn(clusters * cluster * 64, 64, generator=g)
    x = x.to(torch.bfloat16) if dtype == "bf16" else x
    y = torch.full((clusters * 64, 64), float("nan"))
    cluster_sum.interpret[(clusters * cluster,)](x, y, CLUSTER=cluster)
    ref = x.double().view(clusters, cluster, 64, 64).sum(1).reshape(-1, 64)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("pushed", [False, True])
@pytest.mark.parametrize("cluster", [2, 4, 8])
def test_a_cluster_sums_its_blocks_tiles_on_the_gpu(cluster, pushed):
    """The same sums on the GPU (ld/st.shared::cluster across barrier.cluster),
    read from the other blocks or pushed to them, against float64; a
    poisoned output."""
    import torch
    clusters = 33                                   # (more clusters than fit at once)
    x = torch.randn(clusters * cluster * 64, 64, device="cuda").to(torch.bfloat16)
    y = torch.full((clusters * 64, 64), float("nan"), device="cuda")
    (cluster_push if pushed else cluster_sum)[(clusters * cluster,)](x, y, CLUSTER=cluster)
    ref = x.double().view(clusters, cluster, 64, 64).sum(1).reshape(-1, 64)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


@tk.kernel(num_warps=4)
def leaves_early(X: tk.gl[f32], Y: tk.gl[f32]):
    """Block 0 tells block 1 to go on and ends; block 1 then reads block 0's
    tile (no tk.cluster_sync() after the reads keeps block 0 running)."""
    tk.use_cluster(2)
    part = tk.shared_tile(f32, (64, 64))
    go = tk.semaphore(1)
    tk.store(part, tk.load(X, (tk.block_id(0), 0), (64, 64)))
    tk.cluster_sync()
    if tk.cluster_rank() == 0:
        if tk.warp_id() == 0:
            if tk.elect_leader():
                tk.arrive(go, cta=1)
    else:
        tk.wait(go, 0)
        tk.store(Y, tk.load(part.in_block(0)), (0, 0))     # MARK: reads an ended block


def test_a_block_that_reads_an_ended_block_is_told_to_sync():
    x = np.ones((128, 64), np.float32)
    with pytest.raises(InterpretError, match=r"this load of another block's tile "
                                             r"\(tile.in_block\) acts on block \(0, 0, 0\) "
                                             r"of the cluster, which has already ended") as e:
        leaves_early.interpret[(2,)](x, np.zeros((64, 64), np.float32))
    assert "MARK: reads an ended block" in open(__file__).read().splitlines()[e.value.line - 1]


def test_the_ptx_reads_another_blocks_shared_memory(ptxas):
    c = cluster_sum.compile(tk.spec((512, 64), bf16), tk.spec((128, 64), f32), CLUSTER=4)
    ptx = c.asm["ptx"]
    assert "mapa.shared::cluster" in ptx and "ld.shared::cluster" in ptx
    assert "ldmatrix" not in ptx.split("mapa.shared::cluster", 1)[1]   # (not for a remote tile)
    assert c.info["spill stores (bytes)"] == 0 and "C75" not in c.ptxas_log


def test_in_block_needs_a_cluster():
    @tk.kernel(num_warps=4)
    def no_cluster(X: tk.gl[f32]):
        part = tk.shared_tile(f32, (64, 64))
        tk.store(X, tk.load(part.in_block(1)), (0, 0))

    with pytest.raises(tk.CompilationError, match=r"tile.in_block\(rank\) needs a cluster: "
                                                  r"call tk.use_cluster\(n\) first"):
        no_cluster.compile(tk.spec((64, 64), f32))


def test_a_rank_past_the_cluster_is_refused():
    @tk.kernel(num_warps=4)
    def past(X: tk.gl[f32]):
        tk.use_cluster(2)
        part = tk.shared_tile(f32, (64, 64))
        tk.store(X, tk.load(part.in_block(2)), (0, 0))

    with pytest.raises(tk.CompilationError, match=r"rank 2 is outside the cluster's blocks "
                                                  r"0 \.\. 1"):
        past.compile(tk.spec((64, 64), f32))


@tk.kernel(num_warps=4)
def cluster_push(X: tk.gl, Y: tk.gl, CLUSTER: tk.constexpr = 2):
    """The same sums, pushed: block r stores slice s of its partial into slot
    r of block s's inbox, and each block sums its inbox."""
    tk.use_cluster(CLUSTER)
    b, r = tk.block_id(0), tk.cluster_rank()
    rows = 64 // CLUSTER
    inbox = tk.shared_tiles(f32, (rows, 64), CLUSTER)
    for s in tk.static_range(CLUSTER):
        tk.store(inbox[r].in_block(s), tk.load(X, (b * CLUSTER + s, 0), (rows, 64)).to(f32))
    tk.cluster_sync()                       # every slice delivered before any is summed
    total = tk.load(inbox[0])
    for k in tk.static_range(1, CLUSTER):
        total = total + tk.load(inbox[k])
    tk.store(Y, total, (b, 0))


@pytest.mark.parametrize("cluster", [2, 4])
def test_a_cluster_pushes_its_slices_to_their_owners(cluster):
    import torch
    g = torch.Generator().manual_seed(10 + cluster)
    x = torch.randn(2 * cluster * 64, 64, generator=g).to(torch.bfloat16)
    y = torch.full((2 * 64, 64), float("nan"))
    cluster_push.interpret[(2 * cluster,)](x, y, CLUSTER=cluster)
    ref = x.double().view(2, cluster, 64, 64).sum(1).reshape(-1, 64)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
    c = cluster_push.compile(tk.spec((2 * cluster * 64, 64), bf16), tk.spec((128, 64), f32),
                             CLUSTER=cluster)
    ptx = c.asm["ptx"]
    assert "st.shared::cluster" in ptx and "mapa.shared::cluster" in ptx
    # every block of the cluster has started before one touches another's
    # shared memory (the kernel has no semaphores, whose init would sync too)
    assert ptx.index("barrier.cluster.wait") < ptx.index("mapa.shared::cluster")


@pytest.mark.parametrize("use", ["mma", "view"])
def test_only_tk_load_and_store_take_another_blocks_tile(use):
    """An MMA reading another block's tile, or a view of one, is refused at
    its line (only ld/st.shared::cluster reach another block here)."""
    @tk.kernel(num_warps=4)
    def misuse(X: tk.gl[bf16], Y: tk.gl[f32], USE: tk.constexpr = "mma"):
        tk.use_cluster(2)
        a = tk.shared_tile(bf16, (64, 64), swizzle=128)
        b = tk.shared_tile(bf16, (64, 64), swizzle=128)
        if USE == "view":
            tk.store(Y, tk.load(a.in_block(1).subtile(0, 32)).to(f32), (0, 0))    # MARK
        else:
            acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
            acc = tk.mma_ABt(acc, a.in_block(1), b)                  # MARK
            tk.mma_wait(0)
            tk.store(Y, acc, (0, 0))
        tk.cluster_sync()

    with pytest.raises(tk.CompilationError, match=r"takes a tile of another block of the "
                                                  r"cluster \(tile.in_block\(rank\)\), which "
                                                  r"only tk.load reads and tk.store writes") as e:
        misuse.compile(tk.spec((64, 64), bf16), tk.spec((64, 64), f32), USE=use)
    assert "# MARK" in str(e.value)


@tk.kernel(num_warps=4)
def push_then_tma(X: tk.gl[bf16], Y: tk.gl[bf16]):
    """Slices pushed into the owners' inboxes, then one inbox read by a TMA
    store (the async proxy): the pushes need a proxy fence of the cluster's
    shared memory, not only this block's."""
    tk.use_cluster(2)
    r = tk.cluster_rank()
    inbox = tk.shared_tiles(bf16, (32, 64), 2, swizzle=128)
    for s in tk.static_range(2):
        tk.store(inbox[r].in_block(s), tk.load(X, (tk.block_id(0) * 2 + s, 0), (32, 64)))
    tk.cluster_sync()
    if tk.thread_id() == 0:
        tk.tma.store_async(Y, inbox[0], (tk.block_id(0), 0))
        tk.tma.store_commit()
        tk.tma.store_wait(0)
    tk.cluster_sync()


def test_a_pushed_tile_read_by_tma_is_fenced_for_the_cluster():
    ptx = push_then_tma.compile(tk.spec((128, 64), bf16), tk.spec((64, 64), bf16)).asm["ptx"]
    pushed = ptx.index("st.shared::cluster")
    assert "fence.proxy.async.shared::cluster" in ptx[pushed:ptx.index("cp.async.bulk")]


@tk.kernel(num_warps=4)
def push_loop(X: tk.gl[f32], Y: tk.gl[f32], SYNC_AFTER_READ: tk.constexpr = False):
    """Each round, block r pushes a tile into its peer's inbox and reads its
    own. Without a cluster sync after the read, the next round's push may
    overwrite the inbox before the peer has read it."""
    tk.use_cluster(2)
    b, r = tk.block_id(0), tk.cluster_rank()
    inbox = tk.shared_tile(f32, (64, 64))
    acc = tk.zeros((64, 64), f32)
    for i in range(2):
        tk.store(inbox.in_block(1 - r), tk.load(X, (b * 2 + i, 0), (64, 64)))   # MARK: push
        tk.cluster_sync()
        acc = acc + tk.load(inbox)                                             # MARK: read
        if SYNC_AFTER_READ:
            tk.cluster_sync()
    tk.store(Y, acc, (b, 0))
    tk.cluster_sync()


def test_a_push_that_may_overwrite_an_unread_inbox_is_a_race():
    x = np.random.default_rng(0).standard_normal((4 * 64, 64)).astype(np.float32)
    # (whichever of the push and the read the scheduler runs second is reported)
    with pytest.raises(InterpretError, match=r"data race across the cluster: this (store into|"
                                             r"load of) the shared tile .* and the (load|store) "
                                             r"at .* come between the same two "
                                             r"tk.cluster_sync\(\)s") as e:
        push_loop.interpret[(2,)](x, np.zeros((128, 64), np.float32))
    assert "MARK: " in open(__file__).read().splitlines()[e.value.line - 1]
    y = np.full((128, 64), np.nan, np.float32)
    push_loop.interpret[(2,)](x, y, SYNC_AFTER_READ=True)        # the sync orders them
    pairs = x.reshape(2, 2, 64, 64)
    assert np.allclose(y[:64], pairs[1].sum(0)) and np.allclose(y[64:], pairs[0].sum(0))


@tk.kernel(num_warps=4)
def reads_before_the_sync(X: tk.gl[f32], Y: tk.gl[f32]):
    """Block r reads its peer's tile before the cluster sync that would
    order the peer's store before the read."""
    tk.use_cluster(2)
    part = tk.shared_tile(f32, (64, 64))
    tk.store(part, tk.load(X, (tk.block_id(0), 0), (64, 64)))
    tk.store(Y, tk.load(part.in_block(1 - tk.cluster_rank())), (tk.block_id(0), 0))
    tk.cluster_sync()


def test_a_read_of_a_peer_tile_before_the_sync_is_a_race():
    x = np.ones((128, 64), np.float32)
    with pytest.raises(InterpretError, match="data race across the cluster"):
        reads_before_the_sync.interpret[(2,)](x, np.zeros((128, 64), np.float32))
