"""tk_mlir quickstart: a row-softmax kernel, its IR at every stage, and a run.

    python examples/quickstart.py

It compiles and prints the stages (Python -> tk -> ... -> PTX -> cubin), then
runs the kernel against torch: on a GPU, else in the CPU interpreter (no CUDA).
"""
import tk_mlir as tk
from tk_mlir import f32


@tk.kernel(num_warps=4)
def softmax(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.constexpr, N: tk.constexpr):
    i = tk.block_id(0)                                   # this block's tile of rows
    x = tk.load(X, (i, 0), (ROWS, N), fill=float("-inf"))  # past the edge: -inf
    e = x.sub_row(x.row_max()).exp()                     # row max: warp shuffles
    tk.store(Y, e.div_row(e.row_sum()), (i, 0))          # masked store


def main():
    M, N, ROWS = 1000, 512, 4
    compiled = softmax.compile(tk.spec((M, N), tk.f32), tk.spec((M, N), tk.f32), ROWS=ROWS, N=N)
    print("stages:", ", ".join(compiled.asm))
    # The tk IR in short, the Python line as a gutter (compiled.asm["tk"] is
    # MLIR's generic, re-parsable text).
    print("\n--- tk IR ---\n" + compiled.asm.short("tk"))
    # What the line with .exp() became: its tk ops, PTX lines and SASS.
    exp_line = next(c for c in compiled.source_map.lines() if ".exp()" in c.source)
    print("--- one Python line, followed down ---")
    print("\n".join(str(exp_line).splitlines()[:12]) + "\n    ...")
    # Registers, spills, occupancy, the SASS mix (without ptxas, e.g. on macOS,
    # the kernel stops at PTX and the summary says so).
    print("--- summary ---\n" + compiled.summary_text())

    import torch
    x = torch.randn(M, N) * 4
    if gpu_here():
        x = x.cuda()
        y = torch.full_like(x, float("nan"))
        softmax[(tk.cdiv(M, ROWS),)](x, y, ROWS=ROWS, N=N)
        where = f"ran on {torch.cuda.get_device_name()}"
    else:
        # The same kernel in the CPU interpreter: CPU tensors, outputs written
        # in place, races and deadlocks reported at your line.
        y = torch.full_like(x, float("nan"))
        softmax.interpret[(tk.cdiv(M, ROWS),)](x, y, ROWS=ROWS, N=N)
        where = "No CUDA GPU here: ran in the CPU interpreter (softmax.interpret)"
    ref = torch.softmax(x.double(), dim=-1)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    print(f"\n{where}: relative error vs torch.softmax = {err:.2e}")
    assert err < 1e-5, err


def gpu_here() -> bool:
    """A CUDA GPU and cuda-bindings to reach it (macOS has neither)."""
    from tk_mlir.errors import CudaUnavailable
    try:
        from tk_mlir.runtime.driver import has_gpu
        return has_gpu()
    except CudaUnavailable:
        return False

if __name__ == "__main__":
    main()
