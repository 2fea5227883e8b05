"""`python -m pdserve.launch_server --model-path ...`: SGLang's launch command with the module renamed."""

from __future__ import annotations

from pdserve.config import ServerArgs


def main(argv: list[str] | None = None) -> int:
    args = ServerArgs.from_cli(argv)
    from pdserve.server.serve import serve

    return serve(args)


if __name__ == "__main__":
    from pdserve.process_setup import exit_now

    exit_now(main())
