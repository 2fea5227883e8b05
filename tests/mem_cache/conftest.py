"""Fixtures for the KV-cache tier tests: a tiny random model and its HF twin for greedy references."""

from __future__ import annotations

import pytest
import torch
from hicache_util import MAX_NEW
from transformers import AutoModelForCausalLM

from pdserve.tools.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_model("llama-tiny", tmp_path_factory.mktemp("models") / "llama-tiny", seed=0))


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """Greedy continuation of a prompt by HF transformers (fp32, eager attention): the reference output."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager").eval()

    def run(prompt: list[int], n: int = MAX_NEW) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        return out[0, len(prompt):].tolist()

    return run
