"""Find a test file's line by the marker comment at its end (`# E:<name>`):
error tests assert that a compile error points at that line."""
from pathlib import Path


def marked(path: Path, marker: str) -> tuple[int, str]:
    """(line number, text) of the one line of `path` ending in `# E:<marker>`."""
    lines = Path(path).read_text().splitlines()
    hits = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# E:{marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0], lines[hits[0] - 1]
