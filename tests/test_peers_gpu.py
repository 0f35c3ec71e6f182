"""Peer tensors on one GPU: every rank of a group emulated in one process,
one stream per rank, their copies grouped with tk.PeerTensor.from_tensors,
running the library's all-reduce and GEMM + reduce-scatter kernels at the
same time, against float64 references; and a wait that nobody answers traps
with a message instead of hanging. tests/test_multi_gpu.py runs them on two
GPUs against NCCL."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import tk_mlir as tk
from tk_mlir.kernels import ag_gemm, all_reduce_kernels as ar, gemm_rs

pytestmark = pytest.mark.gpu


def rel_err(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def run_ranks(world, launch):
    """launch(rank) for every rank, each on its own stream, all in flight at once."""
    streams = [torch.cuda.Stream() for _ in range(world)]
    torch.cuda.synchronize()
    for r in range(world):
        with torch.cuda.stream(streams[r]):
            launch(r)
    torch.cuda.synchronize()


@pytest.mark.parametrize("kernel, extra", [(ar.one_shot_kernel, 0), (ar.two_shot_kernel, 2)])
@pytest.mark.parametrize("T, N, world", [(1, 8192, 2), (7, 8192, 2), (333, 8192, 2),
                                         (5, 1000, 2), (64, 8192, 4), (3, 4096, 3)])
def test_all_reduce_kernels(kernel, extra, T, N, world):
    grid, dev = 64, torch.device("cuda")
    bufs = [torch.empty((2 * world + extra, T + 5, N), dtype=torch.bfloat16, device=dev)
            for _ in range(world)]
    flags = [torch.zeros((grid, 2, 4), dtype=torch.int32, device=dev) for _ in range(world)]
    epochs = [torch.zeros(grid, dtype=torch.int32, device=dev) for _ in range(world)]
    for call in range(3):       # the epochs carry the launches on, with no reset
        xs = [torch.randn(T, N, dtype=torch.bfloat16, device=dev) for _ in range(world)]
        ref = sum(x.double() for x in xs)
        run_ranks(world, lambda r: kernel[(grid,)](
            xs[r], tk.PeerTensor.from_tensors(bufs, r), tk.PeerTensor.from_tensors(flags, r),
            epochs[r], BLOCK=ar._block(N), TIMEOUT_MS=5000))
        for r in range(world):
            assert rel_err(xs[r], ref) < 1e-2
            assert torch.equal(xs[r], xs[0])        # every rank sums in one order
    assert all(int(e[0]) == 3 for e in epochs)


@pytest.mark.parametrize("M, N, K, kn, world", [
    (1024, 1024, 512, False, 2), (2048, 768, 1000, False, 2), (512, 4096, 256, True, 2),
    (192, 256, 128, False, 3),      # 64 rows each: a 128-row tile is half past an owner's rows
    (64, 512, 64, False, 1), (200, 512, 136, False, 2), (330, 384, 64, True, 3)])
def test_gemm_reduce_scatter_kernel(M, N, K, kn, world):
    grid, dev = 36, torch.device("cuda")      # (every rank's blocks fit at once)
    rows = M // world
    outs = [torch.empty((rows, N), dtype=torch.bfloat16, device=dev) for _ in range(world)]
    flags = [torch.zeros((2, 4), dtype=torch.int32, device=dev) for _ in range(world)]
    totals = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(world)]
    for call in range(2):
        a = [torch.randn(M, K, dtype=torch.bfloat16, device=dev) for _ in range(world)]
        b = [torch.randn(*((K, N) if kn else (N, K)), dtype=torch.bfloat16, device=dev)
             for _ in range(world)]
        ref = sum(x.double() @ (y.double() if kn else y.double().T) for x, y in zip(a, b))
        for o in outs:
            o.fill_(float("nan"))

        def launch(r):
            outs[r].zero_()
            gemm_rs.gemm_rs_kernel[(grid,)](a[r].unflatten(0, (world, rows)), b[r],
                                            tk.PeerTensor.from_tensors(outs, r),
                                            tk.PeerTensor.from_tensors(flags, r), totals[r],
                                            B_KN=kn, TIMEOUT_MS=5000)
        run_ranks(world, launch)
        for r in range(world):
            assert rel_err(outs[r], ref[r * rows:(r + 1) * rows]) < 1e-2
    assert totals[0].tolist()[:2] == [2, 2 * grid]


@pytest.mark.parametrize("rows, N, K, kn, world, bm", [(256, 512, 256, False, 2, 128),
                                                      (128, 768, 1000, True, 3, 128),
                                                      (192, 512, 128, False, 2, 64),
                                                      (100, 256, 64, False, 2, 128),
                                                      (40, 512, 128, True, 3, 64)])
def test_all_gather_gemm_kernels(rows, N, K, kn, world, bm):
    """The library's protocol, every rank on its stream: wait until the ranks
    are done reading, push this rank's rows into every rank's buffer, say so,
    and the GEMM that waits for each rank's rows."""
    grid, dev = 36, torch.device("cuda")
    bufs = [torch.empty((world * rows, K), dtype=torch.bfloat16, device=dev) for _ in range(world)]
    flags = [torch.zeros((2, 4), dtype=torch.int32, device=dev) for _ in range(world)]
    totals = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(world)]
    for call in range(3):      # each call overwrites what the last one read
        a = [torch.randn(rows, K, dtype=torch.bfloat16, device=dev) for _ in range(world)]
        b = [torch.randn(*((K, N) if kn else (N, K)), dtype=torch.bfloat16, device=dev)
             for _ in range(world)]
        c = [torch.full((world * rows, N), float("nan"), dtype=torch.bfloat16, device=dev)
             for _ in range(world)]
        full = torch.cat(a).double()

        def launch(r):
            f = tk.PeerTensor.from_tensors(flags, r)
            ag_gemm.ready_kernel[(1,)](f, totals[r], grid, TIMEOUT_MS=5000)
            for buf in bufs:
                buf[r * rows:(r + 1) * rows].copy_(a[r])
            ag_gemm.written_kernel[(1,)](f, totals[r])
            ag_gemm.ag_gemm_kernel[(grid,)](bufs[r], b[r], c[r], f, totals[r], rows, B_KN=kn,
                                            TIMEOUT_MS=5000, BM=bm,
                                            num_warps=4 * (bm // 64 + 1))
        run_ranks(world, launch)
        for r in range(world):
            ref = full @ (b[r].double() if kn else b[r].double().T)
            assert rel_err(c[r], ref) < 1e-2
    assert totals[0].tolist()[:2] == [3, 3 * grid]


@tk.kernel(num_warps=4)
def pull_by_tma(X: tk.pgl[tk.bf16], Y: tk.pgl[tk.bf16], OUT: tk.gl[tk.bf16]):
    """Block (r, c) reads tile c of rank r's copy of X by TMA (a tensor map per
    rank, picked by a run-time rank), adds one and adds it into rank r's copy
    of Y by TMA reduce-add, then writes the tile it read into OUT."""
    r, c = tk.block_id(0), tk.block_id(1)
    s = tk.shared_tile(tk.bf16, (64, 64), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, s)
        tk.tma.load_async(s, X[r], (0, c), sem)
    tk.wait(sem, 0)
    x = tk.load(s)
    tk.store(OUT, x, (r, c))
    tk.barrier()
    tk.store(s, (x.to(tk.f32) + 1.0).to(tk.bf16))
    tk.barrier()
    if tk.elect_leader("warpgroup"):
        tk.tma.reduce_add_async(Y[r], s, (0, c))
        tk.tma.store_commit()
        tk.tma.store_wait(0, read=False)


def test_tma_loads_and_adds_on_every_rank_copy():
    world, dev = 3, torch.device("cuda")
    xs = [torch.randn(64, 256, dtype=torch.bfloat16, device=dev) for _ in range(world)]
    ys = [torch.randn(64, 256, dtype=torch.bfloat16, device=dev) for _ in range(world)]
    y0 = [y.clone() for y in ys]
    out = torch.full((64 * world, 256), float("nan"), dtype=torch.bfloat16, device=dev)
    pull_by_tma[(world, 4)](tk.PeerTensor.from_tensors(xs, 1),
                            tk.PeerTensor.from_tensors(ys, 1), out)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(xs))
    for x, y, before in zip(xs, ys, y0):
        ref = before.double() + (x.double() + 1)
        assert rel_err(y, ref) < 1e-2


TIMEOUT = textwrap.dedent("""\
    import torch, tk_mlir as tk
    from tk_mlir.kernels import all_reduce_kernels as ar
    dev = torch.device("cuda")
    bufs = [torch.empty((4, 16, 8192), dtype=torch.bfloat16, device=dev) for _ in range(2)]
    flags = [torch.zeros((8, 2, 4), dtype=torch.int32, device=dev) for _ in range(2)]
    x = torch.randn(4, 8192, dtype=torch.bfloat16, device=dev)
    # rank 0 alone: rank 1 never signals
    ar.one_shot_kernel[(8,)](x, tk.PeerTensor.from_tensors(bufs, 0),
                             tk.PeerTensor.from_tensors(flags, 0),
                             torch.zeros(8, dtype=torch.int32, device=dev), BLOCK=2048,
                             TIMEOUT_MS=200)
    try:
        torch.cuda.synchronize()
    except Exception as e:
        print("RAISED", type(e).__name__, e)
    else:
        print("RETURNED")
""")


def test_an_unanswered_wait_traps_and_says_where(tmp_path):
    script = tmp_path / "timeout.py"
    script.write_text(TIMEOUT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    out = run.stdout + run.stderr
    assert "RAISED" in out, out
    assert "tk.wait_signal timed out after 200 ms at" in out and "all_reduce_kernels.py:" in out, out
    assert "the flag holds 0, waiting for 1" in out



UNSYNCED_CALLS = textwrap.dedent("""\
    import socket
    import torch, torch.distributed as dist
    from tk_mlir.kernels import all_gather_matmul
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    a = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    all_gather_matmul(a, b)
    torch.cuda.synchronize()
    for _ in range(3):            # the GPU busy when the call is queued (as the benchmark's
        ref = a.double() @ b.double().T          # reference was): its launches wait
        c = all_gather_matmul(a, b, timeout_ms=5000)
        torch.cuda.synchronize()
    for _ in range(20):           # the host far ahead of the GPU, as in a timing loop
        c = all_gather_matmul(a, b, timeout_ms=5000)
    torch.cuda.synchronize()
    print("ERR", ((c.double() - ref).norm() / ref.norm()).item())
""")


def test_all_gather_matmul_calls_queued_back_to_back(tmp_path):
    """Calls queued while the GPU is busy, and faster than it runs them (as
    in the benchmark): with the pushes on a side stream, the GEMM could start
    first and its spinning blocks hold every SM the pushes needed, and the
    calls waited until the timeout."""
    script = tmp_path / "queued.py"
    script.write_text(UNSYNCED_CALLS)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "ERR" in out, out[-3000:]
    assert float(out.split("ERR ")[1].split()[0]) < 1e-2, out
