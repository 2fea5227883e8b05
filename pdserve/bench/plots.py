"""PNG charts of serving-benchmark result files: latency percentiles and SLO attainment against request rate,
one line per file (so PD and colocated, or two versions, share one chart)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (("ttft_ms", "p90", "TTFT p90 (ms)"), ("tpot_ms", "p99", "TPOT p99 (ms)"),
          ("itl_ms", "p99", "ITL p99 (ms)"), ("e2e_ms", "p90", "E2E p90 (ms)"))


def load_runs(path: Path) -> tuple[str, list[dict]]:
    """A result file's label and its runs sorted by rate (an all-at-once run, rate null, has no place on the axis)."""
    data = json.loads(path.read_text())
    runs = sorted((r for r in data["runs"] if r["request_rate"] is not None), key=lambda r: r["request_rate"])
    return data.get("label") or path.stem, runs


def plot_results(paths: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [load_runs(p) for p in paths]
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 3.6))
    for (metric, pct, title), ax in zip(PANELS, axes):
        for label, runs in series:
            _line(ax, label, [(r["request_rate"], r[metric][pct]) for r in runs if r[metric][pct] is not None])
        _style(ax, title)
    ax = axes[-1]
    for label, runs in series:
        _line(ax, label, [(r["request_rate"], 100 * r["slo_attainment"]) for r in runs
                          if r["slo_attainment"] is not None])
    ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylim(0, 105)
    _style(ax, "SLO attainment (%)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _line(ax, label: str, points: list[tuple[float, float]]) -> None:
    if points:
        ax.plot(*zip(*points), marker="o", label=label)


def _style(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
