"""The attention forward kernel of the library (tk_mlir/kernels/flash_attention.py).

Without a GPU: its PTX and SASS (register-A wgmma, bar.arrive ping-pong,
ex2.approx with the scale folded into FMAs, no spills, no C75xx warnings) and
the wrapper's argument errors. With one (`-m gpu`): numerics against a float32
softmax reference over head dims, lengths, causal, GQA/MQA, strided views and
fully masked rows, outputs poisoned before launch.
"""
from __future__ import annotations

import math
import re

import pytest

import tk_mlir as tk

torch = pytest.importorskip("torch")
gpu = pytest.mark.gpu

from torch_reference import assert_compiled_matches_eager  # noqa: E402


def _compile(d=128, causal=False, dtype=tk.bf16, n=4096, n_kv=None, h_kv=16):
    from tk_mlir.kernels.flash_attention import _config, attention_kernel
    cfg = _config(d, n_kv or n, causal)
    q = tk.spec((2, 16, n, d), dtype)
    kv = tk.spec((2, h_kv, n_kv or n, d), dtype)
    lse = tk.spec((2, 16, n), tk.f32)
    return attention_kernel.compile(q, kv, kv, q, lse, tk.spec((1024,), "i32"), 0.125, D=d,
                                    CAUSAL=causal,
                                    num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)


@pytest.fixture(scope="module", params=[(128, False, 4096), (128, True, 4096), (64, False, 4096),
                                        (64, True, 4096), (256, False, 4096), (256, True, 2048),
                                        (256, True, 4096),
                                        (128, False, 8192)],
                ids=lambda p: f"d{p[0]}{'-causal' if p[1] else ''}-n{p[2]}")
def compiled(request):
    d, causal, n = request.param
    return _compile(d, causal, n=n)


def test_ptx_has_the_fa3_instructions(compiled):
    ptx = compiled.asm["ptx"]
    # P·V takes A from registers: "{d...}, {a0, a1, a2, a3}, descB".
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\s*\{[^}]*\},\s*"
                     r"\{%r\d+, %r\d+, %r\d+, %r\d+\}", ptx)
    assert "bar.arrive" in ptx
    assert "ex2.approx" in ptx
    assert "fma.rn.f32" in ptx
    assert "div.rn.f32" not in ptx           # the normalization is a reciprocal


