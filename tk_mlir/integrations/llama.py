"""patch_llama: a transformers Llama's layers on tk_mlir's kernels, as Liger's
apply_liger_kernel_to_llama does with its own.

What it swaps, each optional:
- every LlamaRMSNorm's forward -> `rms_norm` (rows of the hidden states);
- every nn.Linear's forward -> `matmul` (the weight as it lies, N x K), plus
  its bias;
- every LlamaMLP's forward -> down(`swiglu`(gate(x), up(x))) (hidden_act silu);
- the model's attention -> `attention`, registered with transformers as the
  attention implementation "tk_mlir" (causal; no padding mask, no dropout);
  generating through the cache, steps of at most DECODE_ROWS new tokens (not
  differentiated) -> `attention_with_kvcache` over the cache;
- the rotary embedding -> `rotary_embedding` (modeling_llama's
  apply_rotary_pos_emb, a module function: patched for the process, falling
  back to transformers' own for inputs the kernel does not take);
- the loss -> `cross_entropy` (the model's loss_function, labels shifted as
  transformers shifts them);
- in training with labels, LlamaForCausalLM's forward -> the loss straight
  from the last hidden states by `linear_cross_entropy`, never making the
  logits (outputs.logits is None then, as with Liger's fused loss);
  linear_cross_entropy="low_memory" takes its low_memory=True (a slice of
  logits no larger than the hidden states, for 4 GEMMs' work instead of 3).
All of them differentiate, so the patched model trains, also under gradient
checkpointing and torch.compile(fullgraph=True). Layers the kernels
do not take (not bf16/f16) are refused with the layer's name, and sizes
they do not take (a head dim other than 64, 128 or 256; a hidden size that
is not a multiple of 8) with the config's field, before anything is changed.
"""
from __future__ import annotations

import functools
import types

PARTS = ("rms_norm", "linear", "swiglu", "attention", "rotary", "cross_entropy",
         "linear_cross_entropy")
ATTENTION = "tk_mlir"


def patch_llama(model, **parts) -> None:
    """Put tk_mlir's kernels into `model` (a transformers LlamaForCausalLM or
    LlamaModel, bf16 or f16). parts: a bool per
    name in PARTS, all True by default (e.g. patch_llama(m, attention=False));
    linear_cross_entropy may also be "low_memory"."""
    import torch
    from transformers.models.llama import modeling_llama as llama
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise TypeError(f"patch_llama: unknown parts {sorted(unknown)}; they are {PARTS}")
    low_memory = parts.get("linear_cross_entropy") == "low_memory"
    if isinstance(parts.get("linear_cross_entropy"), str) and not low_memory:
        raise ValueError(f"patch_llama: linear_cross_entropy is a bool or 'low_memory', got "
                         f"{parts['linear_cross_entropy']!r}")
    want = {p: bool(parts.get(p, True)) for p in PARTS}
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"patch_llama: model must be a transformers Llama, got model_type "
                         f"{getattr(config, 'model_type', None)!r}")
    # Check everything first: a refused model is left as it was.
    _check_sizes(config, want)
    patches = []
    for name, module in model.named_modules():
        if want["rms_norm"] and isinstance(module, llama.LlamaRMSNorm):
            _check_dtype(name, module.weight, (torch.bfloat16, torch.float16))
            patches.append((module, _rms_norm_forward))
        elif want["linear"] and isinstance(module, torch.nn.Linear):
            _check_dtype(name, module.weight, (torch.bfloat16, torch.float16))
            patches.append((module, _linear_forward))
        elif want["swiglu"] and isinstance(module, llama.LlamaMLP):
            if config.hidden_act != "silu":
                raise ValueError(f"patch_llama: {name} uses {config.hidden_act!r}; swiglu is "
                                 f"silu's")
            _check_dtype(f"{name}.gate_proj", module.gate_proj.weight,
                         (torch.bfloat16, torch.float16))
            patches.append((module, _mlp_forward))
        elif (want["attention"] or want["rotary"]) and isinstance(module, llama.LlamaAttention):
            _check_dtype(f"{name}.q_proj", module.q_proj.weight, (torch.bfloat16, torch.float16))
    lce = want["linear_cross_entropy"] and hasattr(model, "lm_head")
    if lce and (model.lm_head.bias is not None or model.lm_head.weight.dtype not in
                (torch.bfloat16, torch.float16)):
        raise TypeError("patch_llama: linear_cross_entropy takes a bf16/f16 lm_head without "
                        "bias (or pass linear_cross_entropy=False)")
    for module, forward in patches:
        module.forward = types.MethodType(forward, module)
    if want["attention"]:
        _register_attention()
        model.set_attn_implementation(ATTENTION)
    if want["rotary"] and llama.apply_rotary_pos_emb is not _rotary:
        _rotary.original = llama.apply_rotary_pos_emb
        llama.apply_rotary_pos_emb = _rotary
    if want["cross_entropy"] and hasattr(model, "lm_head"):
        model.loss_function = _causal_lm_loss
    if lce:
        model.forward = types.MethodType(_causal_lm_forward, model)
        model.tk_mlir_low_memory_loss = low_memory


