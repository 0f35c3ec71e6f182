import errno
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from tk_mlir import cache
from tk_mlir.cache import DiskCache, make_key

ENTRY = {"cubin": b"\x7fELF\x00\x01binary", "ptx": ".version 8.7\n.target sm_90a\n", "meta.json": '{"regs": 168}'}


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)
    monkeypatch.setattr(cache, "_warned", set())
    return tmp_path / "cache"


def leftovers(root):
    """Everything in the cache that is not a published entry directory."""
    return [p for p in root.rglob("*") if p.name.startswith((".tmp-", ".trash-"))]


# --- configuration ---------------------------------------------------------

def test_cache_dir_from_env_and_default(monkeypatch, tmp_path):
    assert cache.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("TK_MLIR_CACHE_DIR")
    assert cache.cache_dir() == cache.pathlib.Path.home() / ".cache" / "tk_mlir"


def test_always_compile(monkeypatch):
    assert not cache.always_compile()
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    assert cache.always_compile()
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "0")
    assert not cache.always_compile()


def test_toolchain_fingerprint_names_every_tool():
    fp = cache.toolchain_fingerprint()
    assert set(fp) == {"tk_mlir", "mlir_bindings", "llvm_tools", "ptxas", "sources"}
    assert fp["tk_mlir"]
    assert len(fp["sources"]) == 64
    assert cache.toolchain_fingerprint() is fp  # once per process


def test_source_hash_covers_dialects_passes_lowering():
    names = {name for name, _ in cache._package_roots()}
    assert names == {"tk_mlir", "tk_mlir.dialects", "tk_mlir.passes", "tk_mlir.lowering"}


