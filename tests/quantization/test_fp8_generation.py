"""Greedy generation with FP8 weights equals, token for token, HF transformers in fp32 running the same FP8
weights dequantized and the same per-token activation quantization (simulated before each linear layer), for
weights quantized at load (`--quantization fp8`, LM head too with `--quantize-lm-head`) and for each checkpoint
format, with TP 1 and TP 2 (gloo). Under TP a row-parallel layer (o_proj, down_proj) quantizes each rank's slice
of its input by itself, so the reference does too."""

from __future__ import annotations

import pytest
import torch
from engine.test_hf_equivalence import greedy, hf_greedy, random_prompts
from fp8_util import FORMATS
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from pdserve import LLM
from pdserve.quantization.fp8 import FP8, FP8_MAX, MIN_SCALE
from pdserve.quantization.formats import BLOCK_SCALE

MAX_NEW = 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def fake_quant(x: torch.Tensor, slices: int, static_scale: float | None) -> torch.Tensor:
    """x quantized to E4M3 and back: per token over each of `slices` equal slices, or at one static scale."""
    parts = []
    for part in x.chunk(slices, dim=-1):
        amax = part.abs().amax(dim=-1, keepdim=True)
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE) if static_scale is None else torch.tensor(static_scale)
        parts.append((part / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale)
    return torch.cat(parts, dim=-1)


def quantize_by_hand(weight: torch.Tensor) -> torch.Tensor:
    scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (weight / scale).to(FP8).float() * scale


def dequantized_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every FP8 weight of the checkpoint in float32 (weight times its per-tensor, per-row or per-block scale; a
    block-scaled weight then re-quantized per row, as pdserve serves it)."""
    files = load_file(f"{path}/model.safetensors")
    out = {}
    for name, weight in files.items():
        if weight.dtype != FP8:
            continue
        prefix = name.removesuffix(".weight")
        if f"{prefix}.{BLOCK_SCALE}" in files:
            scale = files[f"{prefix}.{BLOCK_SCALE}"]
            rows, cols = torch.arange(weight.shape[0]) // 128, torch.arange(weight.shape[1]) // 128
            out[name] = quantize_by_hand(weight.float() * scale[rows][:, cols])
        else:
            scale = files[f"{prefix}.weight_scale"].float()
            out[name] = weight.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    return out


def hf_reference(fp32_path: str, weights: dict[str, torch.Tensor], input_scales: dict[str, float], tp: int):
    """HF's fp32 model with `weights` in place and every quantized layer's input fake-quantized."""
    hf = AutoModelForCausalLM.from_pretrained(fp32_path, dtype=torch.float32, attn_implementation="eager").eval()
    for name, weight in weights.items():
        module = hf.get_submodule(name.removesuffix(".weight"))
        module.weight = nn.Parameter(weight, requires_grad=False)  # a new Parameter: unties a tied LM head
        prefix = name.removesuffix(".weight")
        slices = tp if prefix.endswith(ROW_PARALLEL) else 1
        static = input_scales.get(prefix)
        module.register_forward_pre_hook(lambda m, args, s=slices, st=static: (fake_quant(args[0], s, st),))
    return hf


def static_input_scales(path: str) -> dict[str, float]:
    files = load_file(f"{path}/model.safetensors")
    return {name.removesuffix(".input_scale"): t.item() for name, t in files.items() if name.endswith(".input_scale")}


CASES = [  # preset, checkpoint format (None: quantized at load), --quantize-lm-head, TP size (TP 2 starts in ~20 s)
    ("qwen3-tiny", None, False, 1),
    ("qwen3-tiny", None, False, 2),
    ("llama-tiny", None, True, 1),  # tied embeddings: the LM head in FP8, the embedding in fp32
    ("qwen2-tiny", "fp8-tensor-static", False, 2),  # q/k/v biases, per-tensor scales, static input scales
    ("llama-tiny-mqa", "ct-channel", False, 1),
    ("qwen3-tiny", "fp8-block", False, 1),
    ("qwen2-tiny", "ct-tensor-static", False, 1),
]


@pytest.mark.parametrize("preset,fmt,lm_head,tp", CASES)
def test_fp8_greedy_equals_the_dequantized_fp32_reference(tiny_models, fp8_models, preset, fmt, lm_head, tp):
    fp32_path = tiny_models[preset]
    if fmt is None:
        path, flag = fp32_path, "fp8"
        files = load_file(f"{fp32_path}/model.safetensors")
        head = ["model.embed_tokens.weight" if "lm_head.weight" not in files else "lm_head.weight"] if lm_head else []
        weights = {name: quantize_by_hand(files[name]) for name in files
                   if name.rsplit(".", 2)[-2] in PROJECTIONS or name in head}
        weights = {("lm_head.weight" if name in head else name): w for name, w in weights.items()}
        input_scales = {}
    else:
        path, flag = fp8_models[preset, fmt], None
        weights, input_scales = dequantized_checkpoint(path), static_input_scales(path)
        assert bool(input_scales) == FORMATS[fmt].static_activations
    assert len(weights) == 7 * 2 + lm_head
    hf = hf_reference(fp32_path, weights, input_scales, tp)
    prompts = random_prompts([1, 9, 40], hf.config.vocab_size, seed=3)  # 40 > the chunk: two chunks
    llm = LLM(path, tp_size=tp, device="cpu", dtype="float32", quantization=flag, quantize_lm_head=lm_head,
              page_size=4, chunked_prefill_size=32, max_prefill_tokens=32, max_total_tokens=1024)
    try:
        assert llm.scheduler.model_info["quantization"]["lm_head"] == lm_head
        outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        longest = prompts[-1]
        scored = llm.generate([longest], greedy(1, prompt_logprobs=0, logprob_start_len=0), use_tqdm=False)[0]
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([longest])).logits[0, :-1], dim=-1)
        expected = reference[torch.arange(len(longest) - 1), torch.tensor(longest[1:])]
        torch.testing.assert_close(torch.tensor(scored.prompt_logprobs[1:]), expected, rtol=0, atol=1e-4)
    finally:
        llm.shutdown()
