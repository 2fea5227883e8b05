"""`python -m pdserve.launch_server --model-path ...`: SGLang's launch command with the module renamed."""

from __future__ import annotations

from pdserve.config import ServerArgs, exit_on_config_error

PROG = "python -m pdserve.launch_server"


def main(argv: list[str] | None = None) -> int:
    from pdserve.hub import with_local_model
    from pdserve.preflight import check_before_loading

    cli = ServerArgs.from_cli(argv)
    exit_on_config_error(PROG, lambda: check_before_loading(cli))  # before a download or a load
    args = exit_on_config_error(PROG, lambda: with_local_model(cli))
    from pdserve.server.serve import serve

    return serve(args)


if __name__ == "__main__":
    from pdserve.process_setup import exit_now

    exit_now(main())
