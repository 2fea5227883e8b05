"""The one way every process (server, detokenizer, scheduler, offline `LLM`) loads the model's tokenizer."""

from __future__ import annotations

import os
from typing import Any

from pdserve.config import ServerArgs


def load_tokenizer(args: ServerArgs) -> Any:
    from transformers import AutoTokenizer

    path = args.tokenizer_path or args.model_path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code,
                                              use_fast=args.tokenizer_mode != "slow")
    if args.chat_template is not None:
        tokenizer.chat_template = chat_template_text(args.chat_template)
    return tokenizer


def chat_template_text(template: str) -> str:
    """`--chat-template`: the text of the file it names, else the template itself."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as file:
            return file.read()
    return template
