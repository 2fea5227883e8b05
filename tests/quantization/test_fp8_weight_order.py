"""Each FP8 projection of a decode step names the weight the step reads after its own, for the FP8 rows kernel to
warm L2 with (`pdserve.kernels.l2_prefetch`): o_proj -> gate_up_proj -> down_proj -> the next layer's qkv_proj,
the last layer's down_proj -> the LM head; qkv_proj names none (the attention after it reads the KV cache)."""

from __future__ import annotations

import torch

import pdserve.layers.linear as linear_layers
from pdserve.config import ServerArgs
from pdserve.engine.model_runner import ModelRunner
from pdserve.forward_batch import ForwardMode, build_forward_batch
from pdserve.models.model_config import ModelConfig


def test_each_projection_names_the_weight_read_after_it(tiny_models, monkeypatch):
    path = tiny_models["llama-tiny"]
    cfg = ModelConfig.from_path(path)
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="float32", quantization="fp8",
                                    max_total_tokens=64, attention_backend="torch_native"), cfg)
    named = {w.data_ptr(): name for name, w in runner.model.named_parameters() if name.endswith("proj.weight")}
    named[runner.model.lm_head.weight.data_ptr()] = "lm_head"
    calls, fp8_linear = [], linear_layers.fp8_linear

    def recording(x, weight, *args):
        calls.append((named[weight.data_ptr()], None if args[-1] is None else named[args[-1].data_ptr()]))
        return fp8_linear(x, weight, *args)

    monkeypatch.setattr(linear_layers, "fp8_linear", recording)
    prompt = list(range(3, 9))
    batch = build_forward_batch(ForwardMode.EXTEND, prompt, list(range(len(prompt))), list(range(len(prompt))),
                                [0], [len(prompt)], [[0, 1]], [len(prompt) - 1], 4, runner.device)
    runner.forward(batch)

    expected = []
    for i in range(cfg.num_layers):
        following = f"layers.{i + 1}.self_attn.qkv_proj.weight" if i + 1 < cfg.num_layers else "lm_head"
        layer = f"layers.{i}"
        expected += [(f"{layer}.self_attn.qkv_proj.weight", None),
                     (f"{layer}.self_attn.o_proj.weight", f"{layer}.mlp.gate_up_proj.weight"),
                     (f"{layer}.mlp.gate_up_proj.weight", f"{layer}.mlp.down_proj.weight"),
                     (f"{layer}.mlp.down_proj.weight", following)]
    assert calls == expected
