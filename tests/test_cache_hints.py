"""tk.load / tk.store cache hints: `cache="stream"` becomes .cs accesses."""
import pytest

import tk_mlir as tk
from tk_mlir import bf16


@tk.kernel(num_warps=4)
def copy_hinted(X: tk.gl[bf16], Y: tk.gl[bf16], HINT: tk.constexpr):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (16, 64), cache=HINT), (i, 0), cache=HINT)


def _ptx(hint):
    spec = tk.spec((100, 64), tk.bf16)
    return copy_hinted.compile(spec, spec, HINT=hint).asm["ptx"]


def test_stream_hint_uses_cache_streaming_accesses():
    ptx = _ptx("stream")
    assert "ld.global.cs.v4.b32" in ptx and "st.global.cs.v4.b32" in ptx
    assert "ld.global.v4.b32" not in ptx


def test_normal_hint_is_a_plain_access():
    ptx = _ptx("normal")
    assert "ld.global.v4.b32" in ptx and ".cs" not in ptx


def test_unknown_hint_is_refused_at_its_line():
    with pytest.raises(tk.CompilationError, match="cache must be one of") as e:
        _ptx("lru")
    assert e.value.line is not None and "tk.load" in str(e.value)


@pytest.mark.gpu
def test_stream_hint_copies_correctly_on_the_gpu():
    torch = pytest.importorskip("torch")
    x = (torch.rand(100, 64, device="cuda") - 0.5).to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    copy_hinted[(tk.cdiv(100, 16),)](x, y, HINT="stream")
    torch.cuda.synchronize()
    assert torch.equal(x, y)
