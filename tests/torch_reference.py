"""What the library's torch tests compare with (tests/ is on sys.path: conftest)."""


def relative_error(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ of two torch tensors, in float64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


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
