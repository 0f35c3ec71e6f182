"""linear_attention (tk_mlir/kernels/chunked_linear_attention.py): chunked
linear attention with a feature map, forward and backward.

Without a GPU: the kernels in the interpreter against a float64 loop that
runs the recurrence token by token, for odd N (not a multiple of the chunk),
each feature map, normalize on and off, not causal, initial and returned
states, D_v over several blocks, sequences cut into segments, and the
gradients of every input (the initial state's included); torch.compile;
the argument rules. With a GPU
(`-m gpu`): the same against float32 at training shapes.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import linear_attention  # noqa: E402

from torch_reference import assert_compiled_matches_eager  # noqa: E402
from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu
MAPS = {None: lambda x: x, "elu1": lambda x: torch.nn.functional.elu(x) + 1,
        "relu": torch.relu,
        "taylor2": lambda x: torch.cat((torch.ones_like(x[..., :1]), x,
                                        (x[..., :, None] * x[..., None, :]).flatten(-2)
                                        / math.sqrt(2)), -1)}


def recurrence(q, k, v, feature_map, causal, normalize, scale, s0=None, z0=None):
    """The definition, one token at a time (float64 on CPU tensors, or the
    inputs' dtype): (o, S, z)."""
    f = MAPS[feature_map]
    q, k = f(q * scale), f(k)
    B, N, H, DK = q.shape           # (DK: the feature dim)
    S = q.new_zeros(B, H, DK, v.shape[-1]) if s0 is None else s0.to(q.dtype)
    z = q.new_zeros(B, H, DK) if z0 is None else z0.to(q.dtype)
    if not causal:
        S = S + torch.einsum("bnhk,bnhv->bhkv", k, v)
        z = z + k.sum(1)
    outs = []
    for t in range(N):
        if causal:
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
            z = z + k[:, t]
        num = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        outs.append(num / ((q[:, t] * z).sum(-1, keepdim=True) + 1e-6) if normalize else num)
    return torch.stack(outs, 1), S, z


def _inputs(B, N, H, dk, dv, seed, device="cpu", state=False):
    g = torch.Generator().manual_seed(seed)
    q, k = ((torch.rand(B, N, H, dk, generator=g) - 0.5).to(bf16).to(device) for _ in range(2))
    v = (torch.rand(B, N, H, dv, generator=g) - 0.5).to(bf16).to(device)
    if not state:
        return q, k, v, None
    return q, k, v, (torch.rand(B, H, dk, dv, generator=g).to(device),
                     torch.rand(B, H, dk, generator=g).to(device))


def _check(q, k, v, state, feature_map, causal, normalize, tol, device_ref="cpu"):
    """Forward, returned state and every gradient against the recurrence in
    float64. dq with normalize gets 3x tol: the normaliser's two gradient
    terms (g·Sᵀ and e·zᵀ) nearly cancel, and each is a bf16 MMA's."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s_leaves = None if state is None else [t.clone().requires_grad_() for t in state]
    o, (s1, z1) = (linear_attention(*leaves, feature_map=feature_map, causal=True,
                                    normalize=normalize, initial_state=s_leaves,
                                    return_state=True) if causal else
                   (linear_attention(*leaves, feature_map=feature_map, causal=False,
                                     normalize=normalize), (None, None)))
    # drawn from its own generator: the same whatever ran before (the global one's
    # draws moved the initial state z's gradient error over 0.0004-0.0062)
    do = torch.rand(o.shape, generator=torch.Generator().manual_seed(o.numel())).to(o) - 0.5
    wanted = leaves + (s_leaves or [])
    if state is not None and not normalize:
        wanted = wanted[:4]                     # z never enters without the normaliser
    grads = torch.autograd.grad(o, wanted, do)
    ref_in = [t.detach().to(device_ref).double().requires_grad_()
              for t in leaves + (s_leaves or [])]
    ro, rs, rz = recurrence(*ref_in[:3], feature_map, causal, normalize,
                            1 / math.sqrt(q.shape[-1]), *ref_in[3:])
    ref_grads = torch.autograd.grad(ro, ref_in[:len(wanted)], do.to(device_ref).double())
    assert _rel(o.to(device_ref), ro) < tol
    if causal:
        assert _rel(s1.to(device_ref), rs) < tol and _rel(z1.to(device_ref), rz) < tol
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert _rel(got.to(device_ref), want) < (3 * tol if i == 0 and normalize else tol), i


@pytest.mark.parametrize("dk,dv,feature_map,causal,normalize,state", [
    (64, 64, "elu1", True, True, True),
    (128, 128, "relu", True, False, False),
    (64, 128, "elu1", False, True, False),      # D_v over two blocks
    (128, 64, None, False, False, False),
    (64, 256, "relu", True, True, False),       # four blocks share the normaliser's terms
    (64, 64, None, True, False, True),
])
def test_matches_the_recurrence_forward_and_backward(interpret, dk, dv, feature_map, causal,
                                                     normalize, state):
    q, k, v, s = _inputs(2, 150, 2, dk, dv, seed=dk + dv, state=state)   # 150: odd chunks
    _check(q, k, v, s, feature_map, causal, normalize, tol=1e-2)


@pytest.mark.parametrize("min_segment,dk,dv,feature_map,causal,normalize,state", [
    (1, 64, 64, "elu1", True, True, True),      # a segment per chunk, from the initial state
    (2, 128, 64, "relu", True, True, False),    # 5 chunks: segments of 3 and 2
    (1, 64, 128, "relu", True, False, True),    # D_v over two blocks (atomic dq, dk)
    (2, 64, 64, "elu1", False, True, False),    # not causal: every segment from the total
])
def test_a_sequence_cut_into_segments_matches_the_recurrence(interpret, monkeypatch,
                                                             min_segment, dk, dv, feature_map,
                                                             causal, normalize, state):
    """Segments (kernels/chunked_linear_attention.py `segment_length`): each
    walked by its own blocks from the state the segments before it sum to
    (the backward's reverse pass from the gradient of those after it)."""
    from tk_mlir.kernels import chunked_linear_attention as cla
    monkeypatch.setattr(cla, "MIN_SEGMENT", min_segment)
    q, k, v, s = _inputs(1, 300, 2, dk, dv, seed=dk + dv + min_segment, state=state)
    assert cla.segment_length(2 * dv // 64, 5, -1) < 5         # (several segments)
    _check(q, k, v, s, feature_map, causal, normalize, tol=1e-2)


def _compiled_kernels(dk: int, causal: bool, feature_map: str = "elu1") -> dict:
    """Each of linear_attention's kernels compiled for B4 H16 N16384, D_v 64,
    the normaliser (the most registers) and elu1 (or taylor2: dk is then q's
    16 columns' features), INITIAL where it applies."""
    import tk_mlir as tk
    from tk_mlir.kernels import chunked_linear_attention as cla
    from tk_mlir.kernels import taylor_linear_attention as taylor
    n, segs = 16384, 16
    width = taylor.WIDTH if feature_map == "taylor2" else dk
    q, v = tk.spec((4, 16, n, width), tk.bf16), tk.spec((4, 16, n, 64), tk.bf16)
    s, z = tk.spec((4, 16, segs * dk, 64), tk.f32), tk.spec((4, 16, segs * dk, 16), tk.f32)
    s1, z1 = tk.spec((4, 16, dk, 64), tk.f32), tk.spec((4, 16, dk, 16), tk.f32)
    # (taylor2's blocks take 32 columns of v: two add dq and dk into f32)
    dq = tk.spec((4, 16, n, width), tk.f32 if cla.v_block(feature_map) < 64 else tk.bf16)
    den = tk.spec((4, 16, 5, n), tk.f32)
    fx = (tk.spec((5, taylor.WIDTH, taylor.FEATURES), tk.bf16),)
    flags = dict(DK=dk, MAP=feature_map)
    grads = dict(DV=64, CAUSAL=causal, NORMALIZE=True, INITIAL=True, **flags)
    return {
        "forward": cla.linear_attention_kernel.compile(
            q, q, v, v, s, z, s1, z1, *fx, 0.1, 16, CAUSAL=causal, NORMALIZE=True,
            INITIAL=True, **flags),
        "sums": cla.linear_attention_segment_sums_kernel.compile(q, v, s, z, *fx, 16, **flags),
        "prefix": cla.linear_attention_segment_prefix_kernel.compile(
            s, z, s1, z1, s, z, s1, z1, segs, DK=dk, INITIAL=True, REVERSE=True),
        "grad sums": cla.linear_attention_segment_grad_sums_kernel.compile(
            q, v, den, s, z, *fx, 0.1, 16, NORMALIZE=True, **flags),
        "dq": cla.linear_attention_dq_kernel.compile(q, q, v, v, s, z, dq, den, *fx, 0.1, 16,
                                                      **grads),
        "dk dv": cla.linear_attention_dkdv_kernel.compile(q, q, v, v, s, z, dq, v, s1, z1, den,
                                                          *fx, 0.1, 16, **grads),
    }


@pytest.mark.parametrize("dk,feature_map,causal", [
    (64, "elu1", True), (128, "elu1", True), (192, "taylor2", True), (64, "elu1", False)])
def test_the_kernels_compile_without_spills_or_serialized_mmas(dk, feature_map, causal):
    """ptxas on each kernel (no GPU needed): no spill, no C75xx advisory (an
    MMA pipeline ptxas serialized). The D_k=64 loops keep the next chunk's
    loads in flight in registers, D_k=128's do not: it would spill. taylor2
    expands 16 columns into 192 features inside the kernels; its causal
    forward, dq and dk/dv kernels and its gradient sums spill, a known limit
    (its module's docstring; faster than the 32-column blocks that do not):
    they are held to what they spill at 64 columns, so that a change shows
    (BENCHMARKS.md, the wgmma descriptors' section: the gradient sums moved
    from 0 to 56 bytes, the other three down by 20-56). Unmasked, the loops
    are the causal ones less the mask: one size stands for them (ptxas takes
    ~30 s a taylor2 set on CI's two cores)."""
    limits = {"forward": 256, "grad sums": 64, "dq": 512, "dk dv": 640} \
        if feature_map == "taylor2" else {}
    for name, c in _compiled_kernels(dk, causal, feature_map).items():
        limit = limits.get(name, 0)
        assert c.info["spill stores (bytes)"] <= limit, (name, c.info)
        assert c.info["spill loads (bytes)"] <= limit, (name, c.info)
        assert "C75" not in c.ptxas_log, (name, c.ptxas_log)


def test_the_backward_makes_the_segment_starts_the_forward_kept(interpret, monkeypatch):
    """An eager backward takes the forward's segment starts; the custom op's
    (torch.compile's) makes them again: the same gradients, bit for bit."""
    from tk_mlir.kernels import chunked_linear_attention as cla
    monkeypatch.setattr(cla, "MIN_SEGMENT", 1)
    q, k, v, (s0, z0) = _inputs(1, 200, 2, 64, 64, seed=21, state=True)
    args = (s0, z0, "elu1", True, True, 0.125)
    (o, _, _), kept = cla.forward_and_starts(q, k, v, *args)
    assert kept is not None                                    # (segmented)
    do = torch.rand(o.shape, generator=torch.Generator().manual_seed(2)).to(o.dtype) - 0.5
    again = cla.backward(do, q, k, v, o, *args)
    for a, b in zip(cla.backward(do, q, k, v, o, *args, starts=kept), again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dk,dv,causal,normalize,state", [
    (16, 64, True, True, True),        # Based's: 273 features, three slices of 128
    (8, 128, False, True, False),
    (16, 64, True, False, False),
    (4, 64, True, True, False),        # 21 features, one slice
])
def test_taylor2_matches_the_recurrence_forward_and_backward(interpret, dk, dv, causal,
                                                             normalize, state):
    """feature_map="taylor2" (taylor_linear_attention.py): Based's features,
    the chunked kernels on 128-feature slices, the normaliser in f32."""
    from tk_mlir.kernels import taylor_linear_attention as taylor
    q, k, v, _ = _inputs(2, 90, 2, dk, dv, seed=dk + dv)
    s = None
    if state:
        g = torch.Generator().manual_seed(3)
        dphi = taylor.feature_dim(dk)
        s = (torch.rand(2, 2, dphi, dv, generator=g), torch.rand(2, 2, dphi, generator=g))
    _check(q, k, v, s, "taylor2", causal, normalize, tol=1e-2)


def test_taylor2_decoding_step_continues_the_recurrence(interpret):
    from tk_mlir.kernels import linear_attention_step
    q, k, v, _ = _inputs(1, 40, 2, 16, 64, seed=11)
    ro, rs, rz = recurrence(*(t.double() for t in (q, k, v)), "taylor2", True, True, 0.25)
    _, rs39, rz39 = recurrence(*(t[:, :39].double() for t in (q, k, v)), "taylor2", True,
                               True, 0.25)
    o, (s1, z1) = linear_attention_step(q[:, 39:], k[:, 39:], v[:, 39:],
                                        (rs39.float(), rz39.float()), "taylor2")
    assert _rel(o[:, 0], ro[:, 39]) < 1e-2
    # (the step runs the chunked kernels: the new token's features are bf16)
    assert _rel(s1, rs) < 1e-2 and _rel(z1, rz) < 1e-4


def test_taylor2_takes_head_dims_up_to_16():
    q, k, v, _ = _inputs(1, 8, 1, 32, 64, seed=1)
    with pytest.raises(ValueError, match=r"feature_map='taylor2' takes a q/k head dim D_k up "
                                         r"to 16 .*, got 32"):
        linear_attention(q, k, v, "taylor2")


def test_a_chunk_at_a_time_with_the_returned_state_is_the_whole_sequence(interpret):
    """Recurrent use: two calls, the second starting from the first's state,
    give the one call's output and state."""
    q, k, v, _ = _inputs(1, 192, 2, 64, 64, seed=3)
    o, (s, z) = linear_attention(q, k, v, "elu1", return_state=True)
    o1, state = linear_attention(q[:, :100], k[:, :100], v[:, :100], "elu1", return_state=True)
    o2, (s2, z2) = linear_attention(q[:, 100:], k[:, 100:], v[:, 100:], "elu1",
                                    initial_state=state, return_state=True)
    assert _rel(torch.cat((o1, o2), 1), o) < 5e-3
    assert _rel(s2, s) < 5e-3 and _rel(z2, z) < 1e-3


def test_compiled_matches_eager(interpret):
    q, k, v, state = _inputs(1, 70, 2, 64, 64, seed=4, state=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return linear_attention(q, k, v, "elu1", initial_state=state)

    assert_compiled_matches_eager(f, q, k, v)


@pytest.mark.parametrize("min_segment,dk,dv,feature_map,normalize,state", [
    (4, 64, 64, "elu1", True, True),        # one segment: the reverse walk starts from dS1
    (1, 64, 64, "relu", False, False),      # a segment per chunk: dS1 in the reverse prefix
    (1, 64, 128, None, True, True),         # D_v over two blocks
    (4, 16, 64, "taylor2", True, True),     # the compact basis's gradients, both ways
    (1, 12, 128, "taylor2", True, True),
])
def test_the_returned_state_is_differentiable(interpret, monkeypatch, min_segment, dk, dv,
                                              feature_map, normalize, state):
    """A loss through o and the final state (S, z), and through the state
    alone (as a chunked recurrence's next call would), against the float64
    recurrence: dS1 starts the reverse pass, dz1 adds to every φ(k) and z0.
    (taylor2's random initial state is not symmetric in (a, b): the part no
    query reads passes to the final state unchanged.)"""
    from tk_mlir.kernels import chunked_linear_attention as cla
    from tk_mlir.kernels import taylor_linear_attention as taylor
    monkeypatch.setattr(cla, "MIN_SEGMENT", min_segment)
    q, k, v, st = _inputs(1, 200, 2, dk, dv, seed=dv + min_segment)
    if state:
        g = torch.Generator().manual_seed(dk)
        dphi = taylor.feature_dim(dk) if feature_map == "taylor2" else dk
        st = (torch.rand(1, 2, dphi, dv, generator=g), torch.rand(1, 2, dphi, generator=g))
    leaves = [t.clone().requires_grad_() for t in (q, k, v) + (st or ())]
    o, (s1, z1) = linear_attention(*leaves[:3], feature_map=feature_map, normalize=normalize,
                                   initial_state=leaves[3:] or None, return_state=True)
    g = torch.Generator().manual_seed(7)
    do, ds, dz = (torch.rand(t.shape, generator=g) - 0.5 for t in (o, s1, z1))
    ref_in = [t.detach().double().requires_grad_() for t in leaves]
    ro, rs, rz = recurrence(*ref_in[:3], feature_map, True, normalize, 1 / math.sqrt(dk),
                            *ref_in[3:])
    wanted = len(leaves)                    # (q: no path to the state)
    for loss, ref_loss in (((o.float() * do).sum() + (s1 * ds).sum() + (z1 * dz).sum(),
                            (ro * do).sum() + (rs * ds).sum() + (rz * dz).sum()),
                           ((s1 * ds).sum() + (z1 * dz).sum(), (rs * ds).sum() + (rz * dz).sum())):
        got = torch.autograd.grad(loss, leaves[1:wanted], retain_graph=True)
        want = torch.autograd.grad(ref_loss, ref_in[1:wanted], retain_graph=True)
        for i, (a, b) in enumerate(zip(got, want)):
            assert _rel(a, b) < 1e-2, i


def test_a_compiled_function_may_return_the_state(interpret):
    """torch.compile hands every output a gradient (zeros where no loss used
    it): returning the state from a compiled function trains through o."""
    q, k, v, _ = _inputs(1, 100, 2, 64, 64, seed=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fn(q, k, v):
        return linear_attention(q, k, v, "elu1", return_state=True)
    o, (s1, z1) = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
    got = torch.autograd.grad(o.float().sum(), leaves)
    want = torch.autograd.grad(linear_attention(*leaves, "elu1").float().sum(), leaves)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-3


def test_bad_arguments_are_refused_with_the_rule():
    q, k, v, state = _inputs(1, 8, 2, 64, 64, seed=6, state=True)
    cases = [
        (dict(q=q[..., :32], k=k[..., :32]), ValueError, r"D_k must be 64 or 128, got 32"),
        (dict(v=torch.cat((v, v[..., :32]), -1)), ValueError,
         r"D_v must be 64, 128 or 256, got 96"),
        (dict(k=k[:, :4]), ValueError, r"k must have shape \(1, 8, 2, 64\)"),
        (dict(feature_map="taylor3"), ValueError, r"feature_map must be one of"),
        (dict(q=q[..., :16], k=k[..., :16], feature_map="Taylor2"), ValueError,
         r"feature_map must be one of"),          # named, not taken for a head dim error
        (dict(normalize=1), TypeError, r"normalize must be a bool"),
        (dict(initial_state=state, causal=False), ValueError, r"causal=True only"),
        (dict(initial_state=(state[0].double(), state[1])), TypeError,
         r"initial_state S must be torch.float32"),
        (dict(initial_state=(state[0], state[1][:, :1])), ValueError,
         r"initial_state z must have shape \(1, 2, 64\)"),
        (dict(v=v.float()), TypeError, r"v must be torch.bfloat16 or torch.float16"),
    ]
    for change, error, message in cases:
        args = dict(q=q, k=k, v=v, feature_map=None)
        args.update(change)
        with pytest.raises(error, match=message):
            linear_attention(**args)


# ------------------------------------------------------------------ GPU

@gpu
@pytest.mark.parametrize("dk,dv,feature_map,causal,normalize", [
    (128, 128, "elu1", True, True), (64, 64, "relu", False, True),
    (128, 64, None, True, False), (64, 128, "elu1", True, False)])
def test_gpu_matches_the_recurrence(dk, dv, feature_map, causal, normalize):
    q, k, v, s = _inputs(2, 1000, 4, dk, dv, seed=dk, device="cuda", state=causal)
    _check(q, k, v, s, feature_map, causal, normalize, tol=1e-2, device_ref="cuda")


@gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_taylor2_matches_the_recurrence(causal):
    q, k, v, _ = _inputs(2, 1000, 4, 16, 64, seed=16, device="cuda")
    _check(q, k, v, None, "taylor2", causal, True, tol=1e-2, device_ref="cuda")


# ------------------------------------------------------------------ decode

@pytest.mark.parametrize("dk,dv,feature_map,normalize", [(64, 128, "elu1", True),
                                                         (128, 64, None, False),
                                                         (64, 64, "relu", True)])
def test_a_decoding_step_continues_the_recurrence(interpret, dk, dv, feature_map, normalize):
    """Steps after a prompt's state give the recurrence's next outputs and
    states (in f32: no bf16 state on this path)."""
    from tk_mlir.kernels import linear_attention_step
    q, k, v, _ = _inputs(2, 70, 3, dk, dv, seed=dk + dv)
    _, state = linear_attention(q[:, :67], k[:, :67], v[:, :67], feature_map,
                                normalize=normalize, return_state=True)
    ro, rs, rz = recurrence(*(t.double() for t in (q, k, v)), feature_map, True, normalize,
                            1 / math.sqrt(dk))
    _, rs67, rz67 = recurrence(*(t[:, :67].double() for t in (q, k, v)), feature_map, True,
                               normalize, 1 / math.sqrt(dk))
    state = (rs67.float(), rz67.float())       # start exactly where the recurrence is
    for t in range(67, 70):
        o, state = linear_attention_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], state,
                                         feature_map, normalize=normalize)
        assert o.shape == (2, 1, 3, dv) and o.dtype == bf16
        assert _rel(o[:, 0], ro[:, t]) < 1e-2
    assert _rel(state[0], rs) < 1e-5 and _rel(state[1], rz) < 1e-5


def test_a_decoding_step_takes_one_token_and_a_state():
    from tk_mlir.kernels import linear_attention_step
    q, k, v, state = _inputs(1, 2, 2, 64, 64, seed=7, state=True)
    with pytest.raises(ValueError, match=r"one new token: \(B, 1, H, D\), got \(1, 2, 2, 64\)"):
        linear_attention_step(q, k, v, state)
    with pytest.raises(TypeError, match=r"state must be \(S, z\)"):
        linear_attention_step(q[:, :1], k[:, :1], v[:, :1], state[0])
    with pytest.raises(ValueError, match=r"linear_attention_step: state S must have shape"):
        linear_attention_step(q[:, :1], k[:, :1], v[:, :1], (state[0][:, :1], state[1]))


def test_a_decoding_step_warns_of_an_input_that_requires_grad(interpret):
    from tk_mlir.kernels import linear_attention_step
    q, k, v, state = _inputs(1, 1, 2, 64, 64, seed=9, state=True)
    with pytest.warns(UserWarning, match="linear_attention_step returns no gradient"):
        linear_attention_step(q.requires_grad_(), k, v, state)


@gpu
def test_gpu_decoding_step_matches_the_recurrence():
    from tk_mlir.kernels import linear_attention_step
    q, k, v, state = _inputs(4, 1, 16, 128, 256, seed=9, device="cuda", state=True)
    o, (s1, z1) = linear_attention_step(q, k, v, state, "elu1")
    ro, rs, rz = recurrence(*(t.double() for t in (q, k, v)), "elu1", True, True,
                            1 / math.sqrt(128), *(t.double() for t in state))
    assert _rel(o, ro) < 1e-2 and _rel(s1, rs) < 1e-5 and _rel(z1, rz) < 1e-5


def test_strided_views_of_a_fused_projection_and_f16(interpret):
    """q, k, v cut from one (B, N, H·(2 D_k + D_v)) projection (strided views,
    as a model hands them), in f16."""
    g = torch.Generator().manual_seed(11)
    qkv = (torch.rand(1, 100, 2 * (64 + 64 + 128), generator=g) - 0.5).to(torch.float16)
    q, k, v = qkv.view(1, 100, 2, 256).split([64, 64, 128], dim=-1)
    _check(q, k, v, None, "elu1", True, True, tol=1e-2)


def test_the_ops_fakes_match_what_they_return(interpret):
    """torch.compile (Inductor) checks each op's outputs against its fake,
    strides included: the forward, backward and step ops, with a strided
    initial state."""
    from tk_mlir.kernels import custom_ops  # noqa: F401  registers the ops
    q, k, v, (s0, z0) = _inputs(1, 70, 2, 64, 128, seed=12, state=True)
    s0 = s0.transpose(2, 3).contiguous().transpose(2, 3)          # not contiguous
    ops = torch.ops.tk_mlir
    o, _, _ = ops.linear_attention(q, k, v, s0, z0, "elu1", True, True, 0.125)
    cases = [(ops.linear_attention.default, (q, k, v, s0, z0, "elu1", True, True, 0.125)),
             (ops.linear_attention_backward.default,
              (torch.rand_like(o), q, k, v, o, s0, z0, "elu1", True, True, 0.125)),
             (ops.linear_attention_backward.default,
              (torch.rand_like(o), q, k, v, o, None, None, "relu", False, True, 0.125)),
             (ops.linear_attention_step.default,
              (q[:, :1], k[:, :1], v[:, :1], s0, z0, "elu1", True, 0.125))]
    # taylor2: q, k of 12 columns (padded to 16 inside), a state of 1 + 12 + 144 features
    q, k, v, _ = _inputs(1, 70, 2, 12, 64, seed=13)
    g = torch.Generator().manual_seed(14)
    s0, z0 = torch.rand(1, 2, 157, 64, generator=g), torch.rand(1, 2, 157, generator=g)
    o, _, _ = ops.linear_attention(q, k, v, s0, z0, "taylor2", True, True, 0.25)
    cases += [(ops.linear_attention.default, (q, k, v, s0, z0, "taylor2", True, True, 0.25)),
              (ops.linear_attention_backward.default,
               (torch.rand_like(o), q, k, v, o, s0, z0, "taylor2", True, True, 0.25,
                torch.rand_like(s0), torch.rand_like(z0)))]
    for op, args in cases:
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_taylor2_with_no_tokens_returns_the_state_it_was_given(interpret):
    bf = torch.bfloat16
    q, k, v = torch.randn(1, 0, 2, 4).to(bf), torch.randn(1, 0, 2, 4).to(bf), \
        torch.randn(1, 0, 2, 64).to(bf)
    o, (s, z) = linear_attention(q, k, v, "taylor2", return_state=True)
    assert o.shape == (1, 0, 2, 64) and s.shape == (1, 2, 21, 64) and not z.any()


def test_taylor2_in_f16_does_not_overflow_on_long_sequences(interpret):
    """The unnormalised numerators pass 65504 here (145 per token): the
    kernels sum them in f32 and divide before o is stored in f16."""
    q = torch.full((1, 600, 1, 16), 2.0, dtype=torch.float16)
    v = torch.ones(1, 600, 1, 64, dtype=torch.float16)
    o = linear_attention(q, q, v, "taylor2")
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert (o.float() - 1).abs().max() < 1e-2


def test_the_ops_take_taylor2_and_check_the_backward_gradients(interpret):
    """torch.ops.tk_mlir.* called directly: linear_attention with taylor2 is
    the wrapper's (the kernels expand the features); the step op refuses it
    by name (the wrapper steps through the chunked kernels), not a compile
    error inside; the backward op checks do and o, and takes an f32 do."""
    from tk_mlir.kernels import chunked_linear_attention as cla
    ops, bf = torch.ops.tk_mlir, torch.bfloat16
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 40, 2, 16, generator=g).to(bf) for _ in range(2))
    v = torch.randn(1, 40, 2, 64, generator=g).to(bf)
    o, s1, z1 = ops.linear_attention(q, k, v, None, None, "taylor2", True, True, 0.25)
    want, (ws, wz) = cla.linear_attention(q, k, v, "taylor2", scale=0.25, return_state=True)
    assert torch.equal(o, want) and torch.equal(s1, ws) and torch.equal(z1, wz)
    assert s1.shape == (1, 2, 273, 64) and z1.shape == (1, 2, 273)
    s, z = torch.randn(1, 2, 273, 64), torch.rand(1, 2, 273)
    with pytest.raises(ValueError, match="'taylor2' runs as tk_mlir.kernels.linear_attention_"):
        ops.linear_attention_step(q[:, :1], k[:, :1], v[:, :1], s, z, "taylor2", True, 0.25)
    q, k = (torch.randn(1, 40, 2, 64, generator=g).to(bf) for _ in range(2))
    o, _, _ = ops.linear_attention(q, k, v, None, None, "elu1", True, True, 0.125)
    do = torch.randn(o.shape, generator=g)
    grads = ops.linear_attention_backward(do, q, k, v, o, None, None, "elu1", True, True, 0.125)
    want = ops.linear_attention_backward(do.to(bf), q, k, v, o, None, None, "elu1", True, True,
                                         0.125)
    for a, b in zip(grads[:3], want[:3]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="do must have shape"):
        ops.linear_attention_backward(do[:, :20], q, k, v, o, None, None, "elu1", True, True,
                                      0.125)


