"""Stage dumps: the folder TK_MLIR_DUMP_DIR (or the CLI's --dump-dir) names,
checked writable before a compile writes to it, and one numbered file per
stage (NN-STAGE.ext) in pipeline order. A folder or file that cannot be
written is a CompilationError naming the setting, never an OSError."""
from __future__ import annotations

import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from . import knobs
from .errors import CompilationError

if TYPE_CHECKING:
    from .specialization import Specialization

# Stage file suffixes; MLIR stages take .mlir.
_SUFFIX = {"python": ".py", "ptx": ".ptx", "sass": ".sass", "ptxas": ".log"}


def dump_folder(spec: Specialization) -> Path | None:
    """TK_MLIR_DUMP_DIR's folder for `spec`, checked writable before anything
    is written; None when TK_MLIR_DUMP_DIR is not set."""
    dump_dir = knobs.dump_dir()
    if dump_dir is None:
        return None
    return writable_folder(Path(dump_dir) / spec.dump_name(), knobs.DUMP_DIR.name)


def writable_folder(folder: Path, what: str) -> Path:
    """`folder`, made if missing, once a file could be made in it; else a
    CompilationError naming `what` (the setting or option), the path and why.
    (Permission bits alone do not tell: root passes os.access in /proc.)"""
    def refuse(why):
        raise CompilationError(f"{what}: cannot write to {str(folder)!r}: {why}")
    path = folder
    while not path.exists():
        if path.parent == path:
            break
        path = path.parent
    if not path.is_dir():
        refuse(f"{str(path)!r} is a file, not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        refuse(f"{str(path)!r} is not writable")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        refuse(e.strerror or str(e))
    return folder


def write_stage(folder: Path, index: int, stage: str, text: str, what: str) -> None:
    """Stage `text` to its numbered file in `folder`, whole or not at all (a
    temp file renamed into place); the first stage (index 0) first removes the
    stage files an earlier compile left there, so the folder never mixes two
    compiles. A CompilationError naming `what` when it cannot be written (a
    full disk, say, after the folder's check)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", stage).strip("_")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if index == 0:
            for old in folder.iterdir():
                if _STAGE_FILE.fullmatch(old.name) and old.is_file():
                    old.unlink()
        _write_whole(folder / f"{index:02d}-{safe}{_SUFFIX.get(stage, '.mlir')}", text)
    except OSError as e:
        raise CompilationError(f"{what}: cannot write {stage} to {str(folder)!r}: "
                               f"{e.strerror or e}") from None


def _write_whole(path: Path, text: str) -> None:
    """`text` into `path` by a temp file renamed over it: a failed write (a full
    disk) leaves no cut-off file."""
    # (open(..., "x"), not mkstemp: the file gets the umask's mode, as any file would)
    tmp = path.parent / f".stage-{uuid.uuid4().hex}"
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# The files write_stage makes (nothing else in a dump folder is touched).
_STAGE_FILE = re.compile(r"\d\d-[A-Za-z0-9_.-]+\.(mlir|py|ptx|sass|log)")
