"""The multi-GPU kernels on two GPUs, each test a script run under torchrun
with one process per GPU: tk's all-reduce against NCCL's dist.all_reduce, its
CUDA-graph replay, GEMM + reduce-scatter against torch.matmul +
dist.reduce_scatter_tensor, and a rank that never calls makes the other's
wait trap with a message instead of hanging. Skipped without two GPUs; NVLink
multicast stays off (the environment says so to NCCL and PyTorch)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

PRELUDE = textwrap.dedent("""\
    import os, sys
    import torch, torch.distributed as dist
    rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    from tk_mlir.kernels.all_reduce_kernels import all_reduce
    from tk_mlir.kernels.gemm_rs import matmul_reduce_scatter
    from tk_mlir.kernels.ag_gemm import all_gather_matmul
    torch.manual_seed(1234 + rank)
    def rel(x, ref):
        return ((x.double() - ref.double()).norm() / ref.double().norm()).item()
    def gathered(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        return parts
""")


def two_gpus() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def torchrun(tmp_path, body: str, timeout: int = 600) -> str:
    if not two_gpus():
        pytest.skip("needs two GPUs")
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29600 + os.getpid() % 300), str(script)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **NO_MULTICAST})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    return out


def test_all_reduce_matches_nccl(tmp_path):
    out = torchrun(tmp_path, """
        for dtype in (torch.bfloat16, torch.float32):
            for shape in [(1, 8192), (7, 8192), (128, 8192), (512, 8192), (3, 1000), (4096,),
                          (2, 3, 520)]:
                for algorithm in ("one_shot", "two_shot", "auto"):
                    x = torch.randn(shape, dtype=dtype, device="cuda")
                    ref = sum(p.double() for p in gathered(x))
                    nccl = x.clone()
                    dist.all_reduce(nccl)
                    got = all_reduce(x, algorithm=algorithm)
                    assert got is x
                    err, err_nccl = rel(x, ref), rel(nccl, ref)
                    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (shape, err)
                    assert err < 2 * err_nccl + 1e-6, (shape, algorithm, err, err_nccl)
                    same = gathered(x)
                    assert all(torch.equal(same[0], s) for s in same), "ranks differ"
        print("RANK", rank, "OK")
    """)
    assert out.count("OK") == 2


def test_all_reduce_replays_in_a_cuda_graph(tmp_path):
    out = torchrun(tmp_path, """
        x = torch.randn(16, 8192, dtype=torch.bfloat16, device="cuda")
        all_reduce(x)                       # (allocates its symmetric memory)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_reduce(x)
        for _ in range(4):
            x.copy_(torch.randn_like(x))
            ref = sum(p.double() for p in gathered(x))
            graph.replay()
            torch.cuda.synchronize()
            assert rel(x, ref) < 1e-2, rel(x, ref)
        print("RANK", rank, "OK")
    """)
    assert out.count("OK") == 2


def test_matmul_reduce_scatter_matches_nccl(tmp_path):
    out = torchrun(tmp_path, """
        for (M, N, K, layout) in [(1024, 1024, 512, "nk"), (2048, 768, 1000, "nk"),
                                  (512, 4096, 256, "kn"), (4096, 4096, 2048, "nk"),
                                  (1000, 512, 256, "nk"), (2 * 77, 256, 128, "kn")]:
            for call in range(2):
                a = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                b = torch.randn(*((N, K) if layout == "nk" else (K, N)), dtype=torch.bfloat16,
                                device="cuda")
                c = (a.float() @ (b.float().T if layout == "nk" else b.float()))
                ref = torch.empty(M // world, N, dtype=torch.float32, device="cuda")
                dist.reduce_scatter_tensor(ref, c)
                got = matmul_reduce_scatter(a, b, b_layout=layout)
                assert got.shape == (M // world, N) and got.dtype == torch.bfloat16
                assert rel(got, ref) < 1e-2, (M, N, K, rel(got, ref))
        print("RANK", rank, "OK")
    """)
    assert out.count("OK") == 2


def test_all_gather_matmul_matches_nccl(tmp_path):
    out = torchrun(tmp_path, """
        for (rows, N, K, layout) in [(128, 1024, 512, "nk"), (384, 768, 1000, "kn"),
                                     (2048, 4096, 2048, "nk"), (192, 512, 256, "nk"),
                                     (100, 512, 256, "nk"), (1, 256, 128, "kn")]:
            for call in range(2):
                a = torch.randn(rows, K, dtype=torch.bfloat16, device="cuda")
                b = torch.randn(*((N, K) if layout == "nk" else (K, N)), dtype=torch.bfloat16,
                                device="cuda")
                full = torch.empty(world * rows, K, dtype=a.dtype, device="cuda")
                dist.all_gather_into_tensor(full, a)
                ref = full.float() @ (b.float().T if layout == "nk" else b.float())
                got = all_gather_matmul(a, b, b_layout=layout)
                assert got.shape == (world * rows, N)
                assert rel(got, ref) < 1e-2, (rows, N, K, rel(got, ref))
        print("RANK", rank, "OK")
    """)
    assert out.count("OK") == 2


def test_a_rank_that_never_calls_makes_the_wait_trap(tmp_path):
    done = tmp_path / "rank0-done"
    out = torchrun(tmp_path, f"""
        import time
        x = torch.randn(4, 8192, dtype=torch.bfloat16, device="cuda")
        all_reduce(x, algorithm="one_shot")     # both: allocate, and one exchange
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            all_reduce(x, algorithm="one_shot", timeout_ms=300)   # rank 1 never comes
            try:
                torch.cuda.synchronize()
            except Exception as e:
                print("RAISED", type(e).__name__)
            else:
                print("RETURNED")
            open({str(done)!r}, "w").close()
        else:    # stays alive (its memory mapped) until rank 0 is done
            deadline = time.time() + 120
            while not os.path.exists({str(done)!r}) and time.time() < deadline:
                time.sleep(0.05)
        os._exit(0)             # (rank 0's context is gone: skip torch's teardown)
    """)
    assert "RAISED" in out and "RETURNED" not in out, out[-4000:]
    assert "tk.wait_signal timed out after 300 ms at" in out, out[-4000:]


def test_the_example_runs_under_torchrun():
    if not two_gpus():
        pytest.skip("needs two GPUs")
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "multi_gpu.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29900 + os.getpid() % 90), str(example)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, **NO_MULTICAST})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    errors = [float(x) for x in __import__("re").findall(r"rel\. error ([0-9.e+-]+)", out)]
    assert len(errors) == 3 and max(errors) < 2e-2, out[-3000:]
