"""The library's kernels as torch custom ops (tk_mlir/kernels/custom_ops.py).

Without a GPU: the ops' schemas, their fake implementations (shapes, dtypes,
strides) on fake CUDA tensors, Dynamo tracing the public wrappers into one
graph of tk_mlir ops (torch.export, strict: any graph break fails), and the
autograd wiring of attention, run on meta tensors with the backward kernel
replaced by a recorder. With one (`-m gpu`): torch.compile(fullgraph=True)
against eager, torch.library.opcheck, and attention's gradients against a
float32 softmax reference.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from tk_mlir.kernels import attention, layer_norm, matmul, rms_norm  # noqa: E402

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
gpu = pytest.mark.gpu


def test_ops_are_registered_with_their_schemas():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    schemas = {name: str(getattr(torch.ops.tk_mlir, name).default._schema)
               for name in ("matmul", "grouped_matmul", "scaled_matmul", "rms_norm",
                            "layer_norm", "attention")}
    assert schemas == {
        "matmul": 'tk_mlir::matmul(Tensor a, Tensor b, str b_layout="nk", '
                  'ScalarType? out_dtype=None) -> Tensor',
        "grouped_matmul": 'tk_mlir::grouped_matmul(Tensor a, Tensor b, Tensor sizes, '
                          'str b_layout="nk", ScalarType? out_dtype=None) -> Tensor',
        "scaled_matmul": "tk_mlir::scaled_matmul(Tensor a, Tensor b, Tensor scale_a, "
                         "Tensor scale_b, ScalarType out_dtype) -> Tensor",
        "rms_norm": "tk_mlir::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
        "layer_norm": "tk_mlir::layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) "
                      "-> Tensor",
        "attention": "tk_mlir::attention(Tensor q, Tensor k, Tensor v, bool causal, "
                     "float scale, bool deterministic=False, SymInt left=-1, SymInt right=-1, "
                     "float softcap=0.) -> (Tensor, Tensor)",
    }
    # Functional: no argument is written, no output aliases an input.
    for name in schemas:
        schema = getattr(torch.ops.tk_mlir, name).default._schema
        assert not schema.is_mutable
        assert all(a.alias_info is None for a in (*schema.arguments, *schema.returns))


def test_grouped_matmul_fake_says_the_result():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, b = torch.empty(3, 16, 64, dtype=bf16), torch.empty(3, 64, 32, dtype=bf16)
        out = torch.ops.tk_mlir.grouped_matmul(a, b, torch.empty(3, dtype=torch.int64), "kn", f32)
    assert out.shape == (3, 16, 32) and out.dtype == f32


def test_resolving_a_name_with_torch_loaded_registers_the_ops(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import torch\nfrom tk_mlir.kernels import matmul\n"
            "print(hasattr(torch.ops.tk_mlir, 'attention'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root),
                               "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def _fake_cuda(*shape, dtype=bf16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def test_fake_tensors_on_cuda_need_no_gpu():
    """The premise of the fake tests below: FakeTensorMode makes CUDA tensors
    on a machine without CUDA."""
    with FakeTensorMode():
        assert _fake_cuda(2, 3).device.type == "cuda"


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("out_dtype", [None, f32, f16])
def test_matmul_fake(layout, out_dtype):
    with FakeTensorMode():
        a = _fake_cuda(100, 64, dtype=f16)
        b = _fake_cuda(*((48, 64) if layout == "nk" else (64, 48)), dtype=f16)
        c = torch.ops.tk_mlir.matmul(a, b, layout, out_dtype)
        assert (c.shape, c.dtype, c.stride(), c.device.type) == \
            ((100, 48), out_dtype or f16, (48, 1), "cuda")


def test_norms_fake():
    with FakeTensorMode():
        x, w = _fake_cuda(7, 300), _fake_cuda(300)
        for y in (torch.ops.tk_mlir.rms_norm(x, w, 1e-6),
                  torch.ops.tk_mlir.layer_norm(x, w, w, 1e-5)):
            assert (y.shape, y.dtype, y.stride(), y.device.type) == ((7, 300), bf16, (300, 1),
                                                                     "cuda")


@pytest.mark.parametrize("strided", [False, True])
def test_attention_fake_lays_o_out_like_q(strided):
    with FakeTensorMode():
        if strided:     # (B, H, N, D) views of a (B, N, H, D) projection
            q = _fake_cuda(2, 333, 8, 64, dtype=f16).transpose(1, 2)
        else:
            q = _fake_cuda(2, 8, 333, 64, dtype=f16)
        k = v = _fake_cuda(2, 2, 100, 64, dtype=f16)
        o, lse = torch.ops.tk_mlir.attention(q, k, v, True, 0.125)
        assert (o.shape, o.dtype, o.stride()) == (q.shape, f16, q.stride())
        # lse's rows padded to whole 16-byte vectors, as the kernels read them
        assert (lse.shape, lse.dtype, lse.stride()) == ((2, 8, 333), f32, (8 * 336, 336, 1))
        assert o.device.type == lse.device.type == "cuda"


class _Model(torch.nn.Module):
    def forward(self, x, w, b, q, k, v):
        h = layer_norm(rms_norm(x, w), w, b)
        c = matmul(h, x)
        o, lse = attention(q, k, v, causal=True, return_lse=True)
        return c, o, lse


def test_dynamo_traces_the_wrappers_into_one_graph_of_ops():
    """torch.export with strict=True traces with Dynamo and fails on a graph
    break: the wrappers' checks run on the fake tensors, the launches stay
    inside the ops. (The wrappers' out= arguments are copied into under
    tracing; a CPU build of torch cannot copy_ fake CUDA tensors, so the GPU
    test below checks that path.)"""
    with FakeTensorMode():
        args = (_fake_cuda(64, 128), _fake_cuda(128), _fake_cuda(128),
                _fake_cuda(2, 333, 4, 64).transpose(1, 2), _fake_cuda(2, 2, 333, 64),
                _fake_cuda(2, 2, 333, 64))
        graph = torch.export.export(_Model(), args, strict=True).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("tk_mlir.")] == [
        "tk_mlir.rms_norm.default", "tk_mlir.layer_norm.default", "tk_mlir.matmul.default",
        "tk_mlir.attention.default"]


def test_argument_errors_are_the_wrappers_under_tracing_too():
    with FakeTensorMode():
        q = _fake_cuda(2, 8, 64, 64)
        with pytest.raises(ValueError, match="must divide the query heads"):
            attention(q, _fake_cuda(2, 3, 64, 64), _fake_cuda(2, 3, 64, 64))


# ------------------------------------------------- attention's autograd wiring

@pytest.fixture
def recorded_backward(monkeypatch):
    """The backward op (torch.ops.tk_mlir.attention_backward, which the
    autograd formula calls) replaced by a recorder of its arguments (the real
    one runs on the GPU)."""
    calls = []

    def record(do, q, k, v, o, lse, causal, scale, dlse=None):
        calls.append(dict(do=do, q=q, k=k, v=v, o=o, lse=lse, causal=causal, scale=scale,
                          dlse=dlse))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    from tk_mlir.kernels import custom_ops
    monkeypatch.setattr(custom_ops, "attention_backward", record)
    return calls


def _meta_qkv(requires_grad=True):
    """Meta tensors: autograd runs on them on a CPU-only torch (fake CUDA
    tensors abort in the autograd engine there); the op's fake implementation
    is its meta kernel. The wrappers want CUDA, so these tests call the op."""
    def t(*shape):
        return torch.empty(*shape, dtype=bf16, device="meta").requires_grad_(requires_grad)
    return t(1, 4, 128, 64), t(1, 2, 96, 64), t(1, 2, 96, 64)


def test_attention_backward_gets_the_forward_tensors(recorded_backward):
    q, k, v = _meta_qkv()
    o, lse = torch.ops.tk_mlir.attention(q, k, v, True, 0.3)
    assert o.requires_grad
    dq, dk, dv = torch.autograd.grad(o.sum(), (q, k, v))
    (call,) = recorded_backward
    assert call["q"].shape == q.shape and call["k"].shape == k.shape
    assert (call["o"].shape, call["lse"].shape, call["lse"].dtype) == \
        (q.shape, (1, 4, 128), f32)
    assert (call["causal"], call["scale"]) == (True, 0.3)
    assert call["do"].shape == q.shape and 0 not in call["do"].stride()   # no expanded dO
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_a_loss_through_lse_hands_the_backward_its_gradient(recorded_backward):
    q, k, v = _meta_qkv()
    o, lse = torch.ops.tk_mlir.attention(q, k, v, False, 0.125)
    torch.autograd.grad(o.sum(), (q,), retain_graph=True)                    # lse unused
    torch.autograd.grad(o.sum() + lse.detach().sum(), (q,), retain_graph=True)
    torch.autograd.grad(lse.sum(), (q,))                                     # o unused
    first, second, third = recorded_backward
    assert first["dlse"] is None and second["dlse"] is None
    assert third["dlse"].shape == lse.shape and third["do"].shape == o.shape


def test_no_grad_inputs_build_no_graph():
    o, lse = torch.ops.tk_mlir.attention(*_meta_qkv(requires_grad=False), False, 0.125)
    assert not o.requires_grad and o.grad_fn is None


# ------------------------------------------------------------------- on the GPU

def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _gpu_inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)
    return rnd


@gpu
def test_torch_compile_fullgraph_matches_eager():
    rnd = _gpu_inputs(0)
    x, w, b = rnd(256, 512), rnd(512), rnd(512)
    wt = rnd(384, 512)
    q = rnd(2, 333, 8, 128).transpose(1, 2)          # strided, like a projection's view
    k, v = rnd(2, 2, 333, 128), rnd(2, 2, 333, 128)
    y = torch.empty(256, 384, device="cuda", dtype=f32)

    def f(x, w, b, wt, q, k, v, y):
        h = layer_norm(rms_norm(x, w), w, b)
        c = matmul(h, wt)
        matmul(h, wt, y)
        o, lse = attention(q, k, v, causal=True, return_lse=True)
        return c, o, lse

    eager = f(x, w, b, wt, q, k, v, y)
    y_eager = y.clone()
    y.zero_()
    compiled = torch.compile(f, fullgraph=True)(x, w, b, wt, q, k, v, y)
    torch.cuda.synchronize()
    for e, c in zip(eager, compiled):
        assert c.shape == e.shape and c.dtype == e.dtype and c.stride() == e.stride()
        assert torch.equal(c, e)          # the same kernels on the same inputs
    assert torch.equal(y, y_eager)


def _opcheck(op, args, utils=None):
    kwargs = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(op, args, **kwargs)


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_opcheck_matmul(layout):
    import tk_mlir.kernels.custom_ops  # noqa: F401
    rnd = _gpu_inputs(1)
    a = rnd(200, 64)
    b = rnd(*((136, 64) if layout == "nk" else (64, 136)))
    _opcheck(torch.ops.tk_mlir.matmul.default, (a, b, layout, None))
    _opcheck(torch.ops.tk_mlir.matmul.default, (a, b, layout, f32))


@gpu
def test_opcheck_norms():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    rnd = _gpu_inputs(2)
    x, w, b = rnd(33, 320), rnd(320), rnd(320)     # rows of whole 16-byte vectors
    _opcheck(torch.ops.tk_mlir.rms_norm.default, (x, w, 1e-6))
    _opcheck(torch.ops.tk_mlir.layer_norm.default, (x, w, b, 1e-5))


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_attention(causal):
    """Schema, fake implementation and autograd registration (not the AOT
    tests: they differentiate lse too, which the op refuses)."""
    import tk_mlir.kernels.custom_ops  # noqa: F401
    rnd = _gpu_inputs(3)
    q = rnd(2, 4, 200, 64).requires_grad_()
    k, v = rnd(2, 2, 150, 64).requires_grad_(), rnd(2, 2, 150, 64).requires_grad_()
    _opcheck(torch.ops.tk_mlir.attention.default, (q, k, v, causal, 0.125),
             ("test_schema", "test_faketensor", "test_autograd_registration"))


def _reference(q, k, v, causal, scale):
    """float32 explicit softmax, differentiable (test_attention's reference)."""
    from test_attention import _reference as reference
    return reference(q, k, v, causal, scale)[0]


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [128, 333])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients_match_float32(d, n, causal):
    rnd = _gpu_inputs(10 * d + n + causal)
    q = rnd(2, 8, n, d).requires_grad_()
    k, v = rnd(2, 2, n, d).requires_grad_(), rnd(2, 2, n, d).requires_grad_()
    do = rnd(2, 8, n, d)
    scale = 1 / math.sqrt(d)
    o = attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_o = _reference(qf, kf, vf, causal, scale)
    refs = torch.autograd.grad(ref_o, (qf, kf, vf), do.float())
    assert _rel(o, ref_o) < 1e-2
    for name, g, ref in zip("qkv", grads, refs):
        assert g.shape == ref.shape and g.dtype == q.dtype, name
        assert not g.isnan().any(), name
        err = _rel(g, ref)
        assert err < 2e-2, (name, err)