@pytest.mark.parametrize("feature_map,d", [("taylor2", 16), ("elu1", 64)])
def test_misaligned_views_of_a_projection_are_read_through_copies(interpret, feature_map, d):
    """q and k sliced from a wider projection at an offset that is not a
    16-byte multiple: the kernels get aligned copies (the same numbers as
    contiguous inputs), forward and backward."""
    g = torch.Generator().manual_seed(31)
    base = (torch.rand(1, 70, 2, 2 * d + 8, generator=g) - 0.5).to(bf16)
    q, k = base[..., 4:4 + d], base[..., 4 + d:4 + 2 * d]
    v = (torch.rand(1, 70, 2, 64, generator=g) - 0.5).to(bf16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    views = [base.clone().requires_grad_(), v.clone().requires_grad_()]
    o = linear_attention(*leaves, feature_map)
    o_view = linear_attention(views[0][..., 4:4 + d], views[0][..., 4 + d:4 + 2 * d], views[1],
                              feature_map)
    assert torch.equal(o, o_view)
    do = torch.rand(o.shape, generator=g).to(o.dtype)
    dq, dk, dv = torch.autograd.grad(o, leaves, do)
    dbase, dv_view = torch.autograd.grad(o_view, views, do)
    assert torch.equal(dbase[..., 4:4 + d], dq) and torch.equal(dbase[..., 4 + d:4 + 2 * d], dk)
    assert torch.equal(dv, dv_view)


def test_taylor2_state_maps(interpret):
    """The compact basis's maps (taylor_linear_attention): with no token the
    state comes back bit for bit; the backward op's state gradients are
    contiguous whatever the layout of the final state's gradient (its fake
    says so)."""
    import tk_mlir.kernels.custom_ops  # noqa: F401  registers torch.ops.tk_mlir
    g = torch.Generator().manual_seed(32)
    q, k = (torch.rand(1, 0, 2, 12, generator=g).to(bf16) for _ in range(2))
    v = torch.rand(1, 0, 2, 64, generator=g).to(bf16)
    s0, z0 = torch.randn(1, 2, 157, 64, generator=g), torch.randn(1, 2, 157, generator=g)
    _, (s1, z1) = linear_attention(q, k, v, "taylor2", initial_state=(s0, z0), return_state=True)
    assert torch.equal(s1, s0) and torch.equal(z1, z0)
    q, k, v, _ = _inputs(1, 70, 2, 12, 64, seed=33)
    ops = torch.ops.tk_mlir
    o, _, _ = ops.linear_attention(q, k, v, s0, z0, "taylor2", True, True, 0.25)
    ds1 = torch.rand(1, 2, 64, 157, generator=g).transpose(-1, -2)      # not contiguous
    args = (torch.rand_like(o), q, k, v, o, s0, z0, "taylor2", True, True, 0.25, ds1,
            torch.rand(1, 2, 157, generator=g))
    result = torch.library.opcheck(ops.linear_attention_backward.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result
    ds0 = ops.linear_attention_backward(*args)[3]
    assert ds0.is_contiguous()
