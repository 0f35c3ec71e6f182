"""attention_with_kvcache (tk_mlir/kernels/decode_attention.py): attention of a
few new tokens over a dense or paged KV cache, GQA-packed and split over the
keys.

Without a GPU: the kernels in the interpreter against float64 torch, for
ragged cache lengths (0 and the full cache among them), 1 and 4 new tokens,
GQA 8:1, causal or not, a shuffled page table (pages smaller than, and larger
than, a key block), appending k/v, the split and the unsplit path; the cache
past each length is NaN (it must not leak); the argument rules. With a GPU
(`-m gpu`): the same against float32 at decode shapes, and under CUDA-graph
capture.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import attention_with_kvcache  # noqa: E402
from tk_mlir.kernels import decode_attention  # noqa: E402

from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu


def reference(q, k_cache, v_cache, lens, causal, table=None, scale=None, window=(-1, -1),
              softcap=0.0):
    """float64 attention of q (B, N, H, D) over each batch's first lens[b]
    keys of the cache (paged through `table`), new token t at key position
    lens[b] - N + t: (o, lse (B, H, N))."""
    B, N, H, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    o = torch.zeros(B, N, H, D, dtype=torch.float64)
    lse = torch.full((B, H, N), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if table is None:
            k, v = k_cache[b, :n], v_cache[b, :n]
        else:
            page = k_cache.shape[1]
            rows = [int(table[b, j // page]) * page + j % page for j in range(n)]
            k = k_cache.flatten(0, 1)[rows]
            v = v_cache.flatten(0, 1)[rows]
        g = H // k.shape[1]
        k = k.cpu().double().repeat_interleave(g, 1)
        v = v.cpu().double().repeat_interleave(g, 1)
        s = torch.einsum("nhd,khd->hnk", q[b].cpu().double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        key, pos = torch.arange(n)[None], torch.arange(N)[:, None] + n - N
        left, right = window[0], 0 if causal else window[1]
        hidden = torch.zeros(N, n, dtype=torch.bool)
        if right >= 0:
            hidden |= key > pos + right
        if left >= 0:
            hidden |= key < pos - left
        s = s.masked_fill(hidden, float("-inf"))
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.einsum("hnk,khd->nhd", torch.softmax(s, -1).nan_to_num(), v)
    return o, lse


def _uniform(*shape, generator, device="cpu"):
    return (torch.rand(*shape, generator=generator) * 2 - 1).to(bf16).to(device)


def _cache(B, n_max, h_kv, d, lens, generator, device="cpu"):
    """A dense cache with random keys below each length and NaN past it."""
    k = torch.full((B, n_max, h_kv, d), float("nan"), dtype=bf16)
    v = k.clone()
    for b in range(B):
        k[b, :lens[b]] = _uniform(int(lens[b]), h_kv, d, generator=generator)
        v[b, :lens[b]] = _uniform(int(lens[b]), h_kv, d, generator=generator)
    return k.to(device), v.to(device)


def _paged(k, v, page, generator):
    """The dense cache k, v cut into pages of `page` keys in a shuffled order,
    and the block table that maps each batch's key blocks to them."""
    B, n_max = k.shape[:2]
    per = n_max // page
    order = torch.randperm(B * per, generator=generator)
    table = order.view(B, per).to(torch.int32)
    kp = torch.empty(B * per, page, *k.shape[2:], dtype=k.dtype)
    vp = torch.empty_like(kp)
    kp[order] = k.view(B * per, page, *k.shape[2:])
    vp[order] = v.view(B * per, page, *v.shape[2:])
    return kp, vp, table


