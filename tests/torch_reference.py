"""What the library's torch tests compare with (tests/ is on sys.path: conftest)."""


def relative_error(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ of two torch tensors, in float64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()
