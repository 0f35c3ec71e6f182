"""Kernels that write into other GPUs' memory: a tensor-parallel layer's
all-reduce and its GEMM + reduce-scatter, against NCCL.

    torchrun --nproc-per-node 2 examples/multi_gpu.py    # two GPUs: run and check
    python examples/multi_gpu.py                         # anywhere: compile, show, and
                                                         # run 2 ranks in the CPU interpreter

A `tk.pgl[...]` parameter takes a tk.PeerTensor: one tensor on every rank of
a process group, on PyTorch's symmetric memory (plain NVLink peer access,
never multicast). In the kernel `X` is this rank's copy, `X[r]` rank r's
(tk.load/tk.store and TMA work on either) and `X.rank` this rank. Ranks
agree through flags: `tk.signal` (a system-scope release), `tk.wait_signal`
(an acquire that spins, and traps after a timeout instead of hanging), and
`tk.fence` after TMA writes. Read `push_and_sum` below, then the library's
kernels: tk_mlir/kernels/all_reduce_kernels.py and gemm_rs.py.
"""
import os

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)      # no NVLink multicast, ever

import tk_mlir as tk
from tk_mlir import f32


@tk.kernel(num_warps=4)
def push_and_sum(X: tk.gl, Buf: tk.pgl, Flags: tk.pgl["i32"], epoch: int):
    """A one-shot all-reduce of a (rows, 64) tensor, one 16-row tile per block:
    push the tile into every rank's Buf (slot = this rank), tell every rank,
    wait for every rank, sum the slots. (The library's version keeps its
    epochs on the GPU, so that a CUDA graph can replay it.)"""
    b, t = tk.block_id(0), tk.thread_id()
    x = tk.load(X, (b, 0), (16, 64))
    for p in tk.static_range(Buf.world_size):
        tk.store(Buf[p], x, (Buf.rank, b, 0))       # a plain store into rank p's memory
    tk.barrier()                                    # every thread's stores, then the signal
    if t < Buf.world_size:
        tk.signal(Flags[t], (b, Buf.rank))          # red.release.sys on rank t's flag
        tk.wait_signal(Flags, (b, t), epoch)        # ld.acquire.sys until rank t has come
    tk.barrier()
    total = tk.zeros((16, 64), f32)
    for p in tk.static_range(Buf.world_size):
        total = total + tk.load(Buf, (p, b, 0), (16, 64)).to(f32)
    tk.store(X, total.to(X.dtype), (b, 0))


def show() -> None:
    compiled = push_and_sum.compile(tk.spec((64, 64), tk.bf16),
                                    tk.peer_spec((2, 64, 64), tk.bf16, world_size=2),
                                    tk.peer_spec((4, 4), "i32", world_size=2), 1)
    ptx = compiled.asm["ptx"]
    for word in ("red.release.sys", "ld.acquire.sys", "%globaltimer", "trap;"):
        line = next(s.strip() for s in ptx.splitlines() if word in s)
        print(f"  {word:18s} {line}")


def interpret_two_ranks() -> float:
    """Both ranks' launches at once on the CPU (kernel.interpret_ranks): the
    copies are CPU tensors every rank's PeerTensor shares."""
    import torch
    world = 2
    xs = [torch.randn(64, 64).to(torch.bfloat16) for _ in range(world)]
    ref = sum(x.double() for x in xs)
    bufs = [torch.empty(world, 64, 64, dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros(4, 4, dtype=torch.int32) for _ in range(world)]
    push_and_sum.interpret_ranks[(4,)]([(xs[r], tk.PeerTensor.from_tensors(bufs, r),
                                         tk.PeerTensor.from_tensors(flags, r), 1)
                                        for r in range(world)])
    return max(((x.double() - ref).norm() / ref.norm()).item() for x in xs)


def main() -> None:
    if "RANK" not in os.environ:
        print("push_and_sum for 2 ranks, its signals in PTX:")
        show()
        print(f"2 ranks in the CPU interpreter: rel. error {interpret_two_ranks():.1e}")
        print("not under torchrun: compiled and interpreted only; on two GPUs run\n"
              "  torchrun --nproc-per-node 2 examples/multi_gpu.py")
        return
    import torch
    import torch.distributed as dist
    from tk_mlir.kernels.all_reduce_kernels import all_reduce
    from tk_mlir.kernels.gemm_rs import matmul_reduce_scatter

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.manual_seed(rank)

    def say(*what):
        if rank == 0:
            print(*what, flush=True)

    def rel(x, ref):
        return ((x.float() - ref.float()).norm() / ref.float().norm()).item()

    # The kernel above, on tensors of PyTorch's symmetric memory.
    buf = tk.peer_tensor((world, 64, 64), torch.bfloat16)
    flags = tk.peer_tensor((4, 4), torch.int32)
    flags.local.zero_()
    dist.barrier()
    x = torch.randn(64, 64, dtype=torch.bfloat16, device="cuda")
    ref = x.clone()
    dist.all_reduce(ref)
    push_and_sum[(4,)](x, buf, flags, 1)
    say(f"push_and_sum on {world} GPUs vs NCCL: rel. error {rel(x, ref):.1e}")

    # The library: a decode-sized all-reduce ...
    t = torch.randn(16, 8192, dtype=torch.bfloat16, device="cuda")
    ref = t.clone()
    dist.all_reduce(ref)
    all_reduce(t)
    say(f"all_reduce (16, 8192) bf16 vs NCCL: rel. error {rel(t, ref):.1e}")

    # ... and a row-parallel layer's GEMM + reduce-scatter, K split among ranks.
    a = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")    # N x K
    out = matmul_reduce_scatter(a, w)
    ref = torch.empty_like(out)
    dist.reduce_scatter_tensor(ref, a @ w.T)
    say(f"matmul_reduce_scatter (4096 x 4096, K = {world} x 2048) vs matmul + NCCL "
        f"reduce_scatter: rel. error {rel(out, ref):.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