def test_output_leaves_by_tma_where_shared_memory_holds_it(compiled, request):
    """D=64 and 128 store O from shared memory by TMA (the next task starts
    while it leaves); D=256 and D=128's 192-key tiles (long rows, not causal)
    leave no room for the tile and store from registers."""
    from tk_mlir.kernels.flash_attention import _config
    d, causal, n = request.node.callspec.params["compiled"]
    store = re.search(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta", compiled.asm["ptx"])
    assert bool(store) == (d != 256 and _config(d, n, causal)["BN"] != 192)


def test_register_split_fits_what_the_block_starts_with(compiled):
    """setmaxnreg moves registers within the block's launch allocation: the
    kernel's split assumes ptxas gives each thread TARGET.launch_registers."""
    from tk_mlir.target import TARGET
    assert compiled.info["registers"] == TARGET.launch_registers(compiled.info["threads"])


def test_ptxas_no_spills_no_performance_warnings(compiled):
    assert compiled.info["spill stores (bytes)"] == 0
    assert compiled.info["spill loads (bytes)"] == 0
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log


def test_sass_register_a_hgmma_bar_arv_and_ffma(compiled):
    sass = compiled.asm["sass"]
    assert "LDL" not in sass and "STL" not in sass
    assert "BAR.ARV" in sass
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    # Register A: the first source operand is a register, not a descriptor (gdesc).
    assert any(re.search(r"HGMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc", line) for line in hgmma), hgmma
    assert sass.count("FFMA") >= sass.count("MUFU.EX2") > 0


def test_gqa_and_ragged_lengths_compile():
    c = _compile(128, True, n=1000, n_kv=777, h_kv=2)
    assert c.info["spill stores (bytes)"] == 0


def _cpu(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("make, rule", [
    (lambda: (_cpu(2, 4, 64, 128)[0], _cpu(2, 4, 64, 128), _cpu(2, 4, 64, 128)), "4-D"),
    (lambda: (_cpu(2, 4, 64, 128, dtype=torch.float32),) * 3, "torch.bfloat16 or torch.float16"),
    (lambda: (_cpu(2, 4, 64, 128),) * 3, "CUDA device"),
])
def test_argument_errors_before_any_launch(make, rule):
    from tk_mlir.kernels import attention
    with pytest.raises((ValueError, TypeError), match=rule):
        attention(*make())


@pytest.mark.parametrize("kwargs, rule", [
    (dict(causal="False"), "causal must be a bool, got 'False'"),
    (dict(scale=-0.5), "scale must be a positive finite number, got -0.5"),
    (dict(scale=float("nan")), "scale must be a positive finite number"),
    (dict(scale="0.1"), "scale must be a real number"),
])
def test_option_errors(kwargs, rule):
    from tk_mlir.kernels import attention
    with pytest.raises((ValueError, TypeError), match=rule):
        attention(*(_cpu(2, 4, 64, 128),) * 3, **kwargs)


def test_shape_rules_are_named():
    from tk_mlir.kernels.flash_attention import _check_shapes
    q = torch.empty(2, 8, 64, 128)
    with pytest.raises(ValueError, match="must divide the query heads"):
        _check_shapes(q, torch.empty(2, 3, 64, 128), torch.empty(2, 3, 64, 128))
    with pytest.raises(ValueError, match="head dim D must be 64, 128 or 256"):
        _check_shapes(torch.empty(2, 8, 64, 96), torch.empty(2, 8, 64, 96),
                      torch.empty(2, 8, 64, 96))
    with pytest.raises(ValueError, match="k and v must have one shape"):
        _check_shapes(q, torch.empty(2, 8, 64, 128), torch.empty(2, 8, 32, 128))
    with pytest.raises(ValueError, match=r"\(B=2, H_kv, N_kv, D=128\)"):
        _check_shapes(q, torch.empty(3, 8, 64, 128), torch.empty(3, 8, 64, 128))


# ------------------------------------------------------------------- on the GPU

def _reference(q, k, v, causal, scale):
    """float32 explicit softmax, bottom-right causal alignment; rows that see
    no key give 0 and -inf."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    s = q.float() @ kf.transpose(-1, -2) * scale
    if causal:
        n, n_kv = s.shape[-2:]
        i = torch.arange(n, device=s.device)[:, None]
        j = torch.arange(n_kv, device=s.device)[None, :]
        s = s.masked_fill(j > i + (n_kv - n), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vf, lse


def _run_and_check(q, k, v, causal, scale=None):
    from tk_mlir.kernels import attention
    o, lse = attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    torch.cuda.synchronize()
    ref_o, ref_lse = _reference(q, k, v, causal, scale or 1 / math.sqrt(q.shape[-1]))
    assert not o.isnan().any() and not lse.isnan().any()
    err = ((o.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, err
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    lerr = ((lse[finite] - ref_lse[finite]).norm() / ref_lse[finite].norm()).item()
    assert lerr < 1e-4, lerr
    return o, lse


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [128, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_float32(d, n, causal):
    g = torch.Generator(device="cuda").manual_seed(1000 * d + n + causal)
    q, k, v = (torch.randn(2, 4, n, d, device="cuda", generator=g).bfloat16() for _ in range(3))
    _run_and_check(q, k, v, causal)


@gpu
@pytest.mark.parametrize("n, n_kv", [(8192, 8192), (300, 8192 + 37), (1000, 9000)])
def test_long_rows_take_192_key_tiles(n, n_kv):
    """D=128 rows of LONG_KV keys or more, not causal: 192-key K/V tiles
    (a tile size of 16·k), the last one past N_kv."""
    from tk_mlir.kernels.flash_attention import _config
    assert _config(128, n_kv, False)["BN"] == 192
    g = torch.Generator(device="cuda").manual_seed(n + n_kv)
    q = torch.randn(1, 4, n, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 2, n_kv, 128, device="cuda", generator=g).bfloat16()
            for _ in range(2))
    _run_and_check(q, k, v, False)


@gpu
@pytest.mark.parametrize("n, n_kv", [(300, 300), (200, 4100)])      # 64- and 80-key blocks
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256(causal, n, n_kv):
    g = torch.Generator(device="cuda").manual_seed(256 + causal + n)
    q = torch.randn(1, 2, n, 256, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 2, n_kv, 256, device="cuda", generator=g).bfloat16()
            for _ in range(2))
    _run_and_check(q, k, v, causal)


def test_head_dim_256_takes_80_key_blocks_on_long_rows():
    from tk_mlir.kernels.flash_attention import LONG_KV_256, _config
    assert _config(256, LONG_KV_256)["BN"] == 80 and _config(256, LONG_KV_256 - 1)["BN"] == 64


@pytest.mark.parametrize("causal", [False, True])
def test_80_key_blocks_in_the_interpreter(causal):
    """D=256's 80-key K/V blocks (a tile side of 16·5) against float64, with
    a partial last block, N != N_kv, and the interpreter's race checks."""
    from tk_mlir.kernels.flash_attention import _config, attention_kernel, tasks
    B, H, N, N_KV, D = 1, 2, 150, 250, 256
    cfg = _config(D, 1 << 20, causal)
    assert cfg["BN"] == 80
    g = torch.Generator().manual_seed(80 + causal)
    q = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, H, N_KV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, 152), float("nan"))
    attention_kernel.interpret[(2,)](q, k, v, o, lse, tasks(q, k, causal, 2), math.log2(math.e) / 16,
                                     D=D, CAUSAL=causal, num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    ref_o, ref_lse = _reference(q.double(), k.double(), v.double(), causal, 1 / 16)
    assert ((o.double() - ref_o).norm() / ref_o.norm()).item() < 8e-3
    assert ((lse[..., :N].double() - ref_lse).norm() / ref_lse.norm()).item() < 1e-5


# ------------------------------------------- dK and dV through the K/V tiles
#
# DKV_TMA: the backward's dK and dV leave by TMA from the task's K and V tiles
# (the 80-row blocks' configuration; any configuration may ask for it).

@pytest.mark.parametrize("d, softcap, rows, loop_spills", [(64, 0.0, 64, 0), (128, 0.0, 64, 0),
                                                           (128, 30.0, 64, 9), (128, 0.0, 80, 3)])
def test_dkv_through_the_kv_tiles_compiles_to_tma_stores(d, softcap, rows, loop_spills):
    """DKV_TMA: dK and dV leave by TMA from the task's K and V tiles, nothing
    from registers. ptxas spills three address reloads a step at 80-row
    blocks, and 9 spill loads/stores a step soft-capped (BENCHMARKS.md)."""
    c = compile_backward(d, rows == 64, softcap, rows, DKV_TMA=True)
    ptx = c.asm["ptx"]
    assert "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group" in ptx
    assert "st.global" not in ptx
    assert "C75" not in c.ptxas_log, c.ptxas_log
    limit = 0 if d == 64 else 96 if softcap else 64 if rows == 80 else 48
    assert c.info["spill stores (bytes)"] <= limit, c.ptxas_log
    loop = _step_loop(c.asm["sass"])
    assert sum(i.startswith(("LDL", "STL")) for i in loop) <= loop_spills


@pytest.mark.parametrize("b, h, h_kv, n, n_kv, d, causal", [(1, 2, 1, 200, 300, 64, True),
                                                           (1, 4, 2, 150, 100, 128, True),
                                                           (1, 2, 2, 130, 250, 128, False)])
def test_dkv_through_the_kv_tiles_in_the_interpreter(b, h, h_kv, n, n_kv, d, causal):
    """DKV_TMA's dq, dk, dv against float64 (GQA, ragged, rows that see no
    key) on one block, so every K/V tile is refilled after its dK or dV left
    it, with the interpreter's race checks (which see a K tile written before
    the other warpgroup's dQ read it, or handed back before its TMA store
    read it)."""
    from test_attention_deterministic import _inputs, _interpret, _reference_grads, \
        _relative_error
    q, k, v, do = _inputs(b, h, h_kv, n, n_kv, d, seed=n + d)
    grads = _interpret(q, k, v, do, causal, 1, False, DKV_TMA=True)
    for name, got, ref in zip(("dq", "dk", "dv"), grads,
                              _reference_grads(q, k, v, do, causal, 1 / math.sqrt(d))):
        assert not got.isnan().any(), name
        assert _relative_error(got, ref) < 1e-2, name


@gpu
@pytest.mark.parametrize("n, n_kv, dtype", [(200, 1000, torch.float16), (1000, 77, torch.bfloat16),
                                            (1, 300, torch.float16), (40, 40, torch.bfloat16)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_and_short_lengths(n, n_kv, dtype, causal):
    """N != N_kv (bottom-right causal), N and N_kv below a block, f16 too."""
    g = torch.Generator(device="cuda").manual_seed(n * n_kv + causal)
    q = torch.randn(2, 4, n, 128, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, 4, n_kv, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    _run_and_check(q, k, v, causal)


@gpu
@pytest.mark.parametrize("h_kv", [1, 2])          # MQA, GQA
def test_fewer_kv_heads(h_kv):
    g = torch.Generator(device="cuda").manual_seed(h_kv)
    q = torch.randn(2, 8, 700, 128, device="cuda", generator=g).half()
    k, v = (torch.randn(2, h_kv, 700, 128, device="cuda", generator=g).half() for _ in range(2))
    _run_and_check(q, k, v, True)


@gpu
def test_strided_bnhd_views_from_a_projection():
    b, n, h, d = 2, 333, 8, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(b, n, 3, h, d, device="cuda", generator=g).bfloat16()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))     # (B, H, N, D) views
    assert not q.is_contiguous()
    o, _ = _run_and_check(q, k, v, False, scale=0.3)
    assert o.transpose(1, 2).is_contiguous()        # laid out like q: (B, N, H, D) order


def test_views_with_unaligned_rows_are_copied_and_differentiated(interpret):
    """Rows of 66 elements cut to D=64 (132-byte steps: TMA cannot read them
    in place): the call copies them, forward and backward, eagerly with and
    without grad, and through the ops (as torch.compile calls them)."""
    from tk_mlir.kernels import attention, custom_ops  # noqa: F401  (registers the ops)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 40, 64, generator=g).bfloat16().requires_grad_()
    wide = torch.randn(1, 2, 40, 66, generator=g).bfloat16().requires_grad_()
    k = wide[..., :64]
    do = torch.randn(1, 2, 40, 64, generator=g).bfloat16()
    ref_in = [q.detach().float().requires_grad_(), wide.detach().float().requires_grad_()]
    ro, _ = _reference(ref_in[0], ref_in[1][..., :64], ref_in[1][..., :64], True, 0.125)
    ref_grads = torch.autograd.grad(ro, ref_in, do.float())
    o = attention(q, k, k, causal=True)
    grads = torch.autograd.grad(o, (q, wide), do)
    with torch.no_grad():
        assert torch.equal(attention(q, k, k, causal=True), o)
    op_o, op_lse = torch.ops.tk_mlir.attention(q.detach(), k.detach(), k.detach(), True, 0.125)
    op_grads = torch.ops.tk_mlir.attention_backward(do, q.detach(), k.detach(), k.detach(),
                                                    op_o, op_lse, True, 0.125)
    assert torch.equal(op_o, o)

    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()
    assert rel(o, ro) < 1e-2 and all(rel(a, b) < 1e-2 for a, b in zip(grads, ref_grads))
    assert rel(op_grads[0], ref_grads[0]) < 1e-2
    assert rel(op_grads[1] + op_grads[2], ref_grads[1][..., :64]) < 1e-2


@gpu
@pytest.mark.parametrize("n, n_kv", [(300, 100), (256, 64), (100, 300)])
def test_causal_bottom_right_and_fully_masked_rows(n, n_kv):
    g = torch.Generator(device="cuda").manual_seed(n + n_kv)
    q = torch.randn(1, 4, n, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 4, n_kv, 128, device="cuda", generator=g).bfloat16()
            for _ in range(2))
    o, lse = _run_and_check(q, k, v, True)
    if n > n_kv:     # the first n - n_kv rows see no key
        assert (o[:, :, : n - n_kv] == 0).all()
        assert (lse[:, :, : n - n_kv] == float("-inf")).all()


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_every_output_element_is_written(causal):
    """The kernel on poisoned outputs: every element of O and LSE is written."""
    from tk_mlir.kernels.flash_attention import launch
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 128, device="cuda", generator=g).bfloat16()
               for _ in range(3))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, 200), float("nan"), device="cuda")
    launch(q, k, v, o, lse, causal, 0.1)
    torch.cuda.synchronize()
    ref_o, ref_lse = _reference(q, k, v, causal, 0.1)
    assert not o.isnan().any() and not lse.isnan().any()
    assert ((o.float() - ref_o).norm() / ref_o.norm()).item() < 1e-2
    assert ((lse - ref_lse).norm() / ref_lse.norm()).item() < 1e-4


