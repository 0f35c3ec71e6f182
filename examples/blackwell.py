"""A Blackwell (sm_100a) kernel, down to SASS, on a machine without a Blackwell GPU.

    python examples/blackwell.py                      # its stages, and what its MMA line became
    TK_MLIR_INTERPRET=1 python examples/blackwell.py  # ... and its product, in the CPU interpreter

Blackwell's tensor cores (tcgen05) accumulate in tensor memory, 128 lanes x
512 columns of f32 beside each SM's tensor cores, not in registers: the
kernel allocates a tensor tile, one thread issues the MMAs into it and
commits them onto a semaphore, and the warpgroup waits for that semaphore's
phase before it reads the tile into registers (tcgen05.ld) and stores it.

Never run on Blackwell hardware: ptxas, nvdisasm and the interpreter are
its only checks. (The library's warp-specialized GEMM in this style is
tk_mlir/kernels/blackwell_gemm.py; matmul launches it on a B200.)
"""
import inspect

import torch

import tk_mlir as tk
from tk_mlir import bf16, f32

from tk_mlir.knobs import interpret


@tk.kernel(num_warps=4, target="sm_100a")
def tile_product(A: tk.gl[bf16], B: tk.gl[bf16], C: tk.gl[f32], K: tk.constexpr):
    """C (128 x 128) = A (128 x K) @ B (128 x K).T, K in steps of 64."""
    a = tk.shared_tile(bf16, (128, 64), swizzle=128)
    b = tk.shared_tile(bf16, (128, 64), swizzle=128)
    loaded, done = tk.semaphore(1), tk.semaphore(1)
    acc = tk.tensor_tile(f32, (128, 128))           # tensor memory: tcgen05.alloc
    for k in range(K // 64):
        if tk.warp_id() == 0:
            if tk.elect_leader():                   # one thread loads and multiplies
                tk.tma.expect(loaded, a, b)
                tk.tma.load_async(a, A, (0, k), loaded)
                tk.tma.load_async(b, B, (0, k), loaded)
                tk.wait(loaded, k % 2)
                tk.mma_ABt(acc, a, b, accumulate=k > 0)     # tcgen05.mma, 4 per step
                tk.mma_commit(done)                         # tcgen05.commit
        tk.wait(done, k % 2)                        # the MMAs are done, a and b free
    tk.store(C, tk.load(acc), (0, 0))               # tcgen05.ld: a row per thread
    tk.free_tensor_tile(acc)                        # tcgen05.dealloc


def main():
    K = 256
    compiled = tile_product.compile(tk.spec((128, K), bf16), tk.spec((128, K), bf16),
                                    tk.spec((128, 128), f32), K=K)
    print(f"{compiled.name} for {compiled.arch}: stages {', '.join(compiled.asm)}")
    print(compiled.summary_text())
    source, first = inspect.getsourcelines(tile_product.fn)
    mma_line = first + next(i for i, text in enumerate(source) if "tk.mma_ABt" in text)
    print(compiled.lines(mma_line))

    if not interpret():      # (a GPU here is a Hopper one: it cannot run sm_100a code)
        print("compiled only (sm_100a code runs on a Blackwell GPU); check its product in "
              "the CPU interpreter:\n  TK_MLIR_INTERPRET=1 python examples/blackwell.py")
    else:
        a, b = torch.randn(128, K).bfloat16(), torch.randn(128, K).bfloat16()
        c = torch.full((128, 128), float("nan"))
        tile_product.interpret[(1,)](a, b, c, K=K)
        ref = a.double() @ b.double().T
        err = ((c.double() - ref).norm() / ref.norm()).item()
        print(f"tile_product on cpu: rel. error vs float64: {err:.2e}")


if __name__ == "__main__":
    main()