@pytest.mark.parametrize("new, h, h_kv, causal, batch", [
    (1, 8, 2, True, 2),        # GQA 4:1, split over the keys (3 simulated SMs)
    (4, 8, 1, True, 2),        # GQA 8:1, speculative decoding's 4 tokens
    (4, 4, 4, False, 3),       # MHA, not causal
    (1, 4, 1, True, 6),        # enough tasks: one chunk per (batch, head), no combine
])
def test_dense_cache_in_the_interpreter(interpret, new, h, h_kv, causal, batch):
    g = torch.Generator().manual_seed(new * 31 + h + batch)
    n_max, d = 300, 64
    lens = torch.tensor([300, 0, 137, 5, 64, 129][:batch], dtype=torch.int32)
    lens = torch.maximum(lens, torch.tensor(new if causal else 0, dtype=torch.int32))
    k, v = _cache(batch, n_max, h_kv, d, lens, g)
    q = _uniform(batch, new, h, d, generator=g)
    o, lse = attention_with_kvcache(q, k, v, lens, causal=causal, return_lse=True)
    ro, rlse = reference(q, k, v, lens, causal)
    assert o.shape == q.shape and lse.shape == (batch, h, new)
    assert _rel(o, ro) < 1e-2
    finite = rlse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    assert _rel(lse[finite], rlse[finite]) < 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_more_new_tokens_than_the_cache_holds_when_none_are_written(interpret, causal, paged):
    """N_new = 40 queries over a cache of 32 keys (16-key pages), no k and v
    to write: as attention with N > N_kv (causal: the first rows see no key,
    0 and lse -inf)."""
    g = torch.Generator().manual_seed(40 + causal + 2 * paged)
    lens = torch.tensor([32, 9], dtype=torch.int32)
    k, v = _cache(2, 32, 1, 64, lens, g)
    q = _uniform(2, 40, 2, 64, generator=g)
    table = None
    if paged:
        k, v, table = _paged(k, v, 16, g)
    o, lse = attention_with_kvcache(q, k, v, lens, block_table=table, causal=causal,
                                    return_lse=True)
    ro, rlse = reference(q, k, v, lens, causal, table)
    assert _rel(o, ro) < 1e-2
    finite = rlse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and _rel(lse[finite], rlse[finite]) < 1e-3


@pytest.mark.parametrize("causal, window, softcap", [
    (True, (100, -1), 0.0),        # a window's left edge mid-block, blocks before it skipped
    (False, (37, 5), 0.0),         # both edges, not causal (rows see 5 keys ahead... none here)
    (False, (-1, -1), 8.0),        # Gemma-2's soft-capping
    (True, (70, 0), 2.0),          # both
])
def test_window_and_softcap_in_the_interpreter(interpret, causal, window, softcap):
    g = torch.Generator().manual_seed(window[0] + 11)
    B, new, h, h_kv, d, n_max = 2, 4, 4, 2, 64, 512
    lens = torch.tensor([500, 90], dtype=torch.int32)
    k, v = _cache(B, n_max, h_kv, d, lens, g)
    k = k * 4                                     # large scores: the cap bites
    kp, vp, table = _paged(k, v, 32, g)
    q = _uniform(B, new, h, d, generator=g)
    o, lse = attention_with_kvcache(q, kp, vp, lens, block_table=table, causal=causal,
                                    window=window, softcap=softcap, return_lse=True)
    ro, rlse = reference(q, kp, vp, lens, causal, table, window=window, softcap=softcap)
    assert _rel(o, ro) < 1e-2
    finite = rlse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and _rel(lse[finite], rlse[finite]) < 1e-3


def test_blocks_outside_the_window_are_not_read(interpret):
    """Key blocks wholly before the window are never loaded: NaN there does
    not reach the output (a block that was read would carry it through P·V)."""
    g = torch.Generator().manual_seed(12)
    lens = torch.tensor([1000], dtype=torch.int32)
    k, v = _cache(1, 1024, 1, 64, lens, g)
    q = _uniform(1, 1, 2, 64, generator=g)
    ref = reference(q, k, v, lens, True, window=(100, 0))[0]
    first_block = (999 - 100) // decode_attention._config(64, 0)["BN"]
    k[:, :first_block * decode_attention._config(64, 0)["BN"]] = float("nan")
    v[:, :first_block * decode_attention._config(64, 0)["BN"]] = float("nan")
    o = attention_with_kvcache(q, k, v, lens, window=(100, 0))
    assert first_block > 0 and _rel(o, ref) < 1e-2


