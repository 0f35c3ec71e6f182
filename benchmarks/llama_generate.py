"""A transformers Llama generating through its KV cache: tk_mlir attention
(prefill by `attention`, decode steps by `attention_with_kvcache`, through
patch_llama's attention only) against SDPA, on the same randomly initialised
bf16 weights.

On the GPU machine, from the repository root:
    python3 benchmarks/llama_generate.py --out-dir "$OUT"
    python3 benchmarks/llama_generate.py --batch 8 --prompt 2048 --new 128

Reported: decode tokens per second (greedy, `max_new_tokens` after a prefill,
CUDA-synchronised wall time, best of 3 after a warm-up), and the first decode
step's logits against a float32 copy of the model (relative Frobenius error;
tk_mlir's must be no worse than SDPA's, up to bf16's rounding) with the
greedy tokens' agreement with SDPA's.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402


def _cache_of(out):
    """The output's KV cache: `cache` in transformers >= 5.2x, `past_key_values` before."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def model(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 256 * 256,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=32768, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def step_logits(m, ids, new):
    """Logits of decoding `new` one token at a time after the prompt `ids`."""
    with torch.no_grad():
        out = m(input_ids=ids, use_cache=True)
        cache, logits = _cache_of(out), []
        for t in range(new.shape[1]):
            out = m(input_ids=new[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = _cache_of(out)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def tokens_per_second(m, ids, new_tokens: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        m.generate(ids, max_new_tokens=4, do_sample=False)              # warm-up, compiles
        best, out = float("inf"), None
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return ids.shape[0] * new_tokens / best, out[:, ids.shape[1]:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/llama_generate.py")
    from tk_mlir.integrations import patch_llama
    reference = model(args.layers, args.hidden, args.heads, args.kv_heads, args.vocab).cuda()
    sdpa = copy.deepcopy(reference).to(torch.bfloat16)
    ours = copy.deepcopy(sdpa)
    patch_llama(ours, rms_norm=False, linear=False, swiglu=False, rotary=False,
                cross_entropy=False, linear_cross_entropy=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=g).cuda()
    new = torch.randint(0, args.vocab, (args.batch, 4), generator=g).cuda()
    ref = step_logits(reference, ids, new)
    rows = []
    tokens = {}
    for name, m in (("sdpa", sdpa), ("tk_mlir", ours)):
        err = ((step_logits(m, ids, new) - ref).norm() / ref.norm()).item()
        tps, tokens[name] = tokens_per_second(m, ids, args.new)
        rows.append({"impl": name, "tokens_per_s": tps, "logits_rel_err": err})
        print(rows[-1], flush=True)
    agree = (tokens["tk_mlir"] == tokens["sdpa"]).float().mean().item()
    for r in rows:
        r["greedy_agreement_with_sdpa"] = agree
        r["speedup_vs_sdpa"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    cols = ["impl", ("tokens_per_s", "tokens/s"), ("speedup_vs_sdpa", "vs SDPA"),
            ("logits_rel_err", "logits rel err vs f32"),
            ("greedy_agreement_with_sdpa", "greedy tokens = SDPA's")]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("llama-generate", rows, vars(args), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
