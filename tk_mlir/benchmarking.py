"""Timing kernels the way the project's benchmarks do (DESIGN.md, Benchmarks),
from a notebook: `tk.bench(fn, *args)` and `tk.sweep(...)`.

ThunderKittens 2.0's protocol: enough input groups to exceed 3x the L2,
cycled so each launch evicts the last one's data (bit-identical uniform
random inputs when the groups are made by `inputs=`); 500 warm-up launches;
100 timed back-to-back launches between two CUDA events; a pause between
kernels. benchmarks/protocol.py adds what only the scripts need (result
files, tables, host timing).

torch is imported when a function here is called, not with tk_mlir.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

MiB = 1 << 20
DEFAULT_L2_BYTES = 60 * MiB  # H200; used when no GPU can be asked


class NoGpu(RuntimeError):
    """Timing needs a CUDA GPU, and there is none (or torch was built without CUDA)."""


def require_gpu(what: str) -> None:
    """NoGpu, saying that `what` needs a CUDA GPU, unless torch sees one."""
    import torch
    if not torch.cuda.is_available():
        raise NoGpu(f"{what} needs a CUDA GPU: torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}); nothing was measured. Compiling and "
                    f"reading a kernel's stages (kernel.compile(...)) need no GPU.")


def l2_cache_bytes() -> int:
    import torch
    if torch.cuda.is_available():
        n = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                    "L2_cache_size", 0)
        if n:
            return int(n)
    return DEFAULT_L2_BYTES


def uniform(gen, *shape: int, dtype=None, low: float = -1.0, high: float = 1.0):
    """Uniform random tensor on the generator's device, bf16 unless `dtype`
    (timing zeros flatters kernels)."""
    import torch
    return torch.empty(shape, dtype=dtype or torch.bfloat16,
                       device=gen.device).uniform_(low, high, generator=gen)


def group_count(bytes_per_group: int, l2_bytes: int | None = None) -> int:
    """How many input groups hold at least 3x the L2 together (at least 2)."""
    return max(2, math.ceil(3 * (l2_bytes or l2_cache_bytes()) / max(1, bytes_per_group)))


def make_input_groups(make_one: Callable[[Any], tuple], bytes_per_group: int,
                      l2_bytes: int | None = None, seed: int = 0,
                      device=None) -> list[tuple]:
    """Build enough groups that together they hold >= 3x the L2 (at least 2).

    Group i comes from a torch.Generator seeded with seed + i, so every
    kernel that is given these groups sees the same bits, and so does a rerun.
    """
    import torch
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return [make_one(torch.Generator(device=device).manual_seed(seed + i))
            for i in range(group_count(bytes_per_group, l2_bytes))]


def time_kernel(fn: Callable[[tuple], Any], groups: list[tuple], warmup: int = 500,
                iters: int = 100, repeats: int = 3, pause_s: float = 0.5,
                graph: bool = False) -> dict:
    """Mean ms per launch over `iters` back-to-back launches between two events.

    One launch counter runs through warm-up and timing, so consecutive
    launches always use different groups. `ms` is the first timed run (the
    protocol's figure); the extra repeats only give min/median as a hint of
    run-to-run spread.

    graph=True times the GPU alone: the `iters` launches are captured once in
    a CUDA graph (warm-up and capture on one side stream, as torch.cuda.graph
    advises) and each run replays it, so no host time sits between launches.
    Eager launches of a kernel shorter than its host launch time measure the
    host; small GEMMs are such kernels.
    """
    require_gpu("time_kernel")
    import torch
    n, k = len(groups), 0
    stream = torch.cuda.Stream() if graph else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(groups[k % n]); k += 1
        stream.synchronize()
        if graph:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured, stream=stream):
                for _ in range(iters):
                    fn(groups[k % n]); k += 1
            captured.replay()
        torch.cuda.synchronize()
        runs = []
        for _ in range(max(1, repeats)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if graph:
                captured.replay()
            else:
                for _ in range(iters):
                    fn(groups[k % n]); k += 1
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / iters)
    time.sleep(pause_s)  # let clocks and power settle before the next kernel
    return {"ms": runs[0], "ms_min": min(runs), "ms_median": statistics.median(runs),
            "runs_ms": runs, "warmup": warmup, "iters": iters, "groups": n, "graph": graph}


def bandwidth_gbs(bytes_moved: float, ms: float) -> float:
    return bytes_moved / (ms * 1e-3) / 1e9  # decimal GB/s, as vendors quote


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@dataclass(frozen=True)
class Timing:
    """What `bench` measured: ms per launch (the protocol's figure: the first
    timed run), the spread over the repeats, and the rates it means."""
    ms: float
    ms_min: float
    ms_median: float
    runs_ms: list[float]
    groups: int
    warmup: int
    iters: int
    tflops: float | None = None
    gbs: float | None = None

    def __str__(self) -> str:
        rates = "".join(f", {v:,.1f} {unit}" for v, unit in ((self.tflops, "TFLOP/s"),
                                                             (self.gbs, "GB/s")) if v is not None)
        return (f"{self.ms:.4f} ms{rates} (median {self.ms_median:.4f}, min {self.ms_min:.4f} "
                f"over {len(self.runs_ms)} runs of {self.iters}; {self.groups} input groups)")


def _tensor_bytes(args: tuple) -> int:
    return sum(a.numel() * a.element_size() for a in args if _is_tensor(a))


def _is_tensor(value) -> bool:
    return hasattr(value, "clone") and hasattr(value, "element_size")


def _clone_groups(args: tuple, l2_bytes: int | None) -> list[tuple]:
    """`args` and copies of it (tensors cloned, the rest shared), enough
    that together they exceed 3x the L2."""
    n = group_count(_tensor_bytes(args), l2_bytes)
    return [args] + [tuple(a.clone() if _is_tensor(a) else a for a in args)
                     for _ in range(n - 1)]


def bench(fn: Callable, *args, inputs: Callable[[Any], tuple] | None = None,
          flops: float | None = None, bytes: float | None = None, warmup: int = 500,
          iters: int = 100, repeats: int = 3, pause_s: float = 0.5,
          l2_bytes: int | None = None, graph: bool = False) -> Timing:
    """Time `fn(*args)` with the benchmarks' protocol (the module's docstring).

    The inputs: `args` (the tensors among them are cloned into groups that
    together exceed 3x the L2, each launch taking the next group), or
    `inputs=make`, `make(generator) -> args` making one group of random
    inputs (`tk_mlir.benchmarking.uniform` helps), seeded so that every
    kernel timed this way sees the same bits. At least two groups, so
    inputs larger than the L2 take twice their memory. `flops` or `bytes`
    (per call) add TFLOP/s or GB/s. graph=True times CUDA-graph replays of
    the launches (GPU time without the host's launch time between them; see
    time_kernel). Raises NoGpu without a CUDA GPU.
    """
    if (inputs is None) == (not args):
        raise TypeError("bench(fn, *args, inputs=): give either the arguments of one call "
                        "(args) or inputs=, a function making one group from a generator; "
                        f"got {'both' if args else 'neither'}")
    for name, value in (("flops", flops), ("bytes", bytes)):
        if value is not None and not value > 0:
            raise ValueError(f"bench({name}={value!r}): {name} per call must be > 0")
    if args and not _tensor_bytes(args):
        raise ValueError("bench(fn, *args): no tensor among args, so nothing to cycle "
                         "through the L2; pass the tensors fn reads and writes")
    require_gpu("tk.bench")
    if inputs is not None:      # group i from seed i, as make_input_groups makes them
        first = inputs(_generator(0))
        if not _tensor_bytes(first):
            raise ValueError("bench(inputs=): the group it made holds no tensor")
        groups = [first] + [inputs(_generator(i)) for i in
                            range(1, group_count(_tensor_bytes(first), l2_bytes))]
    else:
        groups = _clone_groups(args, l2_bytes)
    t = time_kernel(lambda group: fn(*group), groups, warmup, iters, repeats, pause_s, graph)
    return Timing(t["ms"], t["ms_min"], t["ms_median"], t["runs_ms"], t["groups"], warmup, iters,
                  tflops(flops, t["ms"]) if flops else None,
                  bandwidth_gbs(bytes, t["ms"]) if bytes else None)


def _generator(seed: int):
    import torch
    return torch.Generator(device="cuda").manual_seed(seed)


# ------------------------------------------------------------------ sweeps

METRICS = {"tflops": "TFLOP/s", "gbs": "GB/s", "ms": "ms per call (lower is better)",
           "value": "value"}


@dataclass
class Sweep:
    """`sweep`'s rows (x, impl, ms, tflops, gbs, status) and how to draw them."""
    x_name: str
    rows: list[dict] = field(default_factory=list)
    metric: str = "tflops"
    title: str = ""

    def plot(self, ax=None):
        """A matplotlib line plot of the metric against x, a line per impl."""
        return plot_sweep(self.rows, self.x_name, self.metric, self.title, ax)

    def __str__(self) -> str:
        impls = list(dict.fromkeys(r["impl"] for r in self.rows))
        xs = list(dict.fromkeys(r[self.x_name] for r in self.rows))
        cell = {(r[self.x_name], r["impl"]): r for r in self.rows}
        lines = [" | ".join([self.x_name, *impls])]
        for x in xs:
            values = []
            for impl in impls:
                r = cell.get((x, impl), {})
                v = r.get(self.metric)
                values.append(f"{v:.4g}" if v is not None else r.get("status", "—"))
            lines.append(" | ".join([str(x), *values]))
        return f"{METRICS.get(self.metric, self.metric)}\n" + "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:    # IPython shows the table
        printer.text(str(self))


