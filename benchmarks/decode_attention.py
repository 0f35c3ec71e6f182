"""Decode attention: tk_mlir's attention_with_kvcache vs cuDNN and FlashAttention-2
(torch SDPA, GQA through enable_gqa) and FlashAttention-4, one new token per sequence.

On the GPU machine, from the repository root:
    python3 benchmarks/decode_attention.py --out-dir "$OUT"      # the issue's shapes
    python3 benchmarks/decode_attention.py --configs "8,32,8,8192,128"   # B,H,H_kv,N_kv,D
    python3 benchmarks/decode_attention.py --paged 16,256        # also paged caches
    python3 benchmarks/decode_attention.py --bn 64 --stages 4     # tk_mlir with other knobs

Every sequence holds N_kv keys (the peers attend over the whole cache); bf16;
the cache is (B, N_kv, H_kv, D) for tk_mlir and FA4, (B, H_kv, N_kv, D) for
SDPA (the same bits). Each call is timed as CUDA-graph replays (decode calls
are shorter than the host's launch time), input groups cycled past the L2.
GB/s counts the K and V bytes read. Every output is checked against float32
first. A paged row (tk_mlir only) is the same cache cut into pages of the
given size in a shuffled order.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

from tk_mlir.benchmarking import bench  # noqa: E402

ISSUE_SHAPES = [(8, 32, 8, 8192, 128), (64, 32, 8, 2048, 128), (1, 32, 8, 32768, 128),
                (32, 64, 8, 4096, 128), (8, 32, 8, 8192, 64)]
TOL = 1e-2


def make(b, h, h_kv, n, d, page=0):
    """inputs(generator) for bench: q, the cache in both layouts, lengths, table."""
    def inputs(gen):
        def u(*s):
            return (torch.rand(*s, device="cuda", generator=gen) * 2 - 1).bfloat16()
        q, k, v = u(b, 1, h, d), u(b, n, h_kv, d), u(b, n, h_kv, d)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        table = None
        if page:
            per = n // page
            order = torch.randperm(b * per, device="cuda", generator=gen)
            table = order.view(b, per).int()
            kp, vp = torch.empty(b * per, page, h_kv, d, dtype=k.dtype, device="cuda"), None
            vp = torch.empty_like(kp)
            kp[order], vp[order] = k.view(b * per, page, h_kv, d), v.view(b * per, page, h_kv, d)
            k, v = kp, vp
        return q, k, v, lens, table
    return inputs


def impls():
    from tk_mlir.kernels import attention_with_kvcache
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v, lens, table):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    enable_gqa=True).transpose(1, 2)
        return run

    def fa4(q, k, v, lens, table):
        from flash_attn.cute.interface import flash_attn_func
        return flash_attn_func(q, k, v, causal=True)[0]

    return {"tk_mlir": lambda q, k, v, lens, table: attention_with_kvcache(
                q, k, v, lens, block_table=table),
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "fa2": sdpa(SDPBackend.FLASH_ATTENTION),
            "fa4": fa4}


def reference(q, k, v, lens, table):
    if table is not None:
        k, v = k[table.long()].flatten(1, 2), v[table.long()].flatten(1, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                          v.transpose(1, 2).float(),
                                          enable_gqa=True).transpose(1, 2)


def run(config, names, timing, pages) -> list[dict]:
    b, h, h_kv, n, d = config
    shape = f"B{b} H{h}/{h_kv} N_kv{n} D{d}"
    kv_bytes = 2 * b * n * h_kv * d * 2
    rows = []
    for page in [0, *pages]:
        for name, fn in impls().items():
            if name not in names or (page and name != "tk_mlir"):
                continue
            row = {"shape": shape, "impl": name + (f" paged {page}" if page else ""),
                   "page": page}
            inputs = make(b, h, h_kv, n, d, page)
            try:
                group = inputs(torch.Generator(device="cuda").manual_seed(0))
                ref = reference(*group)
                got = fn(*group)
                torch.cuda.synchronize()
                row["rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
                t = bench(fn, inputs=inputs, bytes=kv_bytes, **timing)
                row.update(us=t.ms * 1e3, gbs=t.gbs,
                           status="ok" if row["rel_err"] < TOL else "WRONG")
            except Exception as e:                                  # noqa: BLE001
                row.update(status=f"failed: {type(e).__name__}: {str(e)[:80]}")
            rows.append(row)
            print(row, flush=True)
    best = min((r["us"] for r in rows if r["status"] == "ok" and r["impl"] != "tk_mlir"
                and not r["page"]), default=None)
    for r in rows:
        if best and "us" in r:
            r["vs_best_peer"] = best / r["us"]
    return rows


def override_knobs(bn: int | None, stages: int | None) -> None:
    """tk_mlir's key block (dense caches) and ring stages set for this run
    (decode_attention._config wrapped: a knob experiment, not a setting)."""
    from tk_mlir.kernels import decode_attention as da
    chosen = da._config

    def config(d, page):
        c = chosen(d, page)
        if bn and not page:
            c["BN"] = bn
        if stages:
            c["STAGES"] = stages
        return c
    da._config = config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", help="B,H,H_kv,N_kv,D;... (default: the issue's shapes)")
    ap.add_argument("--impls", default="tk_mlir,cudnn,fa2,fa4")
    ap.add_argument("--paged", default="", help="page sizes to time tk_mlir paged at, e.g. 16,256")
    ap.add_argument("--quick", action="store_true", help="short timing (a smoke run)")
    ap.add_argument("--bn", type=int, help="tk_mlir's key block on a dense cache (a multiple "
                    "of 16; default: decode_attention._config's per head dim)")
    ap.add_argument("--stages", type=int, help="tk_mlir's K/V ring stages (default: "
                    "decode_attention.STAGES)")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/decode_attention.py")
    if args.bn or args.stages:
        override_knobs(args.bn, args.stages)
    configs = ([tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
               if args.configs else ISSUE_SHAPES)
    timing = dict(graph=True, **(dict(warmup=20, iters=20, repeats=1, pause_s=0.05)
                                 if args.quick else dict(warmup=200, iters=100, repeats=3,
                                                         pause_s=0.2)))
    pages = [int(p) for p in args.paged.split(",") if p]
    rows = [r for c in configs for r in run(c, args.impls.split(","), timing, pages)]
    cols = ["shape", "impl", ("us", "µs"), ("gbs", "GB/s"), ("vs_best_peer", "best peer / this"),
            ("rel_err", "rel err"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    knobs = "".join(f"-{k}{v}" for k, v in (("bn", args.bn), ("stages", args.stages)) if v)
    meta = {"timing": timing, "tol": TOL, "bytes": "K and V of the whole cache",
            "bn": args.bn, "stages": args.stages}
    P.write_results("decode-attention" + knobs, rows, meta, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
