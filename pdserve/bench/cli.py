"""What every benchmark command line shares: help that keeps the module docstring's layout and shows each
option's default."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and "(default: ...)" after every optional option's help unless the help
    already says its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def bench_parser(description: str | None, **kwargs) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter, **kwargs)


def run_with_plot(argv: list[str] | None, plot_main: Callable[[list[str]], None],
                  run: Callable[[list[str]], dict]) -> dict | None:
    """`plot ARGS` draws saved results (`plot_main`); anything else runs the benchmark (`run`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        plot_main(argv[1:])
        return None
    return run(argv)


def write_result(path: Path | None, result: dict) -> None:
    """The result as JSON at `path` (folders made); nothing without one."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))


def engine_bench_parser(description: str | None, out_help: str, out_default: Path | None = None
                        ) -> argparse.ArgumentParser:
    """A parser for a benchmark of the in-process engine: `--model-path` and `--out` (where the results go); the
    engine's own flags (`--tp-size`, ...) are left to `parse_known_args` and go to `LLM`."""
    parser = bench_parser(description)
    parser.add_argument("--model-path", required=True, help="HF-format model folder")
    parser.add_argument("--out", type=Path, default=out_default, help=out_help)
    return parser


def parse_engine_bench_args(parser: argparse.ArgumentParser, argv: list[str] | None
                            ) -> tuple[argparse.Namespace, dict]:
    """The benchmark's own arguments, and the engine flags among `argv` as `LLM` keywords that differ from the
    defaults (`--max-total-tokens 8192 --disable-cuda-graph` -> {"max_total_tokens": 8192, "disable_cuda_graph": True})."""
    from pdserve.config import ServerArgs, build_arg_parser

    args, flags = parser.parse_known_args(argv)
    ns = build_arg_parser().parse_args(["--model-path", "_", *flags])
    defaults = ServerArgs(model_path="_")
    return args, {k: v for k, v in vars(ns).items() if k != "model_path" and getattr(defaults, k) != v}