def _check_sizes(config, want: dict) -> None:
    """The config's sizes against the rules of the kernels `want` names: each
    refusal names the field, the rule and the part to turn off."""
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    rules = [("attention", "head_dim", head_dim, head_dim in (64, 128, 256), "64, 128 or 256"),
             ("rms_norm", "hidden_size", config.hidden_size, config.hidden_size % 8 == 0,
              "a multiple of 8")]
    for part, field, value, ok, rule in rules:
        if want[part] and not ok:
            raise ValueError(f"patch_llama: {part} takes config.{field} {rule}, got {value} "
                             f"(or pass {part}=False)")


def _check_dtype(name, weight, dtypes) -> None:
    if weight.dtype not in dtypes:
        raise TypeError(f"patch_llama: {name}'s weight is {weight.dtype}; the kernel takes "
                        f"{' or '.join(str(d) for d in dtypes)} (cast the model first, e.g. "
                        f"model.to(torch.bfloat16))")


def _rms_norm_forward(self, x):
    from tk_mlir.kernels import rms_norm
    return rms_norm(x, self.weight, self.variance_epsilon)


def _linear_forward(self, x):
    from tk_mlir.kernels import matmul
    y = matmul(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
    return y if self.bias is None else y + self.bias


def _mlp_forward(self, x):
    from tk_mlir.kernels import swiglu
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


# Queries of at most this many new tokens (decoding, speculative decoding's
# drafts) take attention_with_kvcache: its tiles hold the query heads that
# share a K/V head, where attention's 64-row tiles would hold one row each.
DECODE_ROWS = 16


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               sliding_window=None, softcap=None, **kwargs):
    """transformers' attention interface: (B, H, N, D) in, (B, N, H, D) out.
    A layer's sliding_window W (keys i - W < j <= i, transformers' meaning:
    FlashAttention's window (W - 1, W - 1)) and its logit softcap (Gemma-2)
    are the kernels' window and softcap: no model's options are dropped."""
    import torch

    from tk_mlir.kernels import attention
    if attention_mask is not None:
        raise NotImplementedError("tk_mlir attention: a padding mask is not supported (causal "
                                  "batches without padding only)")
    if dropout:
        raise NotImplementedError("tk_mlir attention: attention dropout is not supported")
    causal = getattr(module, "is_causal", True)
    masks = dict(window=(-1, -1) if sliding_window is None else
                 (sliding_window - 1, sliding_window - 1), softcap=softcap or 0.0)
    if query.shape[2] <= DECODE_ROWS and not (torch.is_grad_enabled() and query.requires_grad):
        # Generation through the cache: a few new tokens over the whole cache
        # (every sequence holds all N_kv keys: no padding), GQA-packed.
        from tk_mlir.kernels import attention_with_kvcache
        B, n_kv = key.shape[0], key.shape[2]
        lengths = torch.full((B,), n_kv, dtype=torch.int32, device=key.device)
        return attention_with_kvcache(query.transpose(1, 2), key.transpose(1, 2),
                                      value.transpose(1, 2), lengths, causal=causal,
                                      scale=scaling, **masks), None
    o = attention(query, key, value, causal=causal, scale=scaling, **masks)
    return o.transpose(1, 2), None