def sweep(run: Callable[[Any, str], Timing], x_values: Sequence, impls: Sequence[str], *,
          x_name: str = "x", metric: str | None = None, title: str = "") -> Sweep:
    """`run(x, impl)` (usually a `tk.bench(...)`) for every x and impl, as
    `triton.testing.perf_report` does, with this module's protocol. run may
    also return a plain number, as perf_report's functions do: the row's
    `value`, plotted as it is (metric "value"). An impl that fails at an x
    is a row with its error as `status` (a peer may not support a shape); no
    GPU stops the sweep (NoGpu). `metric` (tflops, gbs, ms, value) defaults
    to the first rate the timings have."""
    if not impls:
        raise ValueError("sweep(impls=[]): give at least one implementation name")
    rows = []
    for x in x_values:
        for impl in impls:
            row = {x_name: x, "impl": impl}
            try:
                t = run(x, impl)
            except NoGpu:
                raise
            except Exception as e:       # recorded in the row: the sweep goes on
                row["status"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
            else:
                if isinstance(t, Timing):
                    row.update(ms=t.ms, ms_median=t.ms_median, tflops=t.tflops, gbs=t.gbs,
                               status="ok")
                elif isinstance(t, (int, float)) and not isinstance(t, bool):
                    row.update(value=float(t), status="ok")
                else:
                    row["status"] = (f"TypeError: run returned {type(t).__name__} {t!r:.60}; "
                                     f"return a tk.bench(...) Timing or a number")
            rows.append(row)
    if metric is None:
        metric = next((m for m in ("tflops", "gbs", "value") if any(r.get(m) for r in rows)),
                      "ms")
    return Sweep(x_name, rows, metric, title)


def plot_sweep(rows: list[dict], x_name: str, metric: str = "tflops", title: str = "",
               ax=None):
    """Draw `rows` (dicts with x_name, "impl" and the metric) as lines, one
    per impl, on `ax` (a new figure when None); returns the Figure. Rows
    without a number for the metric (failed) leave a gap."""
    if ax is None:
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
    else:
        fig = ax.figure
    for impl in dict.fromkeys(r["impl"] for r in rows):
        points = [(r[x_name], r.get(metric)) for r in rows if r["impl"] == impl]
        xs = [x for x, _ in points]
        ys = [math.nan if y is None else y for _, y in points]
        ax.plot(xs, ys, marker="o", label=impl)
    ax.set_xlabel(x_name)
    ax.set_ylabel(METRICS.get(metric, metric))
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
