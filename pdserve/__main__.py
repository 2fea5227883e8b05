"""`python -m pdserve --model-path ...` serves like `pdserve.launch_server`; add `--shell` to chat in the terminal
(`chat_shell.py`)."""

from __future__ import annotations

import sys

from pdserve.config import ServerArgs, build_arg_parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_arg_parser(prog="python -m pdserve")
    parser.add_argument("--shell", action="store_true", help="Chat with the model in this terminal.")
    ns = parser.parse_args(argv)
    args = ServerArgs.from_namespace(ns)
    if not ns.shell:
        from pdserve.server.serve import serve

        return serve(args)
    from pdserve.chat_shell import run_shell

    return run_shell(args, [a for a in argv if a != "--shell"])


if __name__ == "__main__":
    from pdserve.process_setup import exit_now

    exit_now(main())
