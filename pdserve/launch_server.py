"""`python -m pdserve.launch_server --model-path ...`: SGLang's launch command with the module renamed."""

from __future__ import annotations

from pdserve.config import ServerArgs, exit_on_config_error


def main(argv: list[str] | None = None) -> int:
    from pdserve.hub import with_local_model

    cli = ServerArgs.from_cli(argv)
    args = exit_on_config_error("python -m pdserve.launch_server", lambda: with_local_model(cli))
    from pdserve.server.serve import serve

    return serve(args)


if __name__ == "__main__":
    from pdserve.process_setup import exit_now

    exit_now(main())
