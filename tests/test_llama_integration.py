"""tk_mlir.integrations.patch_llama on a small transformers Llama: on CPU
tensors every kernel (forward and backward) runs in the interpreter, so CI
checks that the patched model computes the loss and gradients of the
unpatched one (float32) within bf16's rounding.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tk_mlir.integrations import patch_llama  # noqa: E402
from torch_reference import relative_error  # noqa: E402


def _cache_of(out):
    """The output's KV cache: `cache` in transformers >= 5.2x, `past_key_values` before."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _tiny_llama(vocab: int = 256):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
        attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("training, vocab, lce", [(False, 256, True), (True, 256, True),
                                                  (True, 250, True), (True, 1000, "low_memory")])
def test_patched_llama_trains_like_transformers(interpreted, monkeypatch, training, vocab, lce):
    """Eval mode: the logits and cross_entropy; training: the loss by
    linear_cross_entropy from the hidden states, no logits (a vocabulary
    that is not a multiple of 8 too, as GPT-2's; with "low_memory", in
    slices of 256 classes)."""
    from tk_mlir.kernels import losses
    modes = []
    slices = losses._slices
    monkeypatch.setattr(losses, "_slices", lambda h, v, low: modes.append(low) or slices(h, v, low))
    reference = _tiny_llama(vocab).train(training)
    model = copy.deepcopy(reference).to(torch.bfloat16)
    patch_llama(model, linear_cross_entropy=lce)
    assert model.config._attn_implementation == "tk_mlir"
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(input_ids=ids, labels=labels)
    loss = out.loss
    assert (out.logits is None) == training
    assert loss.dtype == torch.float32          # as transformers reports it, not bf16 steps
    ref_loss = reference(input_ids=ids, labels=labels).loss
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    loss.backward()
    ref_loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
        assert relative_error(p.grad, q.grad) < 5e-2, name
    assert set(modes) == ({lce == "low_memory"} if training else set())


def test_linear_cross_entropy_takes_a_bool_or_low_memory():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="patch_llama: linear_cross_entropy is a bool or "
                                         "'low_memory', got 'low'"):
        patch_llama(model, linear_cross_entropy="low")
    assert model.config._attn_implementation == "eager"


def test_layers_the_kernels_do_not_take_are_refused_before_any_change():
    model = _tiny_llama()                                   # float32
    forward = model.model.norm.forward
    with pytest.raises(TypeError, match=r"patch_llama: model.layers.0.self_attn.q_proj's weight "
                                        r"is torch.float32"):
        patch_llama(model)
    assert model.model.norm.forward == forward and model.config._attn_implementation == "eager"
    with pytest.raises(TypeError, match=r"unknown parts \['flash'\]"):
        patch_llama(model, flash=True)
    # without the Linear and norm parts: attention and the MLP still need 16-bit layers
    mlp = model.model.layers[0].mlp.forward
    with pytest.raises(TypeError, match=r"model.layers.0.self_attn.q_proj's weight"):
        patch_llama(model, linear=False, rms_norm=False, linear_cross_entropy=False)
    assert model.model.layers[0].mlp.forward == mlp
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("field, value, part, rule", [
    ("head_dim", 32, "attention", "64, 128 or 256"),
    ("hidden_size", 132, "rms_norm", "a multiple of 8")])
def test_sizes_the_kernels_do_not_take_are_refused_before_any_change(field, value, part, rule):
    """The config's field and the rule, before any layer is patched; the
    part turned off, the others patch."""
    model = _tiny_llama().to(torch.bfloat16)
    setattr(model.config, field, value)
    forward = model.model.norm.forward
    with pytest.raises(ValueError, match=rf"patch_llama: {part} takes config.{field} {rule}, "
                                         rf"got {value} \(or pass {part}=False\)"):
        patch_llama(model)
    assert model.model.norm.forward == forward and model.config._attn_implementation == "eager"
    patch_llama(model, **{part: False})


@pytest.mark.parametrize("how", ["gradient checkpointing", "torch.compile"])
def test_patched_llama_under_checkpointing_and_compile(interpreted, how):
    """The training step's loss and gradients with gradient checkpointing
    (the layers' forwards run again in the backward) and under
    torch.compile(fullgraph=True) (every kernel an op in one graph)."""
    reference = _tiny_llama().train()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    patch_llama(model)
    step = model
    if how == "gradient checkpointing":
        model.gradient_checkpointing_enable()
        model.train()
    else:
        step = torch.compile(model, fullgraph=True)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    loss = step(input_ids=ids, labels=ids).loss
    ref_loss = reference(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    loss.backward()
    ref_loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert relative_error(p.grad, q.grad) < 5e-2, name


def test_patched_llama_generates_through_its_cache(interpreted, monkeypatch):
    """Prefill by `attention`, then decode steps of 1 and 3 new tokens through
    transformers' DynamicCache by `attention_with_kvcache`: each step's logits
    against the float32 model's on the whole sequence so far."""
    from tk_mlir.kernels import decode_attention
    decode_steps = []
    real = decode_attention.planned
    monkeypatch.setattr(decode_attention, "planned",
                        lambda q, *a, **k: decode_steps.append(q.shape[1]) or real(q, *a, **k))
    reference = _tiny_llama()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    patch_llama(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 40), generator=g)
    steps = [torch.randint(0, 256, (2, n), generator=g) for n in (1, 3)]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, seen = _cache_of(out), ids
        for new in steps:
            out = model(input_ids=new, past_key_values=cache, use_cache=True)
            seen = torch.cat([seen, new], 1)
            ref = reference(input_ids=seen).logits[:, -new.shape[1]:]
            assert relative_error(out.logits, ref) < 2e-2
            cache = _cache_of(out)
    assert decode_steps == [1, 3]                 # one layer, two steps: the KV-cache kernel


def test_the_attention_implementation_keeps_gemma2s_softcap_and_window(interpreted):
    """"tk_mlir" as a Gemma-2's attention implementation: its logit softcap
    and sliding window reach the kernels (the logits of the float32 model),
    and a sequence longer than the window, whose sliding layers get a mask,
    is refused rather than computed without it."""
    from tk_mlir.integrations.llama import _register_attention
    config = transformers.Gemma2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=32,
        attn_logit_softcapping=1.0, final_logit_softcapping=None, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in reference.model.layers:       # scores well past the cap
            layer.self_attn.q_proj.weight *= 40
    model = copy.deepcopy(reference).to(torch.bfloat16)
    _register_attention()
    model.config._attn_implementation = "tk_mlir"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, 24), generator=g)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
        assert relative_error(got, want) < 3e-2
        uncapped = copy.deepcopy(reference)
        uncapped.config.attn_logit_softcapping = None
        for layer in uncapped.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert relative_error(uncapped(input_ids=ids).logits, want) > 0.2   # the cap matters
        with pytest.raises(NotImplementedError, match="a padding mask is not supported"):
            model(input_ids=torch.randint(0, 256, (1, 40), generator=g))
