"""The layout sweep's figures (`python -m pdserve.bench.sweep`): goodput per layout and repeat, the spread between
repeats, latency percentiles per rate, the `launch_cluster --layout auto` table entry, and the PNG grid.

Goodput of one repeat: the highest rate of the unbroken run of passing rates from the lowest (attainment >= the
target), and the rate where the attainment crosses the target, interpolated linearly between that rate and the
first failing one (the same as the step goodput when no rate failed: a lower bound). Spread: (max - min) / mean of
the repeats' goodputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.plots import require_matplotlib, save_figure

LATENCIES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p99"))


def goodput(points: Sequence[tuple[float, float | None]], target: float) -> dict:
    """Step and interpolated goodput of (rate, attainment) points in ascending rate order; a rate not measured
    (attainment None: skipped after a failing one) ends the search like a failing one."""
    last: tuple[float, float] | None = None
    for rate, attainment in points:
        if attainment is not None and attainment >= target:
            last = (rate, attainment)
            continue
        if last is None or attainment is None:
            break
        crossing = last[0] + (last[1] - target) / (last[1] - attainment) * (rate - last[0])
        return {"step": last[0], "interpolated": crossing, "lower_bound_only": False}
    step = last[0] if last else None
    return {"step": step, "interpolated": step, "lower_bound_only": step is not None}


def spread(values: Sequence[float | None]) -> float | None:
    """(max - min) / mean of two or more measured values; None otherwise."""
    if len(values) < 2 or any(v is None for v in values) or not sum(values):
        return None
    return (max(values) - min(values)) / (sum(values) / len(values))


def mean(values: Sequence[float | None]) -> float | None:
    measured = [v for v in values if v is not None]
    return sum(measured) / len(measured) if measured else None


def rate_points(run: dict) -> list[tuple[float, float | None]]:
    """(rate, attainment) of one layout run; a failed start gives no point."""
    return [(r["request_rate"], None if r.get("skipped") else r["slo_attainment"]) for r in run.get("rates", [])]


def local_prefill_share(router_counts: dict[str, float]) -> float | None:
    """The share of PD requests the router had prefilled on a decode server; None without PD requests."""
    local = router_counts.get('pdserve_router_prefill_total{path="local"}', 0.0)
    remote = router_counts.get('pdserve_router_prefill_total{path="remote"}', 0.0)
    return local / (local + remote) if local + remote else None


def per_rate(runs: Sequence[dict], rates: Sequence[float]) -> dict[str, dict[str, list]]:
    """For each rate: the attainment, failures, KV check, share of local prefills and each latency percentile of
    every repeat that ran it."""
    table = {}
    for rate in rates:
        measured = [r for run in runs for r in run.get("rates", [])
                    if r["request_rate"] == rate and not r.get("skipped")]
        row = {"slo_attainment": [r["slo_attainment"] for r in measured], "errors": [r["errors"] for r in measured],
               "kv_pools_free": [r["kv_pools_free"] for r in measured],
               "local_prefill_share": [local_prefill_share(r.get("router_counts", {})) for r in measured]}
        row.update({f"{metric[:-3]}_{pct}_ms": [r[metric][pct] for r in measured] for metric, pct in LATENCIES})
        table[f"{rate:g}"] = row
    return table


def summarize_layout(runs: Sequence[dict], rates: Sequence[float], target: float) -> dict:
    goodputs = [goodput(rate_points(run), target) for run in runs]
    steps, crossings = [g["step"] for g in goodputs], [g["interpolated"] for g in goodputs]
    measured = [r for run in runs for r in run.get("rates", []) if not r.get("skipped")]
    return {
        "goodput_req_s": steps, "goodput_interpolated_req_s": crossings,
        "lower_bound_only": [g["lower_bound_only"] for g in goodputs],
        "goodput_mean": mean(steps), "goodput_interpolated_mean": mean(crossings),
        "goodput_spread": spread(steps), "goodput_interpolated_spread": spread(crossings),
        "failed_requests": sum(r["errors"] for r in measured),
        "start_errors": [run["error"] for run in runs if run.get("error")],
        "kv_pools_free": all(r["kv_pools_free"] for r in measured),
        "per_rate": per_rate(runs, rates),
    }


def summarize(result: dict) -> dict[str, dict]:
    """Each layout's summary over its repeats, in the sweep's layout order."""
    return {layout: summarize_layout([r for r in result["runs"] if r["layout"] == layout], result["rates"],
                                     result["target_attainment"])
            for layout in result["layouts"]}


def versus_colocated(summary: dict[str, dict]) -> dict[str, dict]:
    """Each other layout against `colocated`: the ratio of mean interpolated goodputs, and per rate both measured
    up to colocated's saturation (its mean step goodput) the ratios of mean TTFT p90 and mean TPOT p99."""
    base = summary.get("colocated")
    if base is None:
        return {}
    saturation = base["goodput_mean"] or 0.0
    comparisons = {}
    for name, other in summary.items():
        if name == "colocated":
            continue
        goodputs = (other["goodput_interpolated_mean"], base["goodput_interpolated_mean"])
        rates = [rate for rate in other["per_rate"] if float(rate) <= saturation
                 and other["per_rate"][rate]["slo_attainment"] and base["per_rate"][rate]["slo_attainment"]]
        comparisons[name] = {
            "goodput_ratio": goodputs[0] / goodputs[1] if None not in goodputs and goodputs[1] else None,
            **{f"{key}_ratio": {rate: _ratio(other["per_rate"][rate][key], base["per_rate"][rate][key])
                                for rate in rates} for key in ("ttft_p90_ms", "tpot_p99_ms")}}
    return comparisons


