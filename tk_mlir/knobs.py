"""Every environment variable tk_mlir reads, in one place: each knob's name,
type, default and meaning, and the one function that reads it.

A knob is read from os.environ each time its function is called, so a
variable changed in the process (or by a test's monkeypatch.setenv) takes
effect at once; the one exception is TK_MLIR_INTERPRET, which kernel.py
reads at the process's first launch and keeps (a launch is too short to read
the environment). No other module reads a TK_MLIR_* variable
(tests/test_knobs.py checks).

Types: a *bool* is true for 1, true, yes or on and false for 0, false, no,
off or unset (any case); a *path* is unset when empty; a *size* is a number
of bytes with an optional K, M, G or T suffix (powers of 1024: 500M, 2G,
1.5GiB). A value that is none of these is a KnobError (a ValueError) naming
the knob.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


class KnobError(ValueError):
    """A TK_MLIR_* variable's value is not of its knob's type (the message
    names the variable and what it takes)."""


@dataclass(frozen=True)
class Knob:
    """One environment variable: `kind` is bool, path or size; `default` is
    the value when it is unset, as the variable would spell it."""
    name: str
    kind: str
    default: str
    doc: str

    def raw(self) -> str:
        """The variable's value, stripped ("" when unset)."""
        return os.environ.get(self.name, "").strip()


CACHE_DIR = Knob(
    "TK_MLIR_CACHE_DIR", "path", "~/.cache/tk_mlir",
    "the disk cache of compiled kernels, SASS listings and autotuning choices")
CACHE_MAX_SIZE = Knob(
    "TK_MLIR_CACHE_MAX_SIZE", "size", "1G",
    "the disk cache's size cap; after a write, the least recently used entries "
    "go until it is under 90% of the cap; 0 means no cap")
ALWAYS_COMPILE = Knob(
    "TK_MLIR_ALWAYS_COMPILE", "bool", "0",
    "compile every specialization: neither read nor write the disk cache or "
    "reuse a stored autotuning choice")
DUMP_DIR = Knob(
    "TK_MLIR_DUMP_DIR", "path", "",
    "write each compiled specialization's stages to DIR/<kernel>-<hash>/, one "
    "numbered file per stage, as they are made; a failing stage's input is saved there")
DEBUG = Knob(
    "TK_MLIR_DEBUG", "bool", "0",
    "keep the full traceback of tk_mlir's errors instead of cutting it at the "
    "public call")
INTERPRET = Knob(
    "TK_MLIR_INTERPRET", "bool", "0",
    "run every kernel[grid](...) launch in the CPU interpreter; read once, at "
    "the process's first launch")
PRINT_AUTOTUNING = Knob(
    "TK_MLIR_PRINT_AUTOTUNING", "bool", "0",
    "print each autotuning's timings and choice to stderr")

KNOBS = (CACHE_DIR, CACHE_MAX_SIZE, ALWAYS_COMPILE, DUMP_DIR, DEBUG, INTERPRET,
         PRINT_AUTOTUNING)


# ---------------------------------------------------------------- readers

def cache_dir() -> Path:
    return _path(CACHE_DIR)


def cache_max_size() -> int | None:
    """The cap in bytes; None: no cap."""
    return _size(CACHE_MAX_SIZE) or None


def always_compile() -> bool:
    return _bool(ALWAYS_COMPILE)


def dump_dir() -> str | None:
    raw = DUMP_DIR.raw()
    return str(Path(raw).expanduser()) if raw else None


def debug() -> bool:
    return _bool(DEBUG)


def interpret() -> bool:
    return _bool(INTERPRET)


def print_autotuning() -> bool:
    return _bool(PRINT_AUTOTUNING)


def check_all() -> None:
    """Read every knob: a bad value is a KnobError before any work is done
    (a compile that would fail only when it writes the cache, say)."""
    cache_dir(), cache_max_size(), always_compile(), dump_dir(), debug(), interpret()
    print_autotuning()


# ---------------------------------------------------------------- parsing

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(knob: Knob) -> bool:
    value = (knob.raw() or knob.default).lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise KnobError(f"{knob.name}={knob.raw()!r}: expected 1, true, yes or on, or 0, "
                    f"false, no or off (or unset)")


def _path(knob: Knob) -> Path:
    return Path(knob.raw() or knob.default).expanduser()


_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, what: str) -> int:
    """Bytes from `text`: a number with an optional K/M/G/T suffix (powers of
    1024; "B" or "iB" after it allowed); a KnobError naming `what` else (also
    for a size between 0 and one byte, which would read as 0: no limit)."""
    m = _SIZE.fullmatch(text.strip())
    rule = "(K, M, G, T are powers of 1024; 0 means no limit)"
    if not m:
        raise KnobError(f"{what}={text!r}: expected a size in bytes such as 500M, 2G or "
                        f"1073741824 {rule}")
    size = int(float(m[1]) * _UNIT[m[2].upper()])
    if size == 0 and float(m[1]) != 0:
        raise KnobError(f"{what}={text!r}: a size of less than one byte {rule}")
    return size


def _size(knob: Knob) -> int:
    return parse_size(knob.raw() or knob.default, knob.name)