@gpu
def test_attention_gradients_under_torch_compile():
    """Training step shape: the loss of a compiled function reaches q, k, v
    through the op's autograd; lse stays internal."""
    rnd = _gpu_inputs(5)
    q = rnd(1, 4, 256, 128).requires_grad_()
    k, v = rnd(1, 4, 256, 128).requires_grad_(), rnd(1, 4, 256, 128).requires_grad_()

    def loss(q, k, v):
        return (attention(q, k, v, causal=True).float() ** 2).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for e, c in zip(eager, compiled):
        assert _rel(c, e) < 1e-3


@gpu
def test_compiled_gradients_of_strided_bnhd_views():
    """q, k, v as (B, N, H, D) views of one projection: the backward op's fake
    must give dq q's strides (Inductor checks them against the real op's)."""
    rnd = _gpu_inputs(6)
    qkv = rnd(1, 200, 3, 4, 64).requires_grad_()

    def loss(qkv):
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        return (attention(q, k, v).float() ** 2).sum()

    (eager,) = torch.autograd.grad(loss(qkv), (qkv,))
    (compiled,) = torch.autograd.grad(torch.compile(loss, fullgraph=True)(qkv), (qkv,))
    assert _rel(compiled, eager) < 1e-3


def test_eager_functions_apply_as_autograd_function_does():
    """EagerFunction.apply (the eager calls' autograd Functions, under
    Function.apply's Python layer): the same node, gradients and outputs;
    under a functorch transform the public path, which refuses a Function
    without setup_context as before."""
    from tk_mlir.kernels.custom_ops import EagerFunction

    class Scale(EagerFunction):
        @staticmethod
        def forward(ctx, x, factor, unused):
            ctx.factor = factor
            return x * factor

        @staticmethod
        def backward(ctx, dy):
            return dy * ctx.factor, None, None

    x = torch.randn(5, 3, dtype=f32, requires_grad=True)
    y = Scale.apply(x, 2.5, None)
    assert type(y.grad_fn).__name__ == "ScaleBackward" and torch.equal(y, x.detach() * 2.5)
    dy = torch.randn(5, 3)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, dy * 2.5)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: Scale.apply(t, 2.0, None).sum())(torch.randn(3))


