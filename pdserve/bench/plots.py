"""PNG charts of serving-benchmark result files: latency percentiles, failed requests and SLO attainment against
request rate, one line per file (so PD and colocated, or two versions, share one chart), under a title that
names each file's model, backend and date. Every y-axis starts at zero."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PANELS = (("ttft_ms", "p90", "TTFT p90 (ms)"), ("tpot_ms", "p99", "TPOT p99 (ms)"),
          ("itl_ms", "p99", "ITL p99 (ms)"), ("e2e_ms", "p90", "E2E p90 (ms)"))
GRID = (2, 3)  # rows, columns: the four latency panels, failed requests, SLO attainment
PANEL_INCHES = (4.6, 3.6)  # each panel's width and height; at DPI its 10-point text is legible at 100% zoom
DPI = 110
MATPLOTLIB_MISSING = "--plot needs matplotlib, which the bench extra installs: pip install 'pdserve[bench]'"


def require_matplotlib() -> None:
    """Fail at once, before any request, where matplotlib cannot be imported."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(MATPLOTLIB_MISSING) from exc
    matplotlib.use("Agg")


def load_result(path: Path) -> dict:
    """A result file with its label (default: the file's name) and its runs sorted by rate (an all-at-once run,
    rate null, has no place on the axis)."""
    data = json.loads(path.read_text())
    runs = sorted((r for r in data["runs"] if r["request_rate"] is not None), key=lambda r: r["request_rate"])
    return {**data, "label": data.get("label") or path.stem, "runs": runs}


def chart_title(results: list[dict]) -> str:
    return "\n".join(f"{r['label']}: {r.get('model') or 'model unknown'}, {r.get('backend') or 'backend unknown'}, "
                     f"{r.get('date') or 'date unknown'}" for r in results)


def draw_chart(results: list[dict]) -> Any:
    """The matplotlib figure of `load_result`'s results."""
    import matplotlib.pyplot as plt

    rows, columns = GRID
    fig, grid = plt.subplots(rows, columns, figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows + 0.3 *
                                                     len(results)))  # the title's lines
    axes = list(grid.flat)
    for (metric, pct, title), ax in zip(PANELS, axes):
        for result in results:
            _line(ax, result["label"], [(r["request_rate"], r[metric][pct]) for r in result["runs"]
                                        if r[metric][pct] is not None])
        _style(ax, title)
    for result in results:
        _line(axes[-2], result["label"], [(r["request_rate"], 100 * r["errors"] / r["requests"])
                                          for r in result["runs"] if r["requests"]])
    _style(axes[-2], "failed requests (%)")
    for result in results:
        _line(axes[-1], result["label"], [(r["request_rate"], 100 * r["slo_attainment"]) for r in result["runs"]
                                          if r["slo_attainment"] is not None])
    axes[-1].axhline(90, color="grey", linestyle="--", linewidth=0.8)
    _style(axes[-1], "SLO attainment (%)")
    for ax in axes[-2:]:
        ax.set_ylim(0, 105)
    axes[0].legend(fontsize=9)
    fig.suptitle(chart_title(results), fontsize=10)
    fig.tight_layout()
    return fig


def plot_results(paths: list[Path], out: Path) -> Path:
    require_matplotlib()
    import matplotlib.pyplot as plt

    return save_figure(draw_chart([load_result(p) for p in paths]), out)


def save_figure(fig: Any, out: Path) -> Path:
    """Write `fig` as a PNG at `out` (folders made) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _line(ax, label: str, points: list[tuple[float, float]]) -> None:
    if points:
        ax.plot(*zip(*points), marker="o", label=label)


def _style(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
