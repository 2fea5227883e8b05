"""What every benchmark command line shares: help that keeps the module docstring's layout and shows each
option's default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and "(default: ...)" after every optional option's help unless the help
    already says its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def bench_parser(description: str | None, **kwargs) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter, **kwargs)


def engine_bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser for a benchmark of the in-process engine: `--model-path`; the engine's own flags (`--tp-size`,
    ...) are left to `parse_known_args` and go to `LLM`."""
    parser = bench_parser(description)
    parser.add_argument("--model-path", required=True, help="HF-format model folder")
    return parser
