"""The measurement protocol every benchmark shares (DESIGN.md, Benchmarks).

ThunderKittens 2.0's protocol: bit-identical uniform random inputs for every
kernel compared; enough input groups to exceed 3x the L2, cycled so each
launch evicts the last one's data; 500 warm-up launches; 100 timed
back-to-back launches between two CUDA events; a pause between kernels.
Bandwidth-bound kernels are reported against a device-to-device copy
measured in the same run.

The timing and the input groups are the library's (tk_mlir/benchmarking.py,
`tk.bench` in a notebook); this module adds what only the scripts need:
result files, tables, ratios, host timing.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

# The protocol itself lives in the library (tk.bench uses it in notebooks);
# these names stay importable from here for the scripts.
from tk_mlir.benchmarking import (DEFAULT_L2_BYTES, MiB, bandwidth_gbs,  # noqa: E402,F401
                                  l2_cache_bytes, make_input_groups, tflops, time_kernel,
                                  uniform)


def require_cuda(what: str = "this benchmark") -> None:
    """A script's stop (SystemExit) when there is no GPU to measure on."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA GPU: torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}). Nothing was measured.")


def record_tflops(row: dict, t: dict, flops: float) -> None:
    """Put time_kernel's result `t` and the TFLOP/s it means into a result row
    (which already has impl, rel_err and status), and print it as one line."""
    row.update(ms=t["ms"], ms_min=t["ms_min"], ms_median=t["ms_median"], groups=t["groups"],
               tflops=tflops(flops, t["ms"]))
    print(f"  {row['impl']:8} {t['ms']:.4f} ms  {row['tflops']:6.1f} TFLOP/s  "
          f"err {row['rel_err']:.2e} {row['status']}", flush=True)


def add_ratios(rows: list[dict], peer: str, key: str) -> None:
    """row[key] = the peer's ms / the row's ms (> 1: faster than the peer), once
    every implementation of these rows has a time."""
    peer_ms = next((r.get("ms") for r in rows if r["impl"] == peer), None)
    for r in rows:
        if peer_ms and r.get("ms"):
            r[key] = peer_ms / r["ms"]


def first_line(e: Exception) -> str:
    """An exception as one short line, for a result row's status."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def copy_bandwidth(nbytes: int, l2_bytes: int | None = None, **timing) -> float:
    """GB/s of `dst.copy_(src)` over nbytes, counting bytes read + written."""
    require_cuda("copy_bandwidth")

    def one(g):
        src = torch.empty(nbytes, dtype=torch.uint8, device=g.device).random_(0, 256, generator=g)
        return src, torch.empty_like(src)

    groups = make_input_groups(one, 2 * nbytes, l2_bytes)
    t = time_kernel(lambda g: g[1].copy_(g[0]), groups, **timing)
    return bandwidth_gbs(2 * nbytes, t["ms"])


def run_meta() -> dict:
    """Where and how a result was measured."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # no triton: CPU builds, or not installed
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "l2_bytes": l2_cache_bytes(),
        "command": shlex.join([sys.executable, *sys.argv]),
    }


def _atomic_write_text(path: Path, text: str) -> None:
    # A reader (or a run killed midway) never sees a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_results(name: str, rows: list[dict], meta: dict,
                  out_dir: str | os.PathLike = "benchmarks/results") -> Path:
    """Write {name}.json (rows + meta) and, if matplotlib is there, {name}.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    _atomic_write_text(path, json.dumps({"meta": {**run_meta(), **meta}, "rows": rows},
                                        indent=1, default=str) + "\n")
    print(f"wrote {path}")
    # plot.py sits beside this file; benchmarks/ is not a package.
    spec = importlib.util.spec_from_file_location("tk_bench_plot", Path(__file__).with_name("plot.py"))
    plot = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(plot)
        print(f"wrote {plot.plot(path)}")
    except ImportError as e:
        print(f"no plot ({e}); later: python benchmarks/plot.py {path}")
    except Exception as e:  # the JSON is what matters; a plot can be redrawn
        print(f"plot failed ({type(e).__name__}: {e}); retry: python benchmarks/plot.py {path}")
    return path


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v).replace("|", "\\|")


def markdown_table(rows: list[dict], columns: list[str | tuple[str, str]]) -> str:
    """A GitHub table; a column is a row key or (key, header). Missing keys print —."""
    cols = [c if isinstance(c, tuple) else (c, c) for c in columns]
    lines = ["| " + " | ".join(h for _, h in cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)


def host_us_per_call(fn: Callable[[], Any], n: int, warmup: int = 500,
                     batch: int = 200) -> float:
    """Host µs per call of `fn`: the best round of `batch` back-to-back calls,
    over n calls in all, each round ended by a device sync outside its
    timing. Rounds are short so the launch queue never fills: a call whose
    GPU work outlasts its host time (a persistent GEMM on 132 SMs takes
    ~15 µs on the GPU even at 256^3) would otherwise be timed by the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(max(3, n // batch)):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / batch * 1e6)
    return best


def events_ms(f: Callable[[], Any], n: int = 20, warmup: int = 3, rounds: int = 1) -> float:
    """Milliseconds per call of f: CUDA events around n back-to-back calls
    after `warmup` calls (host time shows when it exceeds the GPU's); with
    rounds > 1, the median of that many such rounds (a host-bound call's
    first round after setup can take 1.7x the next ones)."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(n):
            f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def kernel_us_per_call(fn: Callable[[], Any], calls: int = 5,
                       warmup: int = 3) -> tuple[float, dict[str, float]]:
    """GPU µs per call of `fn` as its kernels cost: the CUDA kernels
    torch.profiler records over `calls` calls, summed (no host time and no
    gaps between launches: what an eager call that is host-bound hides),
    and per kernel name, the costliest first."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.device_time / calls
    return sum(per.values()), dict(sorted(per.items(), key=lambda kv: -kv[1]))


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64."""
    return ((got.double() - ref).norm() / ref.norm()).item()


def time_passes(case: str, fns: dict[str, Callable], make: Callable[[Any], tuple],
                **timing) -> list[dict]:
    """A row per implementation and pass: `fn(*inputs)`'s forward, and its
    forward + backward (the gradient of every input, for ones as the output's
    gradient), timed by `bench` on input groups from `make(generator)` (the
    inputs that need gradients require them). A failure is a row's status."""
    from tk_mlir.benchmarking import bench
    rows = []
    for name, fn in fns.items():
        def fb(*leaves, fn=fn):
            out = fn(*leaves)
            return torch.autograd.grad(out, [t for t in leaves if t.requires_grad],
                                       torch.ones_like(out))
        for pass_, f in (("fwd", fn), ("fwd+bwd", fb)):
            row = {"case": case, "impl": name, "pass": pass_}
            try:
                with torch.set_grad_enabled(pass_ != "fwd"):
                    t = bench(f, inputs=make, **timing)
                row.update(us=t.ms * 1e3, status="ok")
            except Exception as e:                                  # noqa: BLE001
                row["status"] = f"failed: {first_line(e)}"
            rows.append(row)
            print(row, flush=True)
    return rows