@pytest.mark.parametrize("splits", [3, 11])
@pytest.mark.parametrize("fused", [True, False])
def test_split_keys_merge_by_lse(interpret, monkeypatch, splits, fused):
    """The keys cut into 3 or 11 chunks (the merge takes 8 at a time: 11 is
    one full group and a ragged one), 32 query rows per K/V head (two merge
    row blocks), a short sequence whose later chunks are empty; merged by
    the last chunk of each row block (fused) or by kv_combine_kernel."""
    monkeypatch.setattr(decode_attention, "_splits", lambda *a: splits)
    monkeypatch.setattr(decode_attention, "FUSED_MERGE", fused)
    g = torch.Generator().manual_seed(splits)
    lens = torch.tensor([600, 70], dtype=torch.int32)
    k, v = _cache(2, 640, 1, 64, lens, g)
    q = _uniform(2, 4, 8, 64, generator=g)
    o, lse = attention_with_kvcache(q, k, v, lens, return_lse=True)
    ro, rlse = reference(q, k, v, lens, True)
    assert _rel(o, ro) < 1e-2 and _rel(lse, rlse) < 1e-3


def test_empty_cache_rows_are_zero(interpret):
    """A batch with no keys (cache_seqlens 0, not causal) gets output 0 and LSE -inf."""
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([0, 40], dtype=torch.int32)
    k, v = _cache(2, 64, 1, 64, lens, g)
    q = _uniform(2, 1, 2, 64, generator=g)
    o, lse = attention_with_kvcache(q, k, v, lens, causal=False, return_lse=True)
    assert not o[0].any() and (lse[0] == float("-inf")).all()
    assert _rel(o[1], reference(q, k, v, lens, False)[0][1]) < 1e-2


