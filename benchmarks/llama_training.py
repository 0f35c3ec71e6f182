"""A transformers Llama training end to end: every op patched with tk_mlir
(`patch_llama`) against eager torch with SDPA and, when it imports, the same
model patched with Liger Kernel (`apply_liger_kernel_to_llama`'s instance
form), from the same bf16 weights on the same batches (issue 25).

On the GPU machine, from the repository root:
    python3 benchmarks/llama_training.py --out-dir "$OUT"
    python3 benchmarks/llama_training.py --layers 2 --steps 10      # a quick look

Reported per implementation: the median step time (forward, backward and
AdamW, CUDA-synchronised, steps after the first `--warmup`), tokens per
second, the peak memory, and the loss at every step; the speedup is against
eager + SDPA, and the loss curves go to a plot beside the results. The model
is the issue's: hidden 2048, 8 layers, GQA 16:4, vocab 32k, batch 4 x 2048
tokens, bf16 weights and AdamW states.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402


def build(args):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 256 * 256, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=max(4096, args.seq),
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def variants(base, names: list[str]):
    """(name, model) of each implementation asked for that can be made here."""
    for name in names:
        m = copy.deepcopy(base)
        if name == "tk_mlir":
            from tk_mlir.integrations import patch_llama
            patch_llama(m)
        elif name == "liger":
            try:
                from liger_kernel.transformers import _apply_liger_kernel_to_instance
            except ImportError as e:
                print(f"liger: not importable ({P.first_line(e)}); skipped", flush=True)
                continue
            _apply_liger_kernel_to_instance(model=m)
        yield name, m


def train(model, batches, steps: int, warmup: int, device: str) -> dict:
    """`steps` AdamW steps on the batches in turn: losses, step times, peak memory."""
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    losses, times = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        ids = batches[i % len(batches)].to(device)
        sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    timed = times[warmup:] or times
    return {"step_ms": 1e3 * statistics.median(timed), "first_step_s": times[0],
            "peak_gib": peak, "losses": losses}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def plot_losses(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["impl"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Llama training loss (same weights, same batches)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--impls", default="sdpa,tk_mlir,liger")
    ap.add_argument("--out-dir", default=None, help="where the results go (default "
                    "benchmarks/results; with --cpu, nowhere unless given: a dry run does not "
                    "replace the measurement of record)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU: a dry run of the "
                    "script (tk_mlir then needs TK_MLIR_INTERPRET=1, and tiny sizes)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        P.require_cuda("benchmarks/llama_training.py")
    base = build(args)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
               for _ in range(4)]
    rows = []
    for name, m in variants(base, args.impls.split(",")):
        try:
            r = train(m, batches, args.steps, args.warmup, device)
            status = "ok"
        except Exception as e:          # (one implementation's failure does not stop the run)
            r, status = {"losses": []}, f"failed: {P.first_line(e)}"
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
        row = {"impl": name, **r, "status": status}
        if "step_ms" in r:
            row["tokens_per_s"] = args.batch * args.seq / (r["step_ms"] / 1e3)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)
    first = next((r for r in rows if r["impl"] == "sdpa" and "step_ms" in r), None)
    for r in rows:
        if first is not None and "step_ms" in r:
            r["speedup_vs_sdpa"] = first["step_ms"] / r["step_ms"]
            n = min(len(r["losses"]), len(first["losses"]))
            r["max_loss_diff_vs_sdpa"] = max(abs(a - b) for a, b in
                                             zip(r["losses"][:n], first["losses"][:n]))
            r["final_loss"] = r["losses"][-1]
    cols = ["impl", ("step_ms", "step ms"), ("tokens_per_s", "tokens/s"),
            ("speedup_vs_sdpa", "vs eager+SDPA"), ("peak_gib", "peak GiB"),
            ("final_loss", "final loss"), ("max_loss_diff_vs_sdpa", "max loss diff vs SDPA"),
            ("first_step_s", "first step s"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    out_dir = args.out_dir or (None if args.cpu else "benchmarks/results")
    out = P.write_results("llama-training", rows, vars(args), out_dir) if out_dir else None
    if out is not None:
        png = plot_losses([r for r in rows if r["losses"]],
                          Path(out).with_name("llama-training-loss.png"))
        if png is not None:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
