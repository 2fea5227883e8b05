"""The benchmarks' command lines and the serving benchmark's chart, without a server."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import pytest

from pdserve.bench import plots, serving

BENCH_PARSERS = [("serving", "build_parser"), ("serving", "build_plot_parser"), ("soak", "build_parser"),
                 ("offline", "build_parser"), ("one_batch", "build_parser"), ("decode_host", "build_parser"),
                 ("step_profile", "build_parser"), ("hicache", "build_parser"), ("hicache_copy", "build_parser"),
                 ("kv_transfer", "build_parser"), ("kernels", "build_parser"), ("decode_sweep", "build_parser"),
                 ("skinny_sweep", "build_parser")]


def option_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option's help as `--help` prints it, joined onto one line."""
    formatter = parser.formatter_class(prog=parser.prog)
    return {action.option_strings[-1] if action.option_strings else action.dest: formatter._expand_help(action)
            for action in parser._actions if action.help is not argparse.SUPPRESS}


@pytest.mark.parametrize("module, factory", BENCH_PARSERS)
def test_every_benchmark_option_has_help_that_shows_its_default(module, factory):
    parser = getattr(importlib.import_module(f"pdserve.bench.{module}"), factory)()
    helps = option_helps(parser)
    missing = [name for name, text in helps.items() if not text]
    assert not missing, f"options without help: {missing}"
    options = [a for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS]  # not --help
    no_default = [a.option_strings[-1] for a in options if not a.required
                  and "(default" not in helps[a.option_strings[-1]]]
    assert not no_default, f"options whose help does not show the default: {no_default}"


def test_a_plot_without_matplotlib_is_refused_before_the_server_is_asked(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        serving.main(["--base-url", "http://127.0.0.1:9", "--output", str(tmp_path / "r.json"),
                      "--plot", str(tmp_path / "r.png")])
    assert str(exit_info.value) == plots.MATPLOTLIB_MISSING


def run(rate: float, errors: int, attainment: float) -> dict:
    dist = {"mean": 50.0 * rate, "p50": 40.0 * rate, "p90": 60.0 * rate, "p99": 80.0 * rate}
    return {"request_rate": rate, "requests": 10, "errors": errors, "slo_attainment": attainment,
            "ttft_ms": dist, "tpot_ms": dist, "itl_ms": dist, "e2e_ms": dist}


def test_the_chart_names_model_date_and_backend_starts_its_axes_at_zero_and_shows_failures():
    pytest.importorskip("matplotlib")
    plots.require_matplotlib()
    result = {"label": "pd", "model": "/models/qwen3-tiny", "backend": "openai", "date": "2026-11-25 10:00:00 UTC",
              "runs": [run(2, 0, 1.0), run(4, 3, 0.7)]}
    fig = plots.draw_chart([result])
    assert fig._suptitle.get_text() == "pd: /models/qwen3-tiny, openai, 2026-11-25 10:00:00 UTC"
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    failed = next(ax for ax in fig.axes if ax.get_title() == "failed requests (%)")
    assert [list(line.get_ydata()) for line in failed.get_lines()] == [[0.0, 30.0]]


def test_the_chart_is_a_grid_of_panels_legible_at_full_size(tmp_path):
    """Two rows of three panels in a PNG that fits a laptop screen at 100% zoom, each panel at least 420 x 300 px
    and its smallest text at least 12 px high (one line of six panels was 2,772 x 440 px)."""
    pytest.importorskip("matplotlib")
    import matplotlib.image

    result = {"label": "pd", "model": "m", "backend": "openai", "date": "d", "runs": [run(2, 0, 1.0), run(4, 3, 0.7)]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    height, width = matplotlib.image.imread(plots.plot_results([path], tmp_path / "r.png")).shape[:2]
    assert width <= 1600 and height <= 1000, (width, height)
    fig = plots.draw_chart([plots.load_result(path)])
    grid = {ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes}
    assert grid == {(2, 3)} and len(fig.axes) == 6
    for ax in fig.axes:
        box = ax.get_position()
        assert box.width * width >= 420 and box.height * height >= 300, (ax.get_title(), box)
        texts = [ax.title, ax.xaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]
        assert min(text.get_fontsize() for text in texts) * plots.DPI / 72 >= 12, ax.get_title()


def test_the_sweep_explains_a_goodput_it_could_not_find():
    lowest = {**run(2, 6, 0.3), "slo_misses": {"failed": 6, "tpot": 7}}
    goodput = {"goodput_req_s": None, "first_failing_rate": 2, "target_attainment": 0.9, "lower_bound_only": False}
    line = serving.goodput_line(goodput, [lowest], serving.Slo(ttft_ms=1000, tpot_ms=8))
    assert line == ("no goodput: at the lowest rate, 2 req/s, 30.0% of requests met TTFT <= 1000 ms and "
                    "TPOT <= 8 ms (target 90%; missed: 6 failed, 7 over TPOT <= 8 ms); try lower --request-rate "
                    "values")