def _ratio(values: list, base: list) -> float | None:
    numerator, denominator = mean(values), mean(base)
    return None if numerator is None or not denominator else numerator / denominator


def versus_lines(comparisons: dict[str, dict]) -> list[str]:
    """One line per layout: its ratios to colocated, the latency ones by rate (req/s: ratio)."""
    return [f"{name} vs colocated: goodput {_times(c['goodput_ratio'])}; up to colocated's saturation, TTFT p90 "
            f"{_by_rate(c['ttft_p90_ms_ratio'])}; TPOT p99 {_by_rate(c['tpot_p99_ms_ratio'])}"
            for name, c in comparisons.items()]


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _by_rate(ratios: dict[str, float | None]) -> str:
    return ", ".join(f"{rate}: {_times(value)}" for rate, value in ratios.items()) or "no rate"


def best_layout(summary: dict[str, dict]) -> str | None:
    """The layout with the highest mean interpolated goodput, among those whose every start succeeded."""
    ranked = [(s["goodput_interpolated_mean"], name) for name, s in summary.items()
              if s["goodput_interpolated_mean"] is not None and not s["start_errors"]]
    return max(ranked)[1] if ranked else None


def auto_entry(result: dict, summary: dict[str, dict]) -> str | None:
    """The `pdserve.layouts.MEASURED_BEST` line for this sweep's best layout."""
    best = best_layout(summary)
    if best is None:
        return None
    others = ", ".join(f"{name} {_req_s(s['goodput_interpolated_mean'])}" for name, s in summary.items()
                       if name != best)
    repeats = len(summary[best]["goodput_req_s"])
    why = (f"goodput {_req_s(summary[best]['goodput_interpolated_mean'])} (interpolated, mean of "
           f"{repeats} repeat{'s' if repeats > 1 else ''}){'; ' + others if others else ''}; "
           f"TTFT <= {result['slo']['ttft_ms']:g} ms, TPOT <= {result['slo']['tpot_ms']:g} ms, "
           f"{result['device_name']}, {result['date'][:10]}")
    return f"({result['workload']!r}, {result['num_gpus']}): Measured({best!r}, {why!r}),"


def _req_s(value: float | None) -> str:
    return "none" if value is None else f"{value:.1f} req/s"


def summary_lines(result: dict) -> list[str]:
    """The comparison in words, one line per layout."""
    lines = []
    for name, s in result["summary"].items():
        spread_pct = s["goodput_interpolated_spread"]
        at_least = ">= " if any(s["lower_bound_only"]) else ""  # no rate failed: the rates stopped short of it
        lines.append(f"{name:>20}: goodput {at_least}{_req_s(s['goodput_mean'])} (interpolated "
                     f"{_req_s(s['goodput_interpolated_mean'])}, repeats "
                     f"{', '.join(_req_s(g) for g in s['goodput_interpolated_req_s'])}, spread "
                     f"{'n/a' if spread_pct is None else f'{100 * spread_pct:.0f}%'}); failed requests "
                     f"{s['failed_requests']}, KV pools free after every run: {s['kv_pools_free']}"
                     + (f"; start errors: {len(s['start_errors'])}" if s["start_errors"] else ""))
    return lines


