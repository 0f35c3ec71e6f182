"""What the library's torch tests compare with (tests/ is on sys.path: conftest)."""


def relative_error(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ of two torch tensors, in float64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


def gemm_operands(M, N, K, *, b_kn=False, a_km=False, batch=None, device="cpu"):
    """(a, b, the float64 product): bf16 operands drawn uniform in [-1, 1], a as
    M x K (K x M with a_km), b as N x K (K x N with b_kn), with a leading
    `batch` dim when given."""
    import torch
    outer = () if batch is None else (batch,)
    a = torch.empty(*outer, *((K, M) if a_km else (M, K)), device=device).uniform_(-1, 1)
    b = torch.empty(*outer, *((K, N) if b_kn else (N, K)), device=device).uniform_(-1, 1)
    a, b = a.bfloat16(), b.bfloat16()
    ad = a.double().transpose(-1, -2) if a_km else a.double()
    bd = b.double() if b_kn else b.double().transpose(-1, -2)
    return a, b, ad @ bd


def assert_compiled_matches_eager(f, *inputs) -> None:
    """f under torch.compile(fullgraph=True) (backend aot_eager: the custom ops
    and their backward ops traced, no Inductor) gives eager's output and
    gradients of output.float().sum() to `inputs`, the same bits."""
    import torch
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        o = fn(*inputs)
        results.append((o, *torch.autograd.grad(o.float().sum(), inputs)))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
