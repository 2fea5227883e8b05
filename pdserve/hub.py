"""Where a `--model-path` (or `LLM(model_path)`) lives on disk: a folder as given, or a Hugging Face hub id
resolved through the HF cache (`HF_HOME`; with `HF_HUB_OFFLINE=1` the cache only), as SGLang users expect."""

from __future__ import annotations

import os

from pdserve.config import ConfigError, ServerArgs


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """The local folder of `path`: itself when it is a folder, else the snapshot of the hub id `path`;
    ConfigError in one line when it is neither."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(path, revision=revision, local_files_only=_offline())
    except HFValidationError:
        raise ConfigError(f"model path {path!r} is neither a folder nor a hub id (org/name)") from None
    except Exception as exc:  # not in the cache offline, unknown repository, no network: all one line
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"model path {path!r} is not a folder, and the hub id could not be resolved: {reason}") from None


def with_local_model(args: ServerArgs) -> ServerArgs:
    """`args` with the model (and tokenizer) as local folders; a hub id stays the served model name."""
    model_path = resolve_model_path(args.model_path, args.revision)
    tokenizer_path = args.tokenizer_path and resolve_model_path(args.tokenizer_path, args.revision)
    served = args.served_model_name or (args.model_path if model_path != args.model_path else None)
    return args.replace(model_path=model_path, tokenizer_path=tokenizer_path, served_model_name=served)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
