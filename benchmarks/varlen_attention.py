"""Packed variable-length attention against dense attention on the same tokens:
tk_mlir `attention_varlen` (forward, and forward+backward) against tk_mlir's
dense `attention` at B x N holding the same total tokens, and torch SDPA on a
jagged nested tensor where this torch supports it.

On the GPU machine, from the repository root:
    python3 benchmarks/varlen_attention.py --out-dir "$OUT"
    python3 benchmarks/varlen_attention.py --seqs 16 --max-len 4096 --d 128 --h 16
    python3 benchmarks/varlen_attention.py --graph      # kernel time: CUDA-graph replays

Sequences: `--seqs` lengths drawn uniformly from 1..max_len (seed 0), and the
same count of sequences all of the mean length (the packing's own cost,
without the imbalance of ragged lengths). bf16, H query and K/V heads.
"tk_mlir varlen" calls with the same offsets tensors, as a model's layers do
(the task schedule is made once and kept); "new offsets" passes copies, as a
batch's first layer sees them (the schedule made every call).
TFLOP/s counts the (query, key) pairs each sequence's mask lets through
(4·D per pair forward, 2.5x that backward); the dense row uses B = seqs and
N = the mean length rounded to 128. µs per call: CUDA events, input groups
cycled past the L2. Each output is checked first against float32 attention
of one sequence per call (the longest).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

from tk_mlir.benchmarking import bench  # noqa: E402

TOL = 1e-2
TIMING: dict = {}       # bench's options (--graph)


def pairs(len_q: int, len_k: int, causal: bool) -> int:
    if not causal:
        return len_q * len_k
    return sum(min(len_k, i + 1 + len_k - len_q) for i in range(len_q) if i + len_k >= len_q)


def check(o, q, k, v, cu, causal: bool) -> float:
    """Rel. error of the longest sequence's output against float32."""
    lens = (cu[1:] - cu[:-1]).tolist()
    b = max(range(len(lens)), key=lens.__getitem__)
    s0, s1 = int(cu[b]), int(cu[b + 1])
    qs, ks, vs = (t[s0:s1].float().transpose(0, 1) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    got = o[s0:s1].float().transpose(0, 1)
    return ((got - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (kernel time, not the host's)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/varlen_attention.py")
    from tk_mlir.kernels import attention, attention_varlen
    global TIMING
    TIMING = dict(graph=True, warmup=10, iters=30, repeats=1) if args.graph else {}
    g = torch.Generator().manual_seed(0)
    ragged = torch.randint(1, args.max_len + 1, (args.seqs,), generator=g).tolist()
    mean = sum(ragged) // len(ragged)
    rows = []
    for d in (int(x) for x in args.d.split(",")):
        for causal in (False, True):
            for kind, lens in (("ragged", ragged), ("equal", [mean] * args.seqs)):
                rows += _case(d, causal, kind, lens, args.h, attention_varlen)
            n = -(-mean // 128) * 128
            rows += _dense(d, causal, args.seqs, n, args.h, attention)
    cols = ["case", "impl", "pass", ("us", "µs"), ("tflops", "TFLOP/s"),
            ("vs_dense", "/ dense TFLOP/s"), ("rel_err", "rel err"), "status"]
    for r in rows:
        dense = next((x for x in rows if x["impl"] == "tk_mlir dense" and
                      x["case"].split(" ")[0:2] == r["case"].split(" ")[0:2] and
                      x["pass"] == r["pass"] and "tflops" in x), None)
        if dense and "tflops" in r:
            r["vs_dense"] = r["tflops"] / dense["tflops"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("varlen-attention", rows, {**vars(args), "ragged": ragged}, args.out_dir)
    return 0


def _inputs(total: int, h: int, d: int):
    def make(gen):
        return tuple((torch.rand(total, h, d, device="cuda", generator=gen) * 2 - 1).bfloat16()
                     .requires_grad_() for _ in range(3))
    return make


def _case(d, causal, kind, lens, h, attention_varlen):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    total, most = int(cu[-1]), max(lens)
    flops = 4 * h * d * sum(pairs(n, n, causal) for n in lens)
    make = _inputs(total, h, d)
    case = f"D{d} {'causal' if causal else 'full'} {kind} {len(lens)} seqs, {total} tokens"
    impls = {"tk_mlir varlen": lambda q, k, v: attention_varlen(q, k, v, cu, cu, most, most,
                                                                 causal=causal),
             # a batch's first layer: offsets it has not seen, so it makes its schedule
             "tk_mlir varlen, new offsets": lambda q, k, v: attention_varlen(
                 q, k, v, cu.clone(), cu.clone(), most, most, causal=causal)}
    offsets, fewest = cu.long(), min(lens)
    try:    # SDPA on a jagged nested tensor (B, j, H, D) -> (B, H, j, D)
        def nested(q, k, v):
            # the lengths' extremes given, so SDPA reads none back from the GPU
            # (a sync, which CUDA-graph capture refuses)
            qn, kn, vn = (torch.nested.nested_tensor_from_jagged(
                t, offsets, min_seqlen=fewest, max_seqlen=most).transpose(1, 2) for t in (q, k, v))
            return torch.nn.functional.scaled_dot_product_attention(
                qn, kn, vn, is_causal=causal).transpose(1, 2).values()
        impls["sdpa nested"] = nested
    except Exception as e:                                          # noqa: BLE001
        print(f"nested SDPA unavailable: {P.first_line(e)}")
    return _time(case, impls, make, cu, causal, flops)


def _dense(d, causal, b, n, h, attention):
    flops = 4 * b * h * d * pairs(n, n, causal)

    def make(gen):
        return tuple((torch.rand(b, h, n, d, device="cuda", generator=gen) * 2 - 1).bfloat16()
                     .requires_grad_() for _ in range(3))
    case = f"D{d} {'causal' if causal else 'full'} dense B{b} N{n}"
    return _time(case, {"tk_mlir dense": lambda q, k, v: attention(q, k, v, causal=causal)},
                 make, None, causal, flops)


def _time(case, impls, make, cu, causal, flops):
    rows = []
    q, k, v = make(torch.Generator(device="cuda").manual_seed(1))
    for name, fn in impls.items():
        for pass_, f, fl in (("fwd", fn, flops), ("fwd+bwd", _with_backward(fn), 3.5 * flops)):
            row = {"case": case, "impl": name, "pass": pass_}
            try:
                if cu is not None and pass_ == "fwd":
                    with torch.no_grad():
                        row["rel_err"] = check(fn(q, k, v), q, k, v, cu, causal)
                nograd = pass_ == "fwd"
                with torch.set_grad_enabled(not nograd):
                    t = bench(f, inputs=make, flops=fl, **TIMING)
                row.update(us=t.ms * 1e3, tflops=t.tflops,
                           status="ok" if row.get("rel_err", 0.0) < TOL else "WRONG")
            except Exception as e:                                  # noqa: BLE001
                row["status"] = f"failed: {P.first_line(e)}"
            rows.append(row)
            print(row, flush=True)
    return rows


def _with_backward(fn):
    def fb(q, k, v):
        o = fn(q, k, v)
        return torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    return fb


if __name__ == "__main__":
    sys.exit(main())
