"""Bar chart of a benchmark result JSON (written by protocol.write_results);
heat_map: tk_mlir's ratio to a peer over a sweep (gemm.py --llama).

Usage: python benchmarks/plot.py benchmarks/results/NAME.json [...]

One group of bars per shape (prefixed by the op when rows carry one), one bar
per implementation. Rows whose impl is "copy" are drawn as a dashed line over
their group instead of a bar, and meta["copy_gbs"] as a line across the
chart: the bandwidth a memory-bound kernel should be judged against.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on the GPU machine or in CI
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"gbs": "GB/s", "tflops": "TFLOP/s", "us": "host µs per call (lower is better)"}


def _group(row: dict) -> str:
    return " ".join(str(row[k]) for k in ("op", "shape") if row.get(k) is not None)


def _value(row: dict, metric: str) -> float:
    v = row.get(metric)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


def plot(json_path: str | os.PathLike) -> str:
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    meta, rows = data.get("meta", {}), data["rows"]
    metric = meta.get("metric") or next((m for m in ("gbs", "us") if any(m in r for r in rows)),
                                        "tflops")

    groups = list(dict.fromkeys(_group(r) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "copy"))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(min(20.0, max(6.0, 0.6 * len(groups) * len(impls) + 2)), 4.5))

    for j, impl in enumerate(impls):
        by_group = {_group(r): _value(r, metric) for r in rows if r["impl"] == impl}
        xs = [i - 0.4 + (j + 0.5) * width for i in range(len(groups))]
        ys = [by_group.get(g, math.nan) for g in groups]
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, labels=["" if math.isnan(y) else f"{y:.0f}" if y >= 100 else
                                   f"{y:.3g}" for y in ys],
                     fontsize=7, padding=1)

    copy_label = "copy (read+write)"
    for r in rows:
        if r["impl"] == "copy" and not math.isnan(_value(r, metric)):
            i = groups.index(_group(r))
            ax.hlines(_value(r, metric), i - 0.45, i + 0.45, colors="k", linestyles="--",
                      label=copy_label)
            copy_label = None  # one legend entry
    if meta.get("copy_gbs") and metric == "gbs":
        ax.axhline(meta["copy_gbs"], color="k", linestyle=":", label="copy (read+write)")

    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0, fontsize=8)
    ax.set_ylabel(LABELS.get(metric, metric))
    ax.set_title(f"{json_path.stem} — {meta.get('device', '?')} — {str(meta.get('date', '?'))[:10]}")
    ax.margins(y=0.1)  # room for the bar labels
    if max(map(len, impls), default=0) > 40:   # long names: below the plot, one per line
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=1)
        fig.set_figheight(4.5 + 0.25 * len(impls))
    else:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # never over a bar
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()

    png = json_path.with_suffix(".png")
    tmp = png.with_name(png.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=120)  # then rename: never a half-written PNG
    plt.close(fig)
    os.replace(tmp, png)
    return str(png)


def heat_map(json_path: str | os.PathLike, peer: str = "cublas") -> str:
    """tk_mlir's ratio to `peer` (rows' ratio_vs_<peer>) as a heat map, one
    row per `projection`, one column per M, written beside the JSON as
    NAME-heat.png: green above 1.0, red below, each cell labelled."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    rows = [r for r in data["rows"] if r["impl"] == "tk_mlir"]
    names = list(dict.fromkeys(r["projection"] for r in rows))
    ms = sorted({r["M"] for r in rows})
    grid = [[math.nan] * len(ms) for _ in names]
    for r in rows:
        grid[names.index(r["projection"])][ms.index(r["M"])] = _value(r, f"ratio_vs_{peer}")
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(ms), 1.2 + 0.45 * len(names)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
    for i, line in enumerate(grid):
        for j, v in enumerate(line):
            ax.text(j, i, "—" if math.isnan(v) else f"{v:.2f}", ha="center", va="center",
                    fontsize=7)
    ax.set_xticks(range(len(ms)), [str(m) for m in ms], fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("M (tokens)")
    meta = data.get("meta", {})
    ax.set_title(f"tk_mlir / {peer}, {json_path.stem} — {meta.get('device', '?')} — "
                 f"{str(meta.get('date', '?'))[:10]}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    png = json_path.with_name(json_path.stem + "-heat.png")
    tmp = png.with_name(png.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    os.replace(tmp, png)
    return str(png)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(plot(p))