def _register_attention() -> None:
    """"tk_mlir" as an attention implementation, with `_mask` as its mask
    function (no mask at all for causal batches without padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    AttentionInterface.register(ATTENTION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _mask)


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
          attention_mask=None, local_size=None, **kwargs):
    """No mask where the kernels' own causal mask is the model's: no padding,
    plain causal, the queries the last q_length of the kv_length keys
    (bottom-right aligned, as the kernels align it: a prefill, or decoding
    through a DynamicCache); otherwise sdpa's mask (which `_attention` refuses)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    plain = mask_function is None or mask_function is causal_mask_function
    if attention_mask is None and plain and local_size is None and \
            isinstance(q_offset, int) and isinstance(kv_offset, int) and \
            q_offset + q_length == kv_offset + kv_length:
        return None
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     attention_mask=attention_mask, local_size=local_size, **kwargs)


def _rotary(q, k, cos, sin, unsqueeze_dim=1):
    """apply_rotary_pos_emb on the kernel: q, k (B, H, N, D), cos and sin
    (B, N, D), their halves equal (Llama's); else transformers' own."""
    import torch
    from tk_mlir.kernels import rotary_embedding_qk
    half = q.shape[-1] // 2
    if unsqueeze_dim != 1 or cos.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16) or \
            k.dtype != q.dtype or q.shape[-1] % 16 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return _rotary.original(q, k, cos, sin, unsqueeze_dim)
    c, s = cos[..., :half].contiguous(), sin[..., :half].contiguous()
    if c.shape[0] == 1:
        c, s = c[0], s[0]                       # one set of positions for the batch
    q, k = rotary_embedding_qk(q.transpose(1, 2), k.transpose(1, 2), c, s)   # (one launch)
    return q.transpose(1, 2), k.transpose(1, 2)


def _causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None,
                    ignore_index: int = -100, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss on `cross_entropy`: labels shifted one to
    the left (the last position predicts nothing), summed and divided by
    num_items_in_batch when given, else the mean over the kept tokens."""
    from tk_mlir.kernels import cross_entropy
    logits = logits.reshape(-1, vocab_size)
    targets = _next_tokens(labels, shift_labels, ignore_index).to(logits.device)
    return _normalized(cross_entropy, num_items_in_batch, logits, targets=targets,
                       ignore_index=ignore_index)


def _next_tokens(labels, shift_labels, ignore_index: int):
    """The class each position predicts, flat: shift_labels, or labels
    shifted one to the left (the last position predicts nothing), as
    transformers' ForCausalLMLoss shifts them."""
    import torch
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    return shift_labels.reshape(-1)


def _normalized(loss_fn, num_items_in_batch, *args, targets, ignore_index: int = -100):
    """loss_fn's mean over the kept tokens, or its sum over num_items_in_batch
    when given (transformers' gradient-accumulation normalization), in f32
    as transformers reports it (the kernels' own reductions round to the
    inputs' dtype, as F.cross_entropy's do): the per-token losses summed in
    f32 on the GPU (no synchronisation)."""
    total = loss_fn(*args, targets, ignore_index=ignore_index, reduction="none").float().sum()
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    return total / num_items_in_batch


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                       **kwargs):
    """LlamaForCausalLM.forward, the loss by linear_cross_entropy from the
    last hidden states when training with labels (no logits); otherwise the
    class's own forward."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from tk_mlir.kernels import linear_cross_entropy
    if cache is not None:       # (not cache=None: it would hide a deprecated past_key_values)
        kwargs["cache"] = cache
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
                                  use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    targets = _next_tokens(labels, kwargs.get("shift_labels"), -100).to(hidden.device)
    loss_fn = functools.partial(linear_cross_entropy,
                                low_memory=getattr(self, "tk_mlir_low_memory_loss", False))
    loss = _normalized(loss_fn, kwargs.get("num_items_in_batch"),
                       hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                       targets=targets)
    # transformers >= 5.2x names the cache `cache`, earlier 5.x `past_key_values`
    name = "cache" if hasattr(outputs, "cache") else "past_key_values"
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions, **{name: getattr(outputs, name)})