def rate_table_lines(result: dict) -> list[str]:
    """Per layout and rate, the mean over repeats of attainment, TTFT p50/p90, TPOT p50/p99 and the share of
    prompts prefilled on a decode server."""
    lines = [f"{'layout':>20} {'req/s':>6} {'in SLO':>7} {'TTFT p50/p90 ms':>17} {'TPOT p50/p99 ms':>16} "
             f"{'local':>6} {'runs':>4}"]
    for name, summary in result["summary"].items():
        for rate, row in summary["per_rate"].items():
            if row["slo_attainment"]:
                lines.append(f"{name:>20} {rate:>6} {_pct(mean(row['slo_attainment'])):>7} "
                             f"{_ms(row, 'ttft', 'p50', 'p90'):>17} {_ms(row, 'tpot', 'p50', 'p99'):>16} "
                             f"{_pct(mean(row['local_prefill_share'])):>6} {len(row['slo_attainment']):>4}")
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ms(row: dict, metric: str, low: str, high: str) -> str:
    values = [mean(row[f"{metric}_{pct}_ms"]) for pct in (low, high)]
    return " / ".join("-" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}" for v in values)


# ---- the PNG grid ----------------------------------------------------------------------------------------------


def draw(result: dict) -> Any:
    """Goodput per layout (bars: step and interpolated, whiskers min-max over repeats), attainment and latency
    percentiles against rate (mean over repeats, band min-max), one colour per layout."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    _goodput_bars(axes[0][0], result)
    _rate_panel(axes[0][1], result, "slo_attainment", "SLO attainment (%)", scale=100.0,
                line=100 * result["target_attainment"])
    axes[0][1].set_ylim(0, 105)
    slo = result["slo"]
    for ax, (metric, pct) in zip([axes[0][2], *axes[1]], LATENCIES):
        limit = slo["ttft_ms"] if metric == "ttft_ms" else slo["tpot_ms"]
        _rate_panel(ax, result, f"{metric[:-3]}_{pct}_ms", f"{metric[:-3].upper()} {pct} (ms)", line=limit,
                    log=metric == "ttft_ms")
    if axes[0][1].get_legend_handles_labels()[0]:
        axes[0][1].legend(fontsize=8)
    where = (f"{result['num_gpus']} servers on the CPU" if result["device_name"] == "CPU" else
             f"{result['num_gpus']} x {result['device_name']}")
    fig.suptitle(f"{result['workload']} workload, {result['model']}, {where}, "
                 f"TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms, {result['repeats']} repeats, "
                 f"{result['date']}", fontsize=10)
    return fig


def _goodput_bars(ax, result: dict) -> None:
    names = list(result["summary"])
    for offset, key, label in ((-0.2, "goodput_req_s", "highest passing rate"),
                               (0.2, "goodput_interpolated_req_s", "interpolated")):
        for index, name in enumerate(names):
            values = [v for v in result["summary"][name][key] if v is not None]
            if not values:
                continue
            center = sum(values) / len(values)
            ax.bar(index + offset, center, width=0.4, color="C0" if offset < 0 else "C1",
                   label=label if index == 0 else None, yerr=[[center - min(values)], [max(values) - center]],
                   capsize=4)
            at_least = ">=" if any(result["summary"][name]["lower_bound_only"]) else ""
            ax.annotate(f"{at_least}{center:.1f}", (index + offset, center), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_title(f"goodput (req/s, >= {100 * result['target_attainment']:g}% in SLO)", fontsize=10)
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _rate_panel(ax, result: dict, key: str, title: str, scale: float = 1.0, line: float | None = None,
                log: bool = False) -> None:
    for index, (name, summary) in enumerate(result["summary"].items()):
        points = [(float(rate), [scale * v for v in row[key] if v is not None])
                  for rate, row in summary["per_rate"].items()]
        points = [(rate, values) for rate, values in points if values]
        if not points:
            continue
        rates = [rate for rate, _ in points]
        ax.plot(rates, [sum(v) / len(v) for _, v in points], marker="o", color=f"C{index}", label=name)
        ax.fill_between(rates, [min(v) for _, v in points], [max(v) for _, v in points], color=f"C{index}",
                        alpha=0.15)
    if line is not None:
        ax.axhline(line, color="grey", linestyle="--", linewidth=0.8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("request rate (req/s)")
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def plot(result: dict, out: Path) -> Path:
    require_matplotlib()
    return save_figure(draw(result), out)