def test_source_hash_changes_with_any_edit(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("ignored")
    roots = [("pkg", pkg)]
    before = cache._hash_sources(roots)
    (pkg / "notes.txt").write_text("still ignored")
    assert cache._hash_sources(roots) == before
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    edited = cache._hash_sources(roots)
    assert edited != before
    (pkg / "sub" / "b.py").rename(pkg / "b.py")
    assert cache._hash_sources(roots) != edited


# --- keys --------------------------------------------------------------------

BASE = dict(source="def k(): pass", constexprs={"BM": 128, "BN": 256}, arch="sm_90a",
            options=("O3",), shapes=[[1024, 1024]], dtypes=["bf16"], debug=False, env=None)


def test_key_is_stable_and_hex():
    k = make_key(**BASE)
    assert k == make_key(**dict(reversed(list(BASE.items()))))
    assert len(k) == 64 and int(k, 16) >= 0


@pytest.mark.parametrize("part, value", [
    ("source", "def k(): return"),
    ("constexprs", {"BM": 64, "BN": 256}),
    ("constexprs", {"BM": 128, "BN": 256, "BK": 64}),
    ("arch", "sm_100a"),
    ("options", ("O2",)),
    ("shapes", [[1024, 2048]]),
    ("dtypes", ["f16"]),
    ("debug", True),
    ("env", {"TK_MLIR_FAST_MATH": "1"}),
])
def test_key_changes_with_every_part(part, value):
    assert make_key(**{**BASE, part: value}) != make_key(**BASE)


def test_key_changes_with_new_part_and_part_name():
    assert make_key(**BASE, extra=1) != make_key(**BASE)
    assert make_key(a=1) != make_key(b=1)


def test_key_keeps_types_apart():
    keys = {make_key(v=v) for v in (1, 1.0, True, "1", None, [1], {"1": 1})}
    assert len(keys) == 7
    assert make_key(v=(1, 2)) == make_key(v=[1, 2])
    assert make_key(v=float("nan")) != make_key(v=float("inf"))


def test_key_changes_with_toolchain(monkeypatch):
    k = make_key(**BASE)
    fp = dict(cache.toolchain_fingerprint(), ptxas="Cuda compilation tools, release 99.0")
    monkeypatch.setattr(cache, "toolchain_fingerprint", lambda: fp)
    assert make_key(**BASE) != k


def test_key_rejects_values_that_only_repr(monkeypatch):
    with pytest.raises(TypeError, match="parts.opts"):
        make_key(opts=object())
    with pytest.raises(TypeError, match="dict keys must be str"):
        make_key(v={1: 2})


# --- hit / miss ----------------------------------------------------------------

def test_miss_then_hit_roundtrips_types(cache_env):
    c = DiskCache()
    key = make_key(**BASE)
    assert c.get(key) is None
    c.put(key, ENTRY)
    got = c.get(key)
    assert got == ENTRY
    assert isinstance(got["cubin"], bytes) and isinstance(got["ptx"], str)
    entry_dir = cache_env / key[:2] / key
    assert sorted(p.name for p in entry_dir.iterdir()) == [".manifest.json", "cubin", "meta.json", "ptx"]
    assert (entry_dir / "ptx").read_text() == ENTRY["ptx"]


def test_explicit_root(tmp_path):
    c = DiskCache(tmp_path / "elsewhere")
    key = make_key(x=1)
    c.put(key, ENTRY)
    assert (tmp_path / "elsewhere" / key[:2] / key).is_dir()
    assert DiskCache().get(key) is None


def test_always_compile_skips_reads(monkeypatch):
    c, key = DiskCache(), make_key(x=1)
    c.put(key, ENTRY)
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    assert c.get(key) is None


def test_bad_keys_and_entries_raise():
    c = DiskCache()
    with pytest.raises(ValueError):
        c.get("../../etc")
    key = make_key(x=1)
    for bad in ({"../x": b""}, {".manifest.json": b""}, {}):
        with pytest.raises(ValueError):
            c.put(key, bad)
    with pytest.raises(TypeError):
        c.put(key, {"cubin": 3})


# --- atomic publication ------------------------------------------------------

def test_publish_leaves_no_temp_dirs(cache_env):
    c = DiskCache()
    keys = [make_key(i=i) for i in range(5)]
    for k in keys:
        c.put(k, ENTRY)
    assert leftovers(cache_env) == []
    published = {p.name for shard in cache_env.iterdir() for p in shard.iterdir()}
    assert published == set(keys)


def test_first_writer_wins(cache_env):
    c, key = DiskCache(), make_key(x=1)
    c.put(key, {"ptx": "first"})
    c.put(key, {"ptx": "second"})
    assert c.get(key) == {"ptx": "first"}
    assert leftovers(cache_env) == []


def test_lost_race_at_rename_discards_ours(cache_env, monkeypatch):
    """Another process publishes between our exists() check and our rename."""
    c, key = DiskCache(), make_key(x=1)
    real_rename = os.rename

    def rival_first(src, dst):
        os.makedirs(dst)
        (cache.pathlib.Path(dst) / "x").write_text("rival")
        real_rename(src, dst)  # ENOTEMPTY, as on a real race

    monkeypatch.setattr(cache.os, "rename", rival_first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.put(key, ENTRY)
    assert leftovers(cache_env) == []
    assert (cache_env / key[:2] / key / "x").read_text() == "rival"


def test_failed_write_cleans_up_and_warns(cache_env, monkeypatch):
    """A full disk mid-write: warn, leave nothing behind, don't raise."""
    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache.os, "fsync", full_disk)
    c, key = DiskCache(), make_key(x=1)
    with pytest.warns(RuntimeWarning, match="No space left"):
        c.put(key, ENTRY)
    assert leftovers(cache_env) == []
    assert c.get(key) is None


def test_unwritable_dir_warns_once_and_does_not_raise(tmp_path, monkeypatch):
    # A regular file where the cache directory should be: fails even for root,
    # unlike chmod.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(blocker / "cache"))
    c = DiskCache()
    with pytest.warns(RuntimeWarning, match="cannot write to the compilation cache"):
        c.put(make_key(x=1), ENTRY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.put(make_key(x=2), ENTRY)  # already warned about this directory
        assert c.get(make_key(x=1)) is None


def test_unreadable_cache_warns_and_is_a_miss(cache_env, monkeypatch):
    # (chmod 000 does not stop root: the read itself is made to fail)
    c = DiskCache()
    key = make_key(x=3)
    c.put(key, ENTRY)

    def denied(*args):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(cache, "_read_entry", denied)
    with pytest.warns(RuntimeWarning, match="cannot read the compilation cache"):
        assert c.get(key) is None
    assert (cache_env / key[:2] / key).is_dir()      # not dropped: it may be another user's


# --- corruption ------------------------------------------------------------------

def rewrite_manifest(d, **changes):
    """Make the manifest describe the files as they now are (a damaged entry
    that a manifest check alone would pass), then apply `changes`."""
    import hashlib
    import json
    manifest = json.loads((d / ".manifest.json").read_text())
    for name, info in manifest["files"].items():
        data = (d / name).read_bytes()
        info.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest.update(changes)
    (d / ".manifest.json").write_text(json.dumps(manifest))


def replace_with_symlink(path):
    copy = path.with_name("elsewhere")
    copy.write_bytes(path.read_bytes())      # the same bytes: only the symlink is wrong
    path.unlink()
    path.symlink_to(copy)


def replace_with_fifo(path):
    path.unlink()
    os.mkfifo(path)


def replace_with_dir(path):
    path.unlink()
    path.mkdir()
    (path / "x").write_text("")


@pytest.mark.parametrize("damage", [
    lambda d: (d / "cubin").unlink(),
    lambda d: (d / "ptx").write_text(".version 8"),         # truncated
    lambda d: (d / "cubin").write_bytes(b"\x7fELF\x00\x01binarY"),  # same size, flipped
    lambda d: (d / ".manifest.json").unlink(),
    lambda d: (d / ".manifest.json").write_text("{not json"),
    lambda d: (d / ".manifest.json").write_text('{"format": 2, "files": {"ptx": {}}}'),
    lambda d: rewrite_manifest(d, key="0" * 64),                    # another key's entry
    lambda d: rewrite_manifest(d, format=1),
    lambda d: rewrite_manifest(d, files={"ptx": {"kind": "str", "size": "27", "sha256": ""}}),
    lambda d: ((d / "ptx").write_bytes(b"\xff\xfe"), rewrite_manifest(d)),  # str, not UTF-8
    lambda d: replace_with_symlink(d / "cubin"),
    lambda d: replace_with_fifo(d / "ptx"),
    lambda d: replace_with_fifo(d / ".manifest.json"),
    lambda d: replace_with_dir(d / "meta.json"),
    lambda d: replace_with_dir(d / ".manifest.json"),
], ids=["file-deleted", "truncated", "flipped", "no-manifest", "manifest-not-json",
        "manifest-no-key", "other-key", "old-format", "manifest-wrong-types", "not-utf8",
        "symlink", "fifo", "fifo-manifest", "dir-for-file", "dir-for-manifest"])
def test_damaged_entry_is_a_miss_removed_with_one_warning(cache_env, damage):
    c, key = DiskCache(), make_key(x=1)
    c.put(key, ENTRY)
    entry_dir = cache_env / key[:2] / key
    damage(entry_dir)
    with pytest.warns(RuntimeWarning, match="dropped a damaged compilation cache entry") as got:
        assert within(10, c.get, key) is None
    assert len(got) == 1
    assert not entry_dir.exists()
    assert leftovers(cache_env) == []
    c.put(key, ENTRY)  # and the next compile can publish a good one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.get(key) == ENTRY


@pytest.mark.parametrize("make", [
    lambda p: p.write_text("a file"), lambda p: os.mkfifo(p),
    lambda p: p.symlink_to(p.parent),
], ids=["file", "fifo", "symlink-to-dir"])
def test_something_else_where_an_entry_belongs_is_dropped(cache_env, make):
    c, key = DiskCache(), make_key(x=1)
    final = cache_env / key[:2] / key
    final.parent.mkdir(parents=True)
    make(final)
    with pytest.warns(RuntimeWarning, match="not a directory"):
        assert c.get(key) is None
    assert not os.path.lexists(final)
    c.put(key, ENTRY)
    assert c.get(key) == ENTRY


def test_discard_drops_an_entry_its_reader_cannot_use(cache_env):
    c, key = DiskCache(), make_key(x=1)
    c.put(key, ENTRY)
    with pytest.warns(RuntimeWarning, match=r"\(meta\.json is empty\)"):
        c.discard(key, "meta.json is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.get(key) is None


def within(seconds, fn, *args):
    """fn(*args), failing the test (not hanging it) if it blocks."""
    import signal

    def blocked(*_):
        raise AssertionError(f"{fn.__name__} blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- concurrency -------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("error")
    from tk_mlir.cache import DiskCache
    me, start, keys = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(",")
    entry = {"cubin": bytes([me]) * (1 << 20), "ptx": f"writer {me}\\n" * 10000}
    while time.time() < start:
        pass
    c = DiskCache()
    for key in keys:
        c.put(key, entry)
        got = c.get(key)
        # Complete and from exactly one writer, never a mix.
        w = got["cubin"][0]
        assert got == {"cubin": bytes([w]) * (1 << 20), "ptx": f"writer {w}\\n" * 10000}, key
""")


def test_processes_racing_on_the_same_keys(cache_env):
    keys = [make_key(race=i) for i in range(8)]
    start = time.time() + 2.0  # let every interpreter start before the race
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(i), str(start), ",".join(keys)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(4)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    c = DiskCache()
    for key in keys:
        got = c.get(key)
        w = got["cubin"][0]
        assert w in range(4)
        assert got == {"cubin": bytes([w]) * (1 << 20), "ptx": f"writer {w}\n" * 10000}
    assert leftovers(cache_env) == []


# --- size cap ----------------------------------------------------------------------

def random_entry(size):
    return {"cubin": os.urandom(size), "ptx": f"// {os.urandom(8).hex()}\n"}


def put_at(c, key, entry, when):
    """Put `entry` and make it last used at `when` (seconds since the epoch)."""
    c.put(key, entry)
    os.utime(c.path(key) / ".manifest.json", (when, when))


def test_the_cap_removes_the_least_recently_used_entries(cache_env, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "20K")
    c, now = DiskCache(), time.time()
    keys = [make_key(cap=os.urandom(8).hex()) for _ in range(5)]
    for i, key in enumerate(keys):              # 5 x ~3.3 KB: under the cap
        put_at(c, key, random_entry(3000), now - 1000 + i)
    assert all(c.path(k).is_dir() for k in keys)
    c.get(keys[0])                               # the oldest, used now: the newest
    assert os.stat(c.path(keys[0]) / ".manifest.json").st_mtime >= now
    newest = make_key(cap="newest")
    c.put(newest, random_entry(6000))            # ~23 KB: over; trimmed under 18 KiB
    kept = [k for k in keys if c.path(k).is_dir()]
    assert kept == [keys[0], keys[3], keys[4]]   # 1 and 2 were the least recently used
    assert c.path(newest).is_dir()
    entries, size = c.usage()
    assert entries == 4 and size <= 0.9 * (20 << 10)


def test_the_entry_just_written_stays_even_alone_over_the_cap(cache_env, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "1K")
    c = DiskCache()
    old, big = make_key(cap="old"), make_key(cap="big")
    c.put(old, random_entry(100))
    c.put(big, random_entry(5000))
    assert not c.path(old).exists() and c.get(big) is not None


@pytest.mark.parametrize("cap", ["0", "1T"])
def test_no_cap_or_a_large_one_removes_nothing(cache_env, monkeypatch, cap):
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", cap)
    c = DiskCache()
    keys = [make_key(cap=i) for i in range(6)]
    for key in keys:
        c.put(key, random_entry(4000))
    assert c.usage()[0] == 6


def test_the_read_set_index_under_the_root_counts_and_is_trimmed(cache_env, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "10K")
    c, index = DiskCache(), DiskCache(cache_env / "reads")
    put_at(index, make_key(n=0), random_entry(4000), time.time() - 100)
    assert c.usage()[0] == 1
    c.put(make_key(n=1), random_entry(8000))
    assert c.usage()[0] == 1 and not index.path(make_key(n=0)).exists()


def test_stale_temp_and_trash_folders_go_fresh_ones_stay(cache_env, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "1G")
    c, key = DiskCache(), make_key(x=1)
    shard = cache_env / key[:2]
    shard.mkdir(parents=True)
    stale = [shard / ".tmp-crash_00", shard / f".trash-{key}-{'0' * 32}"]
    live = shard / ".tmp-writing"
    for folder in stale + [live]:
        folder.mkdir()
        (folder / "cubin").write_bytes(os.urandom(64))
    for folder in stale:
        os.utime(folder, (time.time() - 7200, time.time() - 7200))
    c.put(key, ENTRY)
    assert not any(f.exists() for f in stale)
    assert live.is_dir()                        # a writer at work: left alone


def test_a_users_own_folders_in_the_cache_folder_are_never_removed(cache_env, monkeypatch):
    """TK_MLIR_CACHE_DIR pointed at a folder that holds other things (a
    project): trimming and cleaning walk only the cache's own layout, so old
    folders named like temp or trash folders elsewhere stay."""
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "1G")
    c, key = DiskCache(), make_key(x=2)
    mine = [cache_env / "project" / ".tmp-build", cache_env / "project" / "deep" / ".trash-notes",
            cache_env / ".tmp-abcdefgh", cache_env / "zz" / ".tmp-abcdefgh"]
    for folder in mine:
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("mine")
        os.utime(folder, (time.time() - 7200, time.time() - 7200))
    c.put(key, ENTRY)
    c.clean()
    assert all((f / "notes.txt").read_text() == "mine" for f in mine)


def test_clean_removes_all_or_the_unused(cache_env):
    c, now = DiskCache(), time.time()
    old, recent = make_key(age="old"), make_key(age="recent")
    put_at(c, old, random_entry(1000), now - 3 * 86400)
    put_at(c, recent, random_entry(1000), now - 60)
    removed, size = c.clean(older_than=86400)
    assert removed == 1 and size > 1000
    assert c.get(recent) is not None and c.get(old) is None
    assert c.clean()[0] == 1
    assert c.usage() == (0, 0)