def _backward_call(**bad):
    """torch.ops.tk_mlir.attention_backward's arguments on CPU tensors, with
    `bad` replacing some."""
    q, k, v = (torch.randn(1, 2, 8, 64).to(bf16) for _ in range(3))
    args = dict(do=torch.randn(1, 2, 8, 64).to(bf16), q=q, k=k, v=v,
                o=torch.randn(1, 2, 8, 64).to(bf16), lse=torch.randn(1, 2, 8), causal=False,
                scale=0.125)
    return {**args, **bad}


@pytest.mark.parametrize("bad, error, rule", [
    ({}, ValueError, r"attention_backward: q must be on a CUDA device"),
    (dict(lse=torch.randn(1, 2, 3)), ValueError,
     r"attention_backward: lse must have shape \(1, 2, 8\) \(the forward's lse\), got \(1, 2, 3\)"),
    (dict(lse=torch.randn(1, 2, 8).to(bf16)), TypeError, r"attention_backward: lse must be "),
    (dict(o=torch.randn(1, 2, 4, 64).to(bf16)), ValueError, r"o must have shape \(1, 2, 8, 64\)"),
    (dict(o=torch.randn(1, 2, 8, 64)), TypeError, r"attention_backward: o must be "),
    (dict(scale=-1.0), ValueError, r"attention_backward: scale must be a positive finite"),
    (dict(left=-5), ValueError, r"attention_backward: window must be \(left, right\)"),
])
def test_the_attention_backward_op_checks_what_it_is_given(bad, error, rule):
    """Called directly (as a compiled backward graph calls it), the op checks
    the saved o and lse and the options as the public functions do: a wrong
    lse shape used to give wrong gradients, a 2-D one an unpacking error."""
    import tk_mlir.kernels.custom_ops  # noqa: F401
    with pytest.raises(error, match=rule):
        torch.ops.tk_mlir.attention_backward(**_backward_call(**bad))


@pytest.mark.parametrize("bad, rule", [
    (dict(h1=torch.randn(1, 2, 64, 8)), r"ssd_backward: h1 must have shape \(1, 2, 64, 16\)"),
    (dict(dy=torch.randn(1, 32, 2, 64)), r"ssd_backward: dy must be "),
    (dict(), r"ssd_backward: x must be on a CUDA device"),
])
def test_the_ssd_backward_op_checks_what_it_is_given(bad, rule):
    import tk_mlir.kernels.custom_ops  # noqa: F401
    b, l, h, p, n = 1, 32, 2, 64, 16
    args = dict(dy=torch.randn(b, l, h, p).to(bf16), dh1=None, x=torch.randn(b, l, h, p).to(bf16),
                dt=torch.rand(b, l, h) + 0.1, A=-torch.rand(h) - 0.1,
                B=torch.randn(b, l, 1, n).to(bf16), C=torch.randn(b, l, 1, n).to(bf16), D=None,
                h0=None, h1=torch.randn(b, h, p, n))
    with pytest.raises((TypeError, ValueError), match=rule):
        torch.ops.tk_mlir.ssd_backward(**{**args, **bad})
