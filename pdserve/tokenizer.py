"""The one way every process (server, scheduler, offline `LLM`) loads the model's tokenizer, and how the server hands
its loaded one to the detokenizer."""

from __future__ import annotations

import os
import pickle
import re
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


def pack_tokenizer(tokenizer: Any) -> bytes:
    """A loaded tokenizer as bytes for another process (`unpack_tokenizer`). Unpacking imports only the tokenizer's
    class; loading it again would import torch too (AutoTokenizer reads the model's config through transformers'
    configuration module, which imports torch wherever it is installed): about 3 CPU-seconds a process.
    Pickle, as multiprocessing passes every spawned child its arguments: only from a server to the children it
    spawns, never over a socket (messages between processes and hosts are msgpack, `pdserve.messages`)."""
    return pickle.dumps(tokenizer)


def unpack_tokenizer(packed: bytes, args: ServerArgs) -> Any:
    if args.trust_remote_code:  # the class may be remote code, in transformers' module cache where loading put it
        from transformers.dynamic_module_utils import init_hf_modules

        init_hf_modules()
    return pickle.loads(packed)


def chat_template_text(template: str) -> str:
    """`--chat-template`: the text of the file it names, else the template itself."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as file:
            return file.read()
    return template


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted (`bytes_to_unicode`): the character each byte is written as in a
    token string → that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in printable)
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return {char: byte for byte, char in chars.items()}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenBytes:
    """A token's raw bytes, as OpenAI's logprob `bytes`: a byte-level BPE token's string mapped back through the
    byte alphabet, a SentencePiece byte token's byte, else the UTF-8 of its text. Its text alone may be U+FFFD
    where the token is part of a multi-byte character; its bytes never are."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)

    def __call__(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return text.encode()
        if self.byte_level and all(char in BYTE_LEVEL_ALPHABET for char in piece):
            return bytes(BYTE_LEVEL_ALPHABET[char] for char in piece)
        byte_token = _BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(byte_token[1], 16)]) if byte_token else text.encode()


def _is_byte_level(tokenizer: Any) -> bool:
    """A fast tokenizer whose decoder is (or holds) ByteLevel, or a slow one with a byte decoder (GPT-2's)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        return b'"ByteLevel"' in decoder.__getstate__()
    return hasattr(tokenizer, "byte_decoder")
