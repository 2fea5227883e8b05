"""The one way every process (server, detokenizer, scheduler, offline `LLM`) loads the model's tokenizer."""

from __future__ import annotations

from typing import Any

from pdserve.config import ServerArgs


def load_tokenizer(args: ServerArgs) -> Any:
    from transformers import AutoTokenizer

    path = args.tokenizer_path or args.model_path
    return AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