def test_flash_attentions_keyword_names_are_taken(interpret):
    """softmax_scale, window_size and return_softmax_lse (flash_attn_with_kvcache's
    names) as scale, window and return_lse."""
    g = torch.Generator().manual_seed(12)
    lens = torch.tensor([5, 40], dtype=torch.int32)
    k, v = _cache(2, 64, 1, 64, lens, g)
    q = _uniform(2, 1, 2, 64, generator=g)
    ours = attention_with_kvcache(q, k, v, lens, scale=0.2, window=(8, -1), return_lse=True)
    theirs = attention_with_kvcache(q, k, v, cache_seqlens=lens, softmax_scale=0.2,
                                    window_size=(8, -1), return_softmax_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    with pytest.raises(TypeError, match=r"window_size is FlashAttention's name for window"):
        attention_with_kvcache(q, k, v, lens, window=(4, -1), window_size=(8, -1))
    with pytest.raises(TypeError, match=r"return_softmax_lse must be a bool, got 1"):
        attention_with_kvcache(q, k, v, lens, return_softmax_lse=1)     # (the caller's name)


def test_an_input_that_requires_grad_is_warned_of(interpret):
    """No gradient flows through decode: a q that requires grad (grad mode on)
    is warned of at the caller's line, not silently cut; under no_grad, not."""
    import warnings
    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([30], dtype=torch.int32)
    k, v = _cache(1, 64, 1, 64, lens, g)
    q = _uniform(1, 1, 2, 64, generator=g).requires_grad_()
    with pytest.warns(UserWarning, match="attention_with_kvcache returns no gradient") as w:
        attention_with_kvcache(q, k, v, lens)
    assert w[0].filename == __file__
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        attention_with_kvcache(q, k, v, lens)


@pytest.mark.parametrize("page", [16, 48, 64, 176, 256])
def test_paged_cache_in_the_interpreter(interpret, page):
    """Pages smaller than a key block (several TMA loads per block), equal to
    it, and larger (a block is part of a page), in a shuffled order; pages
    of 48 and 176 keys (multiples of 16, not powers of two: four pages a
    192-key block, and 16-key blocks in each page)."""
    g = torch.Generator().manual_seed(page)
    B, n_max, h, h_kv, d = 2, -(-512 // page) * page, 4, 2, 64
    lens = torch.tensor([300, 33], dtype=torch.int32)
    k, v = _cache(B, n_max, h_kv, d, lens, g)
    kp, vp, table = _paged(k, v, page, g)
    q = _uniform(B, 2, h, d, generator=g)
    o = attention_with_kvcache(q, kp, vp, lens, block_table=table)
    assert _rel(o, reference(q, kp, vp, lens, True, table)[0]) < 1e-2


@pytest.mark.parametrize("paged", [False, True])
def test_append_then_attend(interpret, paged):
    """k and v are written into the cache at cache_seqlens, then attended:
    the same as attending over a cache that already held them."""
    g = torch.Generator().manual_seed(7)
    B, n_max, new, h, h_kv, d = 2, 128, 3, 4, 2, 64
    lens = torch.tensor([50, 0], dtype=torch.int32)
    k, v = _cache(B, n_max, h_kv, d, lens, g)
    kn, vn = _uniform(B, new, h_kv, d, generator=g), _uniform(B, new, h_kv, d, generator=g)
    q = _uniform(B, new, h, d, generator=g)
    full_k, full_v = k.clone(), v.clone()
    for b in range(B):
        full_k[b, lens[b]:lens[b] + new], full_v[b, lens[b]:lens[b] + new] = kn[b], vn[b]
    table = None
    if paged:
        k, v, table = _paged(k, v, 16, g)
    o = attention_with_kvcache(q, k, v, lens, block_table=table, k=kn, v=vn)
    ro = reference(q, full_k, full_v, lens + new, True)[0]
    assert _rel(o, ro) < 1e-2
    if paged:
        k = k[table.long()].flatten(1, 2)          # back to (B, n_max, ...) order
        v = v[table.long()].flatten(1, 2)
    for b in range(B):
        n = int(lens[b]) + new
        assert torch.equal(k[b, :n], full_k[b, :n]) and torch.equal(v[b, :n], full_v[b, :n])


def test_the_append_of_many_kv_heads_goes_in_column_pieces():
    """H_kv past one (heads, D) tile's register budget (column_pieces): the
    append copies column pieces, every head and column in its place."""
    from tk_mlir.kernels.decode_attention import kv_append_kernel
    g = torch.Generator().manual_seed(9)
    B, new, h_kv, d, n_max = 2, 2, 300, 128, 8
    kn, vn = _uniform(B, new, h_kv, d, generator=g), _uniform(B, new, h_kv, d, generator=g)
    k, v = (torch.full((B, n_max, h_kv, d), float("nan"), dtype=kn.dtype) for _ in range(2))
    lens = torch.tensor([3, 0, 0, 0], dtype=torch.int32)       # (rows of whole 16-byte vectors)
    kv_append_kernel.interpret[(new, B)](kn, vn, k, v, lens, lens, n_max, HB=512, D=d)
    for b, at in ((0, 3), (1, 0)):
        assert torch.equal(k[b, at:at + new], kn[b]) and torch.equal(v[b, at:at + new], vn[b])
    assert k[0, :3].isnan().all() and k[1, new:].isnan().all()


def test_a_length_past_the_cache_gives_nan_on_the_gpu_path(interpret):
    """The GPU cannot report a bad cache_seqlens without a synchronisation:
    its rows come out NaN (the CPU check is skipped here to see it)."""
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([64, 20], dtype=torch.int32)
    k, v = _cache(2, 64, 1, 64, lens, g)
    q = _uniform(2, 1, 2, 64, generator=g)
    o, _ = decode_attention.forward(q, k, v, lens + torch.tensor([1, 0], dtype=torch.int32),
                                    None, None, None, True, 0.125)
    assert o[0].isnan().all() and not o[1].isnan().any()
    # Appending past the cache writes nothing there (and its rows are NaN as well); the
    # other batch's key lands at its length.
    kn = _uniform(2, 1, 1, 64, generator=g)
    before = k.clone()
    o, _ = decode_attention.forward(q, k, v, lens, None, kn, kn, True, 0.125)
    assert torch.equal(k[0].nan_to_num(), before[0].nan_to_num())      # batch 0's: past the end
    assert torch.equal(k[1, 20], kn[1, 0]) and o[0].isnan().all()


@pytest.mark.parametrize("paged", [False, True])
def test_a_negative_length_appends_nothing_and_gives_nan_on_the_gpu_path(interpret, paged):
    """A negative cache_seqlens (even one the new tokens bring to >= 0) writes
    no key anywhere and gives NaN rows, not another batch's row overwritten
    (a paged append at position -1 would read block_table[b, -1])."""
    g = torch.Generator().manual_seed(6)
    lens = torch.tensor([30, 20], dtype=torch.int32)
    k, v = _cache(2, 64, 1, 64, lens, g)
    table = None
    if paged:
        k, v, table = _paged(k, v, 16, g)
    q, kn = _uniform(2, 2, 2, 64, generator=g), _uniform(2, 2, 1, 64, generator=g)
    before = k.clone()
    bad = torch.tensor([30, -1], dtype=torch.int32)
    o, _ = decode_attention.forward(q, k, v, bad, table, kn, kn, True, 0.125)
    assert o[1].isnan().all() and not o[0].isnan().any()
    changed = (k.nan_to_num() != before.nan_to_num()).any(-1).any(-1).nonzero().tolist()
    if paged:   # batch 0's two new keys, at positions 30 and 31: its second page, rows 14, 15
        assert changed == [[int(table[0, 1]), 14], [int(table[0, 1]), 15]]
    else:
        assert changed == [[0, 30], [0, 31]]


def _args(**change):
    args = dict(q=torch.zeros(2, 1, 4, 64, dtype=bf16), k_cache=torch.zeros(2, 32, 2, 64,
                dtype=bf16), v_cache=torch.zeros(2, 32, 2, 64, dtype=bf16),
                cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
    args.update(change)
    return args


def _caches(*shape, **change):
    """_args' changes for a k_cache and v_cache of zeros of `shape`, and `change`."""
    return dict(k_cache=torch.zeros(*shape, dtype=bf16), v_cache=torch.zeros(*shape, dtype=bf16),
                **change)


def _shared_page_append(lengths):
    """_args' changes for a paged cache of 16-key pages whose two batches'
    tables both start at page 1, each appending one token at `lengths`."""
    return _caches(4, 16, 2, 64, block_table=torch.tensor([[1, 0], [1, 2]], dtype=torch.int32),
                   cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                   k=torch.zeros(2, 1, 2, 64, dtype=bf16), v=torch.zeros(2, 1, 2, 64, dtype=bf16))


@pytest.mark.parametrize("change, error, rule", [
    (dict(cache_seqlens=torch.tensor([3, 4])), TypeError, r"cache_seqlens must be .*int32"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError,
     r"cache_seqlens must have shape \(2,\)"),
    (_caches(2, 32, 3, 64), ValueError, r"H_kv=3 must divide the query heads H=4"),
    (_caches(4, 24, 2, 64, block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     r"page size .* multiple of 16 from 16 to 256, got 24"),
    (_caches(4, 16, 2, 64, block_table=torch.zeros(2, 2)), TypeError,
     r"block_table must be .*int32"),
    (_caches(4, 16, 2, 64, block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     r"block_table must be \(B=2, max_pages\)"),
    (dict(cache_seqlens=torch.tensor([3, 4], dtype=torch.int32, device="meta")), ValueError,
     r"cache_seqlens must be on q's device cpu, got meta"),
    (_caches(4, 16, 2, 64, block_table=torch.zeros(2, 2, dtype=torch.int32, device="meta")),
     ValueError, r"block_table must be on q's device cpu, got meta"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=bf16)), ValueError, r"k and v come together"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=bf16), v=torch.zeros(2, 2, 2, 64, dtype=bf16)),
     ValueError, r"v must have shape \(2, 1, 2, 64\)"),
    (dict(cache_seqlens=torch.tensor([3, 32], dtype=torch.int32),
          k=torch.zeros(2, 1, 2, 64, dtype=bf16), v=torch.zeros(2, 1, 2, 64, dtype=bf16)),
     ValueError, r"cache_seqlens\[1\] = 32 plus 1 new tokens is outside the cache's 0..32"),
    (dict(q=torch.zeros(2, 1, 4, 80, dtype=bf16)), ValueError, r"D must be 64, 128 or 256"),
    (_caches(4, 16, 2, 64, block_table=torch.tensor([[9, -1], [2, 3]], dtype=torch.int32)),
     ValueError,
     r"block_table\[0, 0\] = 9 is not a page of k_cache's 4 \(batch 0 uses its first 1"),
    (dict(cache_seqlens=torch.tensor([-1, 4], dtype=torch.int32),
          k=torch.zeros(2, 2, 2, 64, dtype=bf16), v=torch.zeros(2, 2, 2, 64, dtype=bf16),
          q=torch.zeros(2, 2, 4, 64, dtype=bf16)), ValueError,
     r"cache_seqlens\[0\] = -1 is negative"),         # (-1 + 2 new tokens is no excuse)
    # two batches appending into one page slot (their tables share page 1)
    (_shared_page_append([5, 5]), ValueError,
     r"block_table sends batch 0's new token 0 and batch 1's new token 0 to one slot "
     r"\(row 5 of page 1\)"),
    # an append into a slot another batch keeps a cached key in
    (_shared_page_append([4, 8]), ValueError,
     r"sends batch 0's new token 0 to row 4 of page 1, which holds batch 1's cached key 4"),
    (dict(q=torch.zeros(2, 0, 4, 64, dtype=bf16)), ValueError, r"at least one new token"),
    (dict(window=(4,)), TypeError, r"window must be \(left, right\), two ints >= -1"),
    (dict(window=(-2, 0)), ValueError, r"window must be"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap=2e4), ValueError, r"softcap must be at most 10000"),
    (_caches(2, 0, 2, 64), ValueError,
     r"the cache must hold keys \(N_max, its keys per batch >= 1\)"),
    (_caches(0, 16, 2, 64, block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     r"the cache must hold keys \(num_pages >= 1\)"),
    (_caches(4, 16, 2, 64, block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError,
     r"block_table must be \(B=2, max_pages\), max_pages >= 1, got \(2, 0\)"),
    # a cache its rows cannot be read from in place (66-element rows cut to 64)
    (dict(k_cache=torch.zeros(2, 32, 2, 66, dtype=bf16)[..., :64]), ValueError,
     r"k_cache's rows must start 16-byte aligned .* got strides \(4224, 132, 66, 1\)"),
    # a cache that starts mid-row (a view at an odd offset): the pointer is named
    (dict(k_cache=torch.zeros(2 * 32 * 2 * 64 + 3, dtype=bf16)[3:].view(2, 32, 2, 64)),
     ValueError, r"k_cache's rows must start 16-byte aligned .* got strides \(4096, 128, 64, "
                 r"1\) and a data pointer 6 bytes past a 16-byte boundary"),
    # an expanded cache is read fine, but appending into it would mix the batches
    (dict(k_cache=torch.zeros(1, 32, 2, 64, dtype=bf16).expand(2, -1, -1, -1),
          k=torch.zeros(2, 1, 2, 64, dtype=bf16), v=torch.zeros(2, 1, 2, 64, dtype=bf16)),
     ValueError, r"k_cache \(k and v are appended into it\) is written in place and must not "
                 r"have elements that share memory"),
])
def test_argument_rules(interpret, change, error, rule):
    with pytest.raises(error, match=rule):
        attention_with_kvcache(**_args(**change))


# ------------------------------------------------------------------ GPU

def _gpu_case(B, new, h, h_kv, d, n_max, page=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(new, n_max - new + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = n_max - new
    k, v = _cache(B, n_max, h_kv, d, lens, g)
    table = None
    if page:
        k, v, table = _paged(k, v, page, g)
        table = table.cuda()
    q = _uniform(B, new, h, d, generator=g)
    return q.cuda(), k.cuda(), v.cuda(), lens.cuda(), table


@gpu
@pytest.mark.parametrize("B, new, h, h_kv, d, n_max, page", [
    (8, 1, 32, 8, 128, 2048, 0),
    (3, 4, 16, 2, 128, 1000 // 16 * 16, 0),
    (1, 1, 32, 8, 128, 8192, 0),
    (4, 1, 8, 1, 64, 1024, 16),
    (2, 2, 16, 4, 128, 2048, 256),
    (2, 1, 8, 8, 256, 512, 0),
])
def test_matches_float64_on_the_gpu(B, new, h, h_kv, d, n_max, page):
    q, k, v, lens, table = _gpu_case(B, new, h, h_kv, d, n_max, page, seed=B + d)
    o, lse = attention_with_kvcache(q, k, v, lens, block_table=table, return_lse=True)
    ro, rlse = reference(q, k, v, lens.cpu(), True, None if table is None else table.cpu())
    assert _rel(o.cpu(), ro) < 1e-2
    assert _rel(lse.cpu(), rlse) < 1e-4


@gpu
@pytest.mark.parametrize("B, new, h, h_kv, d, n_max", [(1, 1, 32, 8, 128, 8192),
                                                      (3, 4, 16, 2, 64, 1000 // 16 * 16),
                                                      (2, 1, 8, 8, 256, 512)])
def test_the_merge_by_the_last_chunk_on_the_gpu(monkeypatch, B, new, h, h_kv, d, n_max):
    """FUSED_MERGE: the last split chunk merges the others' partials, on the
    GPU against float64, and again replayed in a CUDA graph (its count table
    is zeroed by each call)."""
    monkeypatch.setattr(decode_attention, "FUSED_MERGE", True)
    q, k, v, lens, _ = _gpu_case(B, new, h, h_kv, d, n_max, 0, seed=5 + d)
    bn = decode_attention._config(d, 0)["BN"]
    tasks = B * h_kv * -(-new * (h // h_kv) // 64)
    assert decode_attention._splits(tasks, -(-n_max // bn), 0) > 1          # (merged, as forward)
    ro, rlse = reference(q, k, v, lens.cpu(), True)
    o, lse = attention_with_kvcache(q, k, v, lens, return_lse=True)
    assert _rel(o.cpu(), ro) < 1e-2 and _rel(lse.cpu(), rlse) < 1e-4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attention_with_kvcache(q, k, v, lens)
    for _ in range(2):
        o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(o.cpu(), ro) < 1e-2


@gpu
@pytest.mark.parametrize("window, softcap, page", [((1000, -1), 0.0, 0), ((300, -1), 30.0, 16),
                                                   ((-1, -1), 20.0, 256)])
def test_window_and_softcap_on_the_gpu(window, softcap, page):
    q, k, v, lens, table = _gpu_case(4, 2, 32, 8, 128, 4096, page, seed=21)
    o = attention_with_kvcache(q, k, v, lens, block_table=table, window=window, softcap=softcap)
    ro, _ = reference(q, k, v, lens.cpu(), True, None if table is None else table.cpu(),
                      window=window, softcap=softcap)
    assert _rel(o.cpu(), ro) < 1e-2


@gpu
def test_cuda_graph_replays_a_decode_step():
    q, k, v, lens, _ = _gpu_case(4, 1, 16, 4, 128, 1024, seed=11)
    lens.fill_(100)
    kn = torch.rand(4, 1, 4, 128, device="cuda").to(bf16)
    attention_with_kvcache(q, k, v, lens, k=kn, v=kn)          # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attention_with_kvcache(q, k, v, lens, k=kn, v=kn)
    for step in range(3):
        lens.fill_(200 + step)
        kn.copy_(torch.rand_like(kn.float()).to(bf16))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(q, k, v, lens.cpu() + 1, True)[0]
        assert _rel(o.cpu(), ref) < 1e-2


def test_compiled_decode_step_appends_and_attends(interpret):
    """Under torch.compile(fullgraph=True) the call is the custom op, which
    writes k, v into the caches (its declared mutation) and attends, as eager."""
    g = torch.Generator().manual_seed(9)
    lens = torch.tensor([40, 7], dtype=torch.int32)
    k, v = _cache(2, 64, 2, 64, lens, g)
    kn, vn = _uniform(2, 1, 2, 64, generator=g), _uniform(2, 1, 2, 64, generator=g)
    q = _uniform(2, 1, 4, 64, generator=g)
    k2, v2 = k.clone(), v.clone()
    eager, eager_lse = attention_with_kvcache(q, k, v, lens, k=kn, v=vn, return_lse=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, kc, vc, lens, kn, vn):
        return attention_with_kvcache(q, kc, vc, lens, k=kn, v=vn, return_lse=True)

    o, lse = step(q, k2, v2, lens, kn, vn)
    assert torch.equal(o, eager) and torch.equal(lse, eager_lse)
    assert torch.equal(k2.nan_to_num(), k.nan_to_num()) and torch.equal(v2.nan_to_num(),
                                                                        v.nan_to_num())


def test_opcheck(interpret):
    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([20, 33], dtype=torch.int32)
    k, v = _cache(2, 64, 1, 64, lens, g)
    k, v = k.nan_to_num(), v.nan_to_num()
    q = _uniform(2, 2, 2, 64, generator=g)
    kn, vn = _uniform(2, 2, 1, 64, generator=g), _uniform(2, 2, 1, 64, generator=g)
    torch.library.opcheck(torch.ops.tk_mlir.attention_with_kvcache,
                          (q, k, v, lens, None, kn, vn, True, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def test_an_empty_batch_and_a_window_wider_than_the_cache(interpret):
    bf = torch.bfloat16
    empty = attention_with_kvcache(torch.randn(0, 1, 2, 64, dtype=bf),
                                   torch.randn(0, 16, 2, 64, dtype=bf),
                                   torch.randn(0, 16, 2, 64, dtype=bf),
                                   torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, 1, 2, 64)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 4, 64, generator=g).to(bf)
    kc, vc = (torch.randn(1, 300, 2, 64, generator=g).to(bf) for _ in range(2))
    n = torch.tensor([300], dtype=torch.int32)
    assert torch.equal(attention_with_kvcache(q, kc, vc, n),
                       attention_with_kvcache(q, kc, vc, n, window=(2**30, -1)))


@pytest.mark.parametrize("d, page", [(64, 48), (128, 80), (128, 176), (256, 48)])
def test_the_paged_kernel_compiles_without_spills_at_any_page_size(d, page, ptxas):
    """ptxas on the paged split kernel at page sizes that are multiples of 16
    but not powers of two: whole pages per key block (48 into D=64's 192),
    a block of one page (80), 16-key blocks in a page no larger block
    divides (176)."""
    import tk_mlir as tk
    B, HK, R, pages = 8, 8, 4, 64
    cfg = decode_attention._config(d, page)
    assert page % cfg["BN"] == 0 or cfg["BN"] % page == 0
    c = decode_attention.kv_cache_attention_kernel.compile(
        tk.spec((B, HK, R, d), tk.bf16), tk.spec((pages, HK, page, d), tk.bf16),
        tk.spec((pages, HK, page, d), tk.bf16), tk.spec((B * HK, 2, R, d), tk.f32),
        tk.spec((B * HK, 2, 4), tk.f32), tk.spec((B,), "i32"), tk.spec((B, 8), "i32"),
        tk.spec((B, HK, R, d), tk.bf16), tk.spec((B, HK, 4), tk.f32), tk.spec((B * HK,), "i32"),
        0.1, 0, 4, 8 * page, -1, 0, 1.0, D=d, PAGE=page, SPLIT=True, MERGE=True, **cfg)
    assert c.info["spill stores (bytes)"] == c.info["spill loads (bytes)"] == 0, c.ptxas_log
    assert "C75" not in c.ptxas_log, c.ptxas_log


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_kernel_compiles_without_spills_with_its_merge(d):
    """ptxas (no GPU needed) on the split kernel with the merge of its last
    chunk (MERGE): no spill, no C75xx advisory, at every head dim."""
    import tk_mlir as tk
    B, HK, R = 8, 8, 4
    c = decode_attention.kv_cache_attention_kernel.compile(
        tk.spec((B, HK, R, d), tk.bf16), tk.spec((B, HK, 8192, d), tk.bf16),
        tk.spec((B, HK, 8192, d), tk.bf16), tk.spec((B * HK, 2, R, d), tk.f32),
        tk.spec((B * HK, 2, 4), tk.f32), tk.spec((B,), "i32"), tk.spec((B,), "i32"),
        tk.spec((B, HK, R, d), tk.bf16), tk.spec((B, HK, 4), tk.f32), tk.spec((B * HK,), "i32"),
        0.1, 0, 4, 8192, -1, 0, 1.0, D=d, PAGE=0, SPLIT=True, MERGE=True,
        **decode_attention._config(d, 0))
    assert c.info["spill stores (bytes)"] == c.info["spill loads (bytes)"] == 0, c.ptxas_log
    assert "C75" not in c.ptxas_log, c.ptxas_log
