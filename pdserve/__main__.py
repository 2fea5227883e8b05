"""`python -m pdserve --model-path ...` serves like `pdserve.launch_server`; add `--shell` to chat in the terminal
(`chat_shell.py`)."""

from __future__ import annotations

import sys

from pdserve.config import build_arg_parser, exit_on_config_error, parse_server_cli
from pdserve.hub import with_local_model
from pdserve.preflight import check_before_loading


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_arg_parser(prog="python -m pdserve")
    parser.add_argument("--shell", action="store_true", help="Chat with the model in this terminal.")
    ns, cli = exit_on_config_error(parser.prog, lambda: parse_server_cli(parser, argv))
    exit_on_config_error(parser.prog, lambda: check_before_loading(cli))  # before a download or a load
    args = exit_on_config_error(parser.prog, lambda: with_local_model(cli))
    if not ns.shell:
        from pdserve.server.serve import serve

        return serve(args)
    from pdserve.chat_shell import run_shell

    return run_shell(args, [a for a in argv if a != "--shell"])


if __name__ == "__main__":
    from pdserve.process_setup import exit_now

    exit_now(main())