def test_a_copied_view_gives_outputs_laid_out_as_the_fakes_say(interpret):
    """q, k, v as (B, N, H, D) views of rows padded to 68 (136-byte steps:
    copied for the kernels): the op's o and the backward op's dq, dk, dv come
    back laid out as torch.empty_like of the given views (what the fakes
    return, and what inductor checks), and the eager o laid out like q."""
    from tk_mlir.kernels import attention, custom_ops  # noqa: F401  (registers the ops)
    g = torch.Generator().manual_seed(68)
    x = torch.randn(1, 40, 3, 2, 68, generator=g).bfloat16()
    q, k, v = (x[:, :, i, :, :64].transpose(1, 2) for i in range(3))
    o, lse = torch.ops.tk_mlir.attention(q, k, v, True, 0.125)
    assert o.stride() == torch.empty_like(q).stride()
    grads = torch.ops.tk_mlir.attention_backward(torch.randn(o.shape, generator=g).bfloat16(),
                                                 q, k, v, o, lse, True, 0.125)
    assert all(d.stride() == torch.empty_like(t).stride() for d, t in zip(grads, (q, k, v)))
    eager = attention(q, k, v, causal=True)
    assert eager.stride() == torch.empty_like(q).stride() and torch.equal(eager, o)


def test_compiled_attention_takes_symbolic_scale_and_softcap(interpret):
    """torch.compile(dynamic=True, fullgraph=True) hands scale and softcap
    as symbolic floats: the checks trace them (no math.isfinite), and two
    calls with other values both match float64."""
    from tk_mlir.kernels import attention
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 48, 64, generator=g).bfloat16() for _ in range(3))
    f = torch.compile(lambda q, k, v, s, c: attention(q, k, v, scale=s, softcap=c),
                      dynamic=True, fullgraph=True)
    for s, c in ((0.1, 5.0), (0.2, 6.0)):
        ref, _ = _window_reference(q.double(), k.double(), v.double(), False, (-1, -1), c, s)
        o = f(q, k, v, s, c)
        assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_scheduled_tasks_in_the_interpreter(causal, monkeypatch):
    """A task table that groups causal tasks by 2 heads of 5 (the last group
    short) and balances blocks of several lengths over 2 blocks, a second Q
    stage and O by TMA give the float64 softmax, with the races the
    interpreter checks absent."""
    from tk_mlir.kernels import flash_attention
    from tk_mlir.kernels.flash_attention import _config, attention_kernel, tasks
    B, H, H_KV, N, N_KV, D = 1, 5, 5, 400, 450, 64
    monkeypatch.setattr(flash_attention, "L2_KV_BYTES", 2 * 4 * D * N_KV)
    q = torch.randn(B, H, N, D).to(torch.bfloat16)
    k, v = (torch.randn(B, H_KV, N_KV, D).to(torch.bfloat16) for _ in range(2))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, N), float("nan"))
    cfg = _config(D)
    table = tasks(q, k, causal, 2)
    assert table[0] == 3 and table[2] == 3 + 5 * 3    # 15 tasks, all assigned
    attention_kernel.interpret[(2,)](q, k, v, o, lse, table, math.log2(math.e) / 8, D=D,
                                     CAUSAL=causal, num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    ref_o, ref_lse = _reference(q.double(), k.double(), v.double(), causal, 1 / 8)
    assert ((o.double() - ref_o).norm() / ref_o.norm()).item() < 8e-3
    assert ((lse[..., :N].double() - ref_lse).norm() / ref_lse.norm()).item() < 1e-5


@pytest.mark.parametrize("d, causal, window, dtype", [
    (128, False, (-1, -1), torch.bfloat16), (64, True, (-1, -1), torch.float16),
    (128, False, (100, 30), torch.bfloat16)])
def test_lazy_rescale_in_the_interpreter(d, causal, window, dtype):
    """RESCALE_THRESHOLD=8: a row's max moves only when a block raises it by
    more than 2^8. Keys grow 200-fold along the sequence, so the max must
    move (kept where it was, P would overflow to inf) and most steps keep
    it; o and lse against float64, with windows (rows that see no key in a
    block) too; f16, whose P must stay below 2^15, too."""
    from tk_mlir.kernels.flash_attention import _config, attention_kernel, tasks
    B, H, N, N_KV = 1, 2, 200, 700
    g = torch.Generator().manual_seed(d + causal)
    q = torch.randn(B, H, N, d, generator=g)
    k, v = (torch.randn(B, H, N_KV, d, generator=g) for _ in range(2))
    k = k * torch.linspace(0.2, 40.0, N_KV)[:, None]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, N), float("nan"))
    cfg = {**_config(d, N_KV, causal), "RESCALE_THRESHOLD": 8.0}
    attention_kernel.interpret[(2,)](q, k, v, o, lse, tasks(q, k, causal, 2, window),
                                     math.log2(math.e) / 8, D=d, CAUSAL=causal,
                                     WINDOW_LEFT=window[0], WINDOW_RIGHT=window[1],
                                     num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    ref_o, ref_lse = _window_reference(q.double(), k.double(), v.double(), causal, window, 0.0,
                                       1 / 8)
    assert ((o.double() - ref_o).norm() / ref_o.norm()).item() < 8e-3
    assert ((lse.double() - ref_lse).norm() / ref_lse.norm()).item() < 1e-5


@pytest.mark.parametrize("d, causal", [(128, False), (64, True), (256, False)])
def test_lazy_rescale_compiles_to_a_voted_branch_without_spills(d, causal):
    """RESCALE_THRESHOLD > 0: O's rescale behind a warp vote, no spill, no
    C75xx advisory."""
    from tk_mlir.kernels import flash_attention as fa
    cfg = {**fa._config(d, 4096, causal), "RESCALE_THRESHOLD": 8.0}
    q = tk.spec((2, 16, 4096, d), tk.bf16)
    lse = tk.spec((2, 16, 4096), tk.f32)
    c = fa.attention_kernel.compile(q, q, q, q, lse, tk.spec((1024,), "i32"), 0.125, D=d,
                                    CAUSAL=causal, num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)
    assert "vote.sync.any.pred" in c.asm["ptx"]
    assert "C75" not in c.ptxas_log, c.ptxas_log
    assert c.info["spill stores (bytes)"] == 0


def test_lazy_rescale_threshold_keeps_p_within_f16():
    from tk_mlir.kernels import flash_attention as fa
    cfg = {**fa._config(128, 4096, False), "RESCALE_THRESHOLD": 16.0}
    q = tk.spec((1, 2, 256, 128), tk.f16)
    with pytest.raises(tk.CompilationError, match=r"RESCALE_THRESHOLD is 0 \(off\) up to 15"):
        fa.attention_kernel.compile(q, q, q, q, tk.spec((1, 2, 256), tk.f32),
                                    tk.spec((1024,), "i32"), 0.125, D=128,
                                    num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)


@gpu
@pytest.mark.parametrize("d, causal", [(128, False), (128, True), (64, True), (256, False)])
def test_lazy_rescale_on_the_gpu(monkeypatch, d, causal):
    """attention() with RESCALE_THRESHOLD=8 against float32: random scores
    (the max rarely moves after the first block: warps skip the rescale)
    and keys that grow along the sequence (it must move)."""
    from tk_mlir.kernels import eager, flash_attention as fa
    monkeypatch.setitem(fa.RESCALE_THRESHOLDS, d, 8.0)
    eager.forget_all()
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    q, k, v = (torch.randn(2, 4, 1500, d, device="cuda", generator=g) for _ in range(3))
    for grow in (1.0, 40.0):
        k = k * torch.linspace(0.2, grow, 1500, device="cuda")[:, None]
        _run_and_check(*(x.bfloat16() for x in (q, k, v)), causal)
    eager.forget_all()


def _window_reference(q, k, v, causal, window, softcap, scale):
    """(o, lse) of attention with a window (left, right) and softcap, in q's
    (float) dtype: GQA by repeating K/V heads, bottom-right aligned (query i
    at key position i + N_kv - N), rows that see no key 0 and -inf."""
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    n, n_kv = s.shape[-2:]
    key = torch.arange(n_kv, device=s.device)[None]
    row = torch.arange(n, device=s.device)[:, None] + n_kv - n
    hidden = torch.zeros(n, n_kv, dtype=torch.bool, device=s.device)
    right = 0 if causal else window[1]
    if window[0] >= 0:
        hidden |= key < row - window[0]
    if right >= 0:
        hidden |= key > row + right
    s = s.masked_fill(hidden, float("-inf"))
    o = torch.softmax(s, -1).nan_to_num() @ v.repeat_interleave(group, 1)
    return o, torch.logsumexp(s, -1)


def _assert_window_matches(o, lse, ref, ref_lse):
    """o and lse against _window_reference's: o by relative norm, lse infinite
    exactly where the reference's is (rows that see no key), else close."""
    assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-2
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    assert ((lse.double()[finite] - ref_lse[finite]).norm() / ref_lse[finite].norm()) < 1e-4


@pytest.mark.parametrize("causal, window, softcap", [
    (True, (100, -1), 0.0),     # a sliding window: blocks wholly left of it never read
    (False, (64, 40), 0.0),     # both edges, not causal
    (False, (-1, -1), 5.0),     # Gemma-2's soft-capping
    (True, (150, 0), 3.0),      # both, N_kv > N (bottom-right aligned)
])
def test_window_and_softcap_in_the_interpreter(monkeypatch, causal, window, softcap):
    """attention(..., window=, softcap=) through the library call in the
    interpreter against float64; K and V are NaN in the key blocks no row's
    window reaches (a block that was read would carry NaN through P·V)."""
    import sys
    from tk_mlir.kernels import attention
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    g = torch.Generator().manual_seed(window[0])
    B, H, H_KV, N, N_KV, D = 1, 2, 1, 300, 700 if window == (150, 0) else 300, 64
    q = (torch.randn(B, H, N, D, generator=g) * 2).to(torch.bfloat16)
    k, v = (torch.randn(B, H_KV, N_KV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    shift, left = N_KV - N, window[0]
    ref, ref_lse = _window_reference(q.double(), k.double(), v.double(), causal, window, softcap,
                                     1 / 8)
    first_key = max(shift - left, 0) if left >= 0 else 0      # the first key any row sees
    k[:, :, :first_key // 128 * 128] = float("nan")
    v[:, :, :first_key // 128 * 128] = float("nan")
    o, lse = attention(q, k, v, causal=causal, scale=1 / 8, window=window, softcap=softcap,
                       return_lse=True)
    _assert_window_matches(o, lse, ref, ref_lse)


@pytest.mark.parametrize("causal, window, softcap", [(True, (90, -1), 3.0), (False, (40, 30), 0.0)])
def test_window_and_softcap_with_80_key_blocks(monkeypatch, causal, window, softcap):
    """D=256's 80-key K/V blocks (taken here from any length) under a window
    and soft-capping, in the interpreter against float64; K and V are NaN in
    the 80-key blocks no row's window reaches."""
    import sys
    from tk_mlir.kernels import attention, flash_attention
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    monkeypatch.setattr(flash_attention, "LONG_KV_256", 0)
    g = torch.Generator().manual_seed(window[0] + 256)
    B, H, N, N_KV, D = 1, 2, 150, 330, 256
    q = (torch.randn(B, H, N, D, generator=g) * 2).to(torch.bfloat16)
    k, v = (torch.randn(B, H, N_KV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    ref, ref_lse = _window_reference(q.double(), k.double(), v.double(), causal, window, softcap,
                                     1 / 16)
    first_key = N_KV - N - window[0]                          # the first key any row sees
    k[:, :, :first_key // 80 * 80] = float("nan")
    v[:, :, :first_key // 80 * 80] = float("nan")
    o, lse = attention(q, k, v, causal=causal, scale=1 / 16, window=window, softcap=softcap,
                       return_lse=True)
    _assert_window_matches(o, lse, ref, ref_lse)


@gpu
@pytest.mark.parametrize("d, causal, window, softcap", [(128, True, (1024, -1), 0.0),
                                                        (64, False, (256, 256), 30.0),
                                                        (128, False, (-1, -1), 50.0)])
def test_window_and_softcap_on_the_gpu(d, causal, window, softcap):
    from tk_mlir.kernels import attention
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (torch.randn(2, 4, 3000, d, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    o = attention(q, k, v, causal=causal, window=window, softcap=softcap)
    ref, _ = _window_reference(q.float(), k.float(), v.float(), causal, window, softcap,
                               1 / math.sqrt(d))
    assert ((o.float() - ref).norm() / ref.norm()).item() < 1e-2


@gpu
@pytest.mark.parametrize("d, causal, window, softcap", [(128, True, (700, -1), 0.0),
                                                        (64, False, (300, 200), 0.0),
                                                        (128, True, (-1, -1), 30.0)])
def test_window_and_softcap_backward_on_the_gpu(d, causal, window, softcap):
    from tk_mlir.kernels import attention
    g = torch.Generator(device="cuda").manual_seed(d + 1)
    q = torch.randn(2, 4, 2000, d, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 2000, d, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    do = torch.randn_like(q)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(attention(q, k, v, causal=causal, window=window,
                                          softcap=softcap), (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o, _ = _window_reference(qf, kf, vf, causal, window, softcap, 1 / math.sqrt(d))
    for got, ref in zip(grads, torch.autograd.grad(o, (qf, kf, vf), do.float())):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("d, causal, window, softcap, n, n_kv", [
    (64, True, (100, -1), 0.0, 300, 300),   # D=64's pipelined backward, a sliding window
    (64, True, (100, -1), 0.0, 300, 700),   # K/V blocks 0, 1 in no query's window: dK, dV 0
    (128, False, (64, 40), 0.0, 250, 250),  # D=128, both edges
    (64, False, (-1, -1), 2.0, 200, 260),   # soft-capping (scores well past the cap)
    (128, True, (90, -1), 3.0, 200, 200),   # both
])
def test_window_and_softcap_backward_in_the_interpreter(monkeypatch, d, causal, window,
                                                         softcap, n, n_kv):
    """dq, dk, dv of attention(..., window=, softcap=) through the library's
    autograd in the interpreter against float64 autograd, GQA 2:1."""
    import sys
    from tk_mlir.kernels import attention
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    g = torch.Generator().manual_seed(n_kv + d)
    q = (torch.randn(1, 2, n, d, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 1, n_kv, d, generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    do = torch.randn(1, 2, n, d, generator=g).to(torch.bfloat16)
    grads = torch.autograd.grad(attention(q, k, v, causal=causal, window=window,
                                          softcap=softcap), (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = _window_reference(qd, kd, vd, causal, window, softcap, 1 / math.sqrt(d))
    refs = torch.autograd.grad(o, (qd, kd, vd), do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert not got.isnan().any(), name
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2, name
    if window[0] >= 0 and n_kv - n - window[0] >= 256:        # keys no window reaches
        assert not grads[1][:, :, :256].any() and not grads[2][:, :, :256].any()


@pytest.mark.parametrize("dtype, causal, scale", [(torch.bfloat16, True, 0.3),
                                                   (torch.float16, True, 0.3),
                                                   (torch.float16, False, None)])
def test_the_scale_in_p_and_without_it_in_the_interpreter(monkeypatch, dtype, causal, scale):
    """bf16 backwards fold the scale into P (P' = scale·P: dV divided once,
    dQ and dK never multiplied); f16 ones keep P (SCALE_IN_P off: scale on
    dQ and dK). Both against float64 autograd, at a scale of the caller's."""
    import sys
    from tk_mlir.kernels import attention
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 150, 64, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, 1, 170, 64, generator=g).to(dtype).requires_grad_()
            for _ in range(2))
    do = torch.randn(1, 2, 150, 64, generator=g).to(dtype)
    grads = torch.autograd.grad(attention(q, k, v, causal=causal, scale=scale), (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = _window_reference(qd, kd, vd, causal, (-1, -1), 0.0, scale or 1 / 8)
    refs = torch.autograd.grad(o, (qd, kd, vd), do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == dtype, name
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2, name


def test_window_and_softcap_compiled_match_eager(monkeypatch):
    """Under torch.compile(fullgraph=True) the window and softcap travel
    through the attention op and its backward op: the same bits as eager."""
    import sys
    from tk_mlir.kernels import attention
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 130, 64, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 1, 130, 64, generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2))

    def f(q, k, v):
        return attention(q, k, v, causal=True, window=(50, 0), softcap=5.0)

    assert_compiled_matches_eager(f, q, k, v)


def test_a_right_window_bound_under_causal_is_no_window(interpret):
    """causal=True bounds the right side already: window=(-1, 0) (or any right
    bound) changes nothing, so deterministic=True takes it, gradients included."""
    from tk_mlir.kernels import attention
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 80, 64, generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    o = attention(q, k, v, causal=True, window=(-1, 0), deterministic=True)
    grads = torch.autograd.grad(o.float().sum(), (q, k, v))
    o2 = attention(q, k, v, causal=True, deterministic=True)
    assert torch.equal(o, o2)
    for a, b in zip(grads, torch.autograd.grad(o2.float().sum(), (q, k, v))):
        assert torch.equal(a, b)


def test_a_deterministic_window_and_bad_window_or_softcap_are_refused():
    from tk_mlir.kernels import attention
    q = torch.randn(1, 1, 8, 64).to(torch.bfloat16).requires_grad_()
    with pytest.raises(NotImplementedError, match=r"deterministic=True takes no window"):
        attention(q, q, q, window=(4, 0), deterministic=True)
    with pytest.raises(ValueError, match=r"window must be \(left, right\)"):
        attention(q.detach(), q.detach(), q.detach(), window=(4, -3))
    import numpy as np
    from tk_mlir.kernels import checks
    assert checks.window("f", (np.int64(5), np.int32(-1)), 100) == (5, -1)   # numpy's ints
    assert checks.window("f", (5, 100), 100) == (5, -1)          # wider than any distance
    for kind in ((True, 0), (1.0, 1), None, (4,)):      # wrong kinds of value: TypeError
        with pytest.raises(TypeError, match=r"window must be"):
            checks.window("f", kind, 100)
    with pytest.raises(ValueError, match=r"softcap must be a finite number >= 0"):
        attention(q.detach(), q.detach(), q.detach(), softcap=float("inf"))
    with pytest.raises(ValueError, match=r"softcap must be at most 10000 .* got 1000000.0"):
        attention(q.detach(), q.detach(), q.detach(), softcap=1e6)     # (tanh's precision)


def test_padded_rows_is_a_view_of_padded_memory_else_a_padded_copy():
    from tk_mlir.kernels.flash_attention import lse_like, padded_rows
    lse = lse_like(torch.empty(2, 3, 10, 64))
    lse.copy_(torch.randn(2, 3, 10))
    rows = padded_rows(lse)
    assert rows.shape == (2, 3, 12) and rows.data_ptr() == lse.data_ptr()
    assert torch.equal(rows[..., :10], lse)
    for other in (torch.randn(2, 3, 10), torch.randn(3, 2, 10).transpose(0, 1)):
        rows = padded_rows(other)
        assert rows.shape == (2, 3, 12) and rows.stride() == (36, 12, 1)
        assert torch.equal(rows[..., :10], other)


# ------------------------------------------------------------------ backward

def compile_backward(d: int, causal: bool, softcap: float = 0.0, query_rows: int = 64,
                     **constexprs):
    """The backward kernel compiled (no GPU needed) for B=2, H=8 over
    H_kv=2, N=1000, N_kv=777, in its configuration for (d, softcap,
    query_rows) as flash_attention's knobs now set it."""
    from tk_mlir.kernels import flash_attention as fa
    q = tk.spec((2, 8, 1000, d), tk.bf16)
    kv = tk.spec((2, 2, 777, d), tk.bf16)
    vec = tk.spec((2, 8, 1000), tk.f32)
    return fa.attention_backward_kernel.compile(
        q, kv, kv, q, vec, vec, tk.spec((2, 8, 1000, d), tk.f32), kv, kv, tk.spec((1024,), "i32"),
        0.1, 0.1, D=d, CAUSAL=causal, **{**fa._backward_config(d, softcap, query_rows),
                                         **constexprs})


@pytest.mark.parametrize("d, causal, softcap", [(64, False, 0.0), (64, True, 0.0),
                                                (128, False, 0.0), (128, True, 0.0),
                                                (128, True, 30.0)])
def test_backward_kernel_compiles_with_the_reductions_and_fence(d, causal, softcap):
    c = compile_backward(d, causal, softcap)
    ptx = c.asm["ptx"]
    # dQ accumulated in f32: a TMA reduce-add from shared memory, per 32-column block
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)
    assert re.search(r'"tk.tma_reduce_add"\([^)]*\) : \(!tk.gl<f32, .*?, !tk.st<f32, 64 : i64, '
                     r'64 : i64, 128 : i64>', c.asm["tk"])
    assert "fence.proxy.async" in ptx               # dSᵀ written by threads, read by wgmma
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{d}k16\.f32\.bf16\.bf16\s*\{{[^}}]*\}},\s*"
                     r"\{%r\d+, %r\d+, %r\d+, %r\d+\}", ptx)      # dV, dK with A from registers
    # No wgmma is serialized and ptxas injects no wait (C7517: Sᵀ's and dPᵀ's
    # accumulators start at SHIFT and -Delta, made by threads before
    # either MMA is issued). Spills: a few registers at D=128 (20-44 bytes,
    # outside the step loop: the 24-register producer), none at D=64
    # (BENCHMARKS.md). Soft-capped and causal, SHIFT is added after the
    # cap and some spill in the loop (11 LDL/STL a step).
    assert "C75" not in c.ptxas_log, c.ptxas_log
    limit = 0 if d == 64 else 96 if softcap else 48
    assert c.info["spill stores (bytes)"] <= limit, c.ptxas_log
    loop = _step_loop(c.asm["sass"])
    spills = sum(i.startswith(("LDL", "STL")) for i in loop)
    assert spills <= (11 if softcap else 0), f"{spills} spill loads/stores in the step loop"
    # dK and dV stay in their MMAs' registers across steps (the loop is
    # rotated: parked elsewhere for the softmax, they cost >= 128 moves a step).
    assert sum(i.startswith(("IMAD.MOV", "MOV")) for i in loop) < 128


def _step_loop(sass: str) -> list[str]:
    """The instructions of the first innermost SASS loop that issues HGMMAs:
    the backward's step loop."""
    from tk_mlir.summary import loop_bodies
    body = next(b for b in loop_bodies(sass) if any(t.startswith("HGMMA") for t, _ in b))
    return [t for t, _ in body]


@pytest.mark.parametrize("b, h, h_kv, n, n_kv, causal", [(1, 2, 1, 200, 300, True),
                                                    (2, 1, 1, 64, 200, False),
                                                    (1, 4, 2, 150, 100, True)])
def test_pipelined_backward_in_the_interpreter(b, h, h_kv, n, n_kv, causal):
    """D=64's default backward (PIPELINE: step t+1's Sᵀ and dPᵀ in flight
    while step t's dQ leaves, three Q/dO stages) against float64, with the
    interpreter's race and deadlock checks."""
    from tk_mlir.kernels.flash_attention import _backward_config
    from test_attention_deterministic import _inputs, _interpret, _reference_grads, \
        _relative_error
    assert _backward_config(64)["PIPELINE"] and _backward_config(64)["STAGES"] == 3
    q, k, v, do = _inputs(b, h, h_kv, n, n_kv, 64, seed=n + n_kv)
    grads = _interpret(q, k, v, do, causal, 3, False)
    for name, got, ref in zip(("dq", "dk", "dv"), grads,
                              _reference_grads(q, k, v, do, causal, 1 / math.sqrt(64))):
        assert not got.isnan().any(), name
        assert _relative_error(got, ref) < 1e-2, name


@pytest.mark.parametrize("n, n_kv, causal, window", [(200, 300, False, (-1, -1)),
                                                      (170, 170, True, (-1, -1)),
                                                      (250, 250, False, (64, 40))])
def test_80_row_query_blocks_backward_in_the_interpreter(monkeypatch, n, n_kv, causal, window):
    """QUERY_ROWS=80 (dQᵀ = Kᵀ·dSᵀ, stored transposed for dQ's add) through the
    library's autograd against float64, GQA 2:1, ragged last blocks; the
    library takes it where it applies (not causal, no window), the kernel
    takes masks too."""
    from tk_mlir.kernels import flash_attention as fa
    monkeypatch.setattr(fa, "WIDE_QUERY_BLOCKS", True)
    if causal or window != (-1, -1):
        monkeypatch.setattr(fa, "_backward_query_rows", lambda *a: 80)
    cfg = _interpreted_backward_against_float64(monkeypatch, 128, n, n_kv, causal, window)
    assert cfg["QUERY_ROWS"] == 80 and cfg["DKV_TMA"]


def _interpreted_backward_against_float64(monkeypatch, d, n, n_kv, causal, window) -> dict:
    """attention's gradients through the library's autograd in the interpreter
    (GQA 2:1, B=1) against float64, to 1e-2 by relative norm; returns the
    constexprs the backward kernel was launched with."""
    import sys
    from tk_mlir.kernels import attention, eager, flash_attention as fa
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    monkeypatch.setattr(fa, "_PREPARED", eager.Prepared())     # (plans made before the knobs)
    launched = []
    make = fa.backward_launcher
    monkeypatch.setattr(fa, "backward_launcher",
                        lambda *a, **cfg: launched.append(cfg) or make(*a, **cfg))
    g = torch.Generator().manual_seed(n + n_kv + d)
    q = torch.randn(1, 2, n, d, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 1, n_kv, d, generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    do = torch.randn(1, 2, n, d, generator=g).to(torch.bfloat16)
    grads = torch.autograd.grad(attention(q, k, v, causal=causal, window=window), (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = _window_reference(qd, kd, vd, causal, window, 0.0, 1 / math.sqrt(d))
    for name, got, ref in zip(("dq", "dk", "dv"), grads,
                              torch.autograd.grad(o, (qd, kd, vd), do.double())):
        assert not got.isnan().any(), name
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2, name
    return launched[-1]


@gpu
@pytest.mark.parametrize("b, h, h_kv, n, n_kv", [(2, 8, 2, 1000, 777), (1, 4, 4, 4096, 4096),
                                               (3, 2, 1, 80, 300)])
def test_80_row_query_blocks_backward_on_the_gpu(monkeypatch, b, h, h_kv, n, n_kv):
    """The wide blocks' gradients against float32 autograd on the GPU
    (forced on, whatever WIDE_QUERY_BLOCKS's default)."""
    from tk_mlir.kernels import attention, eager, flash_attention as fa
    monkeypatch.setattr(fa, "WIDE_QUERY_BLOCKS", True)
    monkeypatch.setattr(fa, "_PREPARED", eager.Prepared())     # (plans made with 64 rows)
    q = torch.randn(b, h, n, 128, device="cuda").to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, h_kv, n_kv, 128, device="cuda").to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    do = torch.randn(b, h, n, 128, device="cuda").to(torch.bfloat16)
    grads = torch.autograd.grad(attention(q, k, v), (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o, _ = _reference(qf, kf, vf, False, 1 / math.sqrt(128))
    for name, got, ref in zip(("dq", "dk", "dv"), grads,
                              torch.autograd.grad(o, (qf, kf, vf), do.float())):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2, name


@pytest.mark.parametrize("n, n_kv, causal, window", [(200, 300, False, (-1, -1)),
                                                      (300, 170, True, (-1, -1)),
                                                      (250, 250, False, (64, 40))])
def test_128_row_query_blocks_backward_in_the_interpreter(monkeypatch, n, n_kv, causal, window):
    """QUERY_ROWS=128 at D=64 (each warpgroup's dQ is 64 of the block's rows
    over both warpgroups' keys, added as its own 64-row tile) through the
    library's autograd against float64, GQA 2:1, ragged last blocks, masked
    and not."""
    from tk_mlir.kernels import flash_attention as fa
    monkeypatch.setattr(fa, "TALL_QUERY_BLOCKS", True)
    cfg = _interpreted_backward_against_float64(monkeypatch, 64, n, n_kv, causal, window)
    assert cfg["QUERY_ROWS"] == 128 and not cfg["PIPELINE"]


@gpu
@pytest.mark.parametrize("b, h, h_kv, n, n_kv, causal", [(2, 8, 2, 1000, 777, True),
                                                         (1, 4, 4, 4096, 4096, False),
                                                         (3, 2, 1, 80, 300, False),
                                                         (2, 4, 1, 2000, 2000, True)])
def test_128_row_query_blocks_backward_on_the_gpu(monkeypatch, b, h, h_kv, n, n_kv, causal):
    """The tall blocks' gradients against float32 autograd on the GPU (forced
    on, whatever TALL_QUERY_BLOCKS's default)."""
    from tk_mlir.kernels import attention, eager, flash_attention as fa
    monkeypatch.setattr(fa, "TALL_QUERY_BLOCKS", True)
    monkeypatch.setattr(fa, "_PREPARED", eager.Prepared())
    q = torch.randn(b, h, n, 64, device="cuda").to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, h_kv, n_kv, 64, device="cuda").to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    do = torch.randn(b, h, n, 64, device="cuda").to(torch.bfloat16)
    grads = torch.autograd.grad(attention(q, k, v, causal=causal), (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o, _ = _reference(qf, kf, vf, causal, 1 / math.sqrt(64))
    for name, got, ref in zip(("dq", "dk", "dv"), grads,
                              torch.autograd.grad(o, (qf, kf, vf), do.float())):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2, name


def test_wide_and_tall_query_blocks_apply_only_where_they_may(monkeypatch):
    """80 rows at D=128 unmasked; 128 at D=64 masked or not, but not soft-capped
    or deterministic (its dQ turns count 64-row tiles); else 64."""
    from tk_mlir.kernels import flash_attention as fa
    monkeypatch.setattr(fa, "WIDE_QUERY_BLOCKS", True)
    monkeypatch.setattr(fa, "TALL_QUERY_BLOCKS", True)
    rows = fa._backward_query_rows
    assert rows(128, False, (-1, -1), 0.0, False) == 80
    assert {rows(64, False, (-1, -1), 0.0, False), rows(64, True, (-1, -1), 0.0, False),
            rows(64, False, (8, 8), 0.0, False)} == {128}
    assert {rows(128, True, (-1, -1), 0.0, False), rows(64, True, (-1, -1), 5.0, False),
            rows(128, False, (8, 8), 0.0, False), rows(128, False, (-1, -1), 5.0, False),
            rows(128, False, (-1, -1), 0.0, True), rows(64, False, (-1, -1), 0.0, True)} == {64}
    monkeypatch.setattr(fa, "TALL_QUERY_BLOCKS", False)
    assert rows(64, True, (-1, -1), 0.0, False) == 64
    with pytest.raises(tk.CompilationError, match="128 at D=64, without DETERMINISTIC"):
        compile_backward(64, True, query_rows=128, DETERMINISTIC=True)


def test_80_row_query_blocks_compile_without_c75xx_and_fit_shared_memory():
    """At D=128 the 80-row step needs 232064 of the 232448 bytes a block has
    (Q and dO tiles of 80 rows, dSᵀ and dQᵀ of 80 columns): the allocator
    places swizzled tiles before the vectors so no alignment gap is lost.
    dK and dV leave by TMA (DKV_TMA); ptxas spills 64 bytes, three address
    reloads a step in the loop (timed faster than the register stores with
    none there, BENCHMARKS.md)."""
    c = compile_backward(128, False, query_rows=80)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n80k16" in ptx            # Sᵀ, dPᵀ and dQᵀ
    assert '"tk.transpose"' in c.asm["tk"]                          # dQᵀ stored as dQ
    assert re.search(r'"tk.tma_reduce_add"\([^)]*\) : \(!tk.gl<f32, .*?, !tk.st<f32, 80 : i64, '
                     r'64 : i64, 128 : i64>', c.asm["tk"])
    assert "C75" not in c.ptxas_log, c.ptxas_log
    assert c.info["dynamic shared memory (bytes)"] <= 232448
    assert "st.global" not in ptx and "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    assert c.info["spill stores (bytes)"] <= 64, c.ptxas_log
    assert sum(i.startswith(("LDL", "STL")) for i in _step_loop(c.asm["sass"])) <= 3


@pytest.mark.parametrize("causal", [False, True])
def test_128_row_query_blocks_compile_without_c75xx_and_fit_shared_memory(causal):
    """At D=64 the 128-row step (Sᵀ and dPᵀ of 64x128 per warpgroup, dQ's rows
    split between the warpgroups, each added as its own 64-row tile) has no
    serialized wgmma; ptxas spills a few registers around dPᵀ's MMA (at most 14
    LDL/STL a step, timed faster than 64 rows anyway, BENCHMARKS.md)."""
    c = compile_backward(64, causal, query_rows=128)
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in c.asm["ptx"]     # Sᵀ, dPᵀ
    assert re.search(r'"tk.tma_reduce_add"\([^)]*\) : \(!tk.gl<f32, .*?, !tk.st<f32, 64 : i64, '
                     r'64 : i64, 128 : i64>', c.asm["tk"])
    assert "C75" not in c.ptxas_log, c.ptxas_log
    assert c.info["dynamic shared memory (bytes)"] <= 232448
    assert c.info["spill stores (bytes)"] <= 192, c.ptxas_log
    assert sum(i.startswith(("LDL", "STL")) for i in _step_loop(c.asm["sass"])) <= 14


@gpu
def test_backward_schedules_agree():
    """The task table only decides which block runs which task: the causal
    schedule and a plain round-robin one over another grid give the same
    gradients, up to the order of dQ's f32 additions."""
    import math
    import numpy as np
    from tk_mlir.kernels import flash_attention as fa
    from tk_mlir.kernels import schedule
    from tk_mlir.kernels.device import num_sms
    B, H, H_KV, N, D = 2, 4, 2, 700, 64
    q, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    shift, neg_delta = (torch.empty(B, H, 700, device="cuda") for _ in range(2))
    n_tasks = B * H_KV * tk.cdiv(N, 128)
    round_robin = torch.from_numpy(schedule.table(np.arange(n_tasks), np.ones(n_tasks), 7))
    grads = []
    for grid, table in ((num_sms(0), fa.backward_tasks(q, k, True, num_sms(0))),
                        (7, round_robin.cuda())):
        dq = torch.full((B, H, N, D), float("nan"), device="cuda")
        fa.attention_backward_prep_kernel[(tk.cdiv(N, 64), H, B)](
            o, do, fa.padded_rows(lse), neg_delta, neg_delta, shift, dq,
            math.log(1 / math.sqrt(D)), math.sqrt(D), D=D)             # (dLSE unread)
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        fa.attention_backward_kernel[(grid,)](
            q, k, v, do, shift, neg_delta, dq, dk, dv, table, fa.LOG2E / math.sqrt(D),
            math.sqrt(D), D=D, CAUSAL=True, **fa._backward_config(D))
        grads.append((dq, dk.float(), dv.float()))
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, h, h_kv, n, n_kv, d", [(2, 8, 2, 1000, 777, 64),
                                                    (4, 16, 16, 4096, 4096, 128),
                                                    (1, 3, 1, 100, 5000, 128)])
def test_task_tables_run_every_task_once(causal, b, h, h_kv, n, n_kv, d):
    from tk_mlir.kernels.flash_attention import _backward_task_table, _config, _task_table
    bm = 64 * _config(d)["CONSUMERS"]
    for table, count in ((_task_table(b * h, n, n_kv, d, bm, 128, causal, 132),
                          b * h * tk.cdiv(n, bm)),
                         (_backward_task_table(b * h_kv, h // h_kv, n, n_kv, d, causal, 132),
                          b * h_kv * tk.cdiv(n_kv, 128))):
        offsets = table[:133]
        assert offsets[0] == 133 and (offsets[1:] >= offsets[:-1]).all() and \
            offsets[-1] == 133 + count
        assert sorted(table[133:133 + count].tolist()) == list(range(count))
        assert len(table) % 4 == 0


def _reference_grads(q, k, v, do, causal, scale):
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o, _ = _reference(qf, kf, vf, causal, scale)
    o.backward(do.float())
    return qf.grad, kf.grad, vf.grad


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n, n_kv, h_kv", [(128, 128, 4), (1000, 1000, 2), (333, 700, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_float32_autograd(d, n, n_kv, h_kv, causal):
    from tk_mlir.kernels.flash_attention import attention_backward, launch
    g = torch.Generator(device="cuda").manual_seed(d + n + n_kv + h_kv + causal)
    q = torch.randn(2, 4, n, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2, h_kv, n_kv, d, device="cuda", generator=g).bfloat16()
            for _ in range(2))
    do = torch.randn(2, 4, n, d, device="cuda", generator=g).bfloat16()
    scale = 1 / math.sqrt(d)
    o = torch.empty_like(q)
    lse = torch.empty(2, 4, -(-n // 4) * 4, device="cuda")
    launch(q, k, v, o, lse, causal, scale)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse[..., :n], causal, scale)
    torch.cuda.synchronize()
    refs = _reference_grads(q, k, v, do, causal, scale)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert got.shape == ref.shape and got.dtype == q.dtype, name
        assert not got.isnan().any(), name
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, err)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_a_few_training_steps_follow_the_reference_loss_curve(causal):
    """A tiny attention layer (qkv projection, attention, output projection)
    trained for a few SGD steps with tk_mlir's attention and with the float32
    reference: the two loss curves agree."""
    from tk_mlir.kernels import attention
    b, n, h, d = 2, 256, 4, 64
    g = torch.Generator(device="cuda").manual_seed(11 + causal)
    x = torch.randn(b, n, h * d, device="cuda", generator=g)
    target = torch.randn(b, n, h * d, device="cuda", generator=g)
    w0 = [torch.randn(h * d, 3 * h * d, device="cuda", generator=g) / (h * d) ** 0.5,
          torch.randn(h * d, h * d, device="cuda", generator=g) / (h * d) ** 0.5]

    def train(attend):
        w_qkv, w_out = (w.clone().requires_grad_() for w in w0)
        losses = []
        for _ in range(5):
            qkv = (x @ w_qkv).view(b, n, 3, h, d)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            o = attend(q, k, v).transpose(1, 2).reshape(b, n, h * d)
            loss = ((o.float() @ w_out - target) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                for w in (w_qkv, w_out):
                    w -= 0.5 * w.grad
                    w.grad = None
            losses.append(loss.item())
        return losses

    ours = train(lambda q, k, v: attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                           causal=causal).float())
    ref = train(lambda q, k, v: _reference(q, k, v, causal, 1 / math.sqrt(d))[0])
    assert ours[-1] < ours[0]                      # it learns
    for a, r in zip(ours, ref):
        assert abs(a - r) <= 2e-2 * abs(r), (ours, ref)


def test_library_kernel_ops_point_at_the_kernels_own_lines():
    """Ring methods and templates inlined into a library kernel carry the
    kernel's call line (as in a user's kernel), not rings.py's or
    templates.py's: a lint warning or an interpreter report names the call.
    The library's own tk.funcs (schedule.block_tasks) keep their lines, as a
    user's do."""
    c = _compile(64, True, n=1000)
    files = {m.rsplit("/", 1)[-1] for m in re.findall(r'loc\("([^"]+)":', c.asm["tk"])}
    assert files == {"flash_attention.py", "schedule.py"}, files


def test_a_window_wider_than_the_keys_is_no_window(interpret):
    """Sides past every query-key distance bound nothing: the same output as
    -1, not a 32-bit overflow of the kernels' position sums (audit)."""
    from tk_mlir.kernels import attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 100, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    o, lse = attention(q, k, v, return_lse=True)
    o2, lse2 = attention(q, k, v, window=(2**40, 2**31 - 1), return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert torch.equal(attention(q, k, v, window=(-1, 0)),
                       attention(q, k, v, window=(2**31, 0)))


def test_an_empty_batch_has_empty_gradients(interpret):
    from tk_mlir.kernels import attention
    q, k = (torch.randn(0, 2, 16, 64).to(torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(0, 2, 16, 64).to(torch.bfloat16)
    attention(q, k, v).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("n, n_kv, causal", [(0, 5, False), (4, 0, False), (4, 0, True),
                                           (0, 0, True)])
def test_no_queries_or_no_keys_as_sdpa_gives_them(interpret, n, n_kv, causal):
    """N = 0: an empty o; N_kv = 0: rows that see no key, 0 (SDPA's) with lse
    -inf; the gradients zeros, eagerly and from the backward op called
    directly."""
    import tk_mlir.kernels.custom_ops  # noqa: F401
    from tk_mlir.kernels import attention
    g = torch.Generator().manual_seed(n + 3 * n_kv)
    q = torch.randn(1, 2, n, 64, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 2, n_kv, 64, generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    o, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert o.shape == q.shape and not o.any() and lse.shape == (1, 2, n)
    assert (lse == float("-inf")).all()
    grads = torch.autograd.grad(o.float().sum(), (q, k, v))
    direct = torch.ops.tk_mlir.attention_backward(torch.ones_like(o), q, k, v, o.detach(),
                                                 lse.detach(), causal, 0.125)
    for got, want in zip((*grads, *direct), (q, k, v) * 2):
        assert got.shape == want.shape and not got.any()


@pytest.mark.parametrize("causal,deterministic", [(True, False), (False, False), (True, True)])
def test_lse_is_differentiable_in_the_interpreter(interpret, causal, deterministic):
    """A loss through lse and o, and through lse alone (GQA, N < N_kv, a
    ragged last tile), against float64 autograd: the backward takes dlse
    (Delta - dlse), eagerly and through the ops under torch.compile."""
    from tk_mlir.kernels import attention
    g = torch.Generator().manual_seed(21)
    q = torch.randn(1, 4, 100, 64, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 2, 150, 64, generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    do, dl = torch.randn(1, 4, 100, 64, generator=g), torch.randn(1, 4, 100, generator=g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro, rlse = _reference(*ref_in, causal, 0.125)
    ro, rlse = ro.double(), rlse.double()

    def loss(o, lse):
        return (o.float() * do).sum() + (lse * dl).sum()

    def fn(q, k, v):
        return attention(q, k, v, causal=causal, scale=0.125, deterministic=deterministic,
                         return_lse=True)
    cases = [(fn, loss, 3), (fn, lambda o, lse: (lse * dl).sum(), 2)]     # (v: no path)
    if not deterministic:
        cases.append((torch.compile(fn, backend="aot_eager", fullgraph=True), loss, 3))
    for f, lossf, inputs in cases:
        got = torch.autograd.grad(lossf(*f(q, k, v)), (q, k, v)[:inputs])
        want = torch.autograd.grad(lossf(ro, rlse), ref_in[:inputs], retain_graph=True)
        for a, b in zip(got, want):
            assert ((a.double() - b).norm() / b.norm()).item() < 1e-2


def test_head_dim_256_with_grad_warns_at_the_forward(interpret):
    """D=256 has no backward: an input that requires grad is warned of where
    the forward is called, not first heard of at backward."""
    from tk_mlir.kernels import attention
    q = torch.randn(1, 2, 64, 256).to(torch.bfloat16).requires_grad_()
    with pytest.warns(UserWarning, match="head dim 256 has a forward only") as caught:
        attention(q, q.detach(), q.detach())
    assert caught[0].filename == __file__
