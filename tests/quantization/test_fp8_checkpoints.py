"""FP8 checkpoints written by make_model load into the layers byte for byte (every tensor-parallel rank its slice:
rows of the column-parallel layers with their scales, input columns of the row-parallel ones with all scales);
per-tensor scales of fused parts stay per part, static input scales of fused parts become their maximum,
block-scaled weights are re-quantized per channel, and bad combinations are refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import ConfigError, ServerArgs
from pdserve.distributed.tensor_parallel import TPGroup
from pdserve.models.loader import build_model, load_weights
from pdserve.models.model_config import ModelConfig
from pdserve.quantization.fp8 import FP8

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = {"o_proj", "down_proj"}


def load_rank(path: str, rank: int = 0, size: int = 1, flag: str | None = None, lm_head: bool = False):
    cfg = ModelConfig.from_path(path).with_quantization(flag, lm_head)
    model = build_model(cfg, torch.float32, torch.device("cpu"), TPGroup(rank, size))
    load_weights(model, Path(path), show_progress=False)
    return model


def fp8_layers(model):
    return {name: m for name, m in model.named_modules() if getattr(m, "weight_scale", None) is not None}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
    scale = scale.reshape(-1).float()
    return scale.expand(rows) if scale.numel() == 1 else scale


def expected_layer(files: dict, prefix: str, layer, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight and per-row scales this rank's layer `prefix` must hold, from the checkpoint tensors."""
    short = prefix.rsplit(".", 1)[1]
    if short in ROW_PARALLEL:
        weight = files[f"model.{prefix}.weight"]
        cols = weight.shape[1] // tp.size
        return weight[:, tp.rank * cols:(tp.rank + 1) * cols], per_row(files[f"model.{prefix}.weight_scale"],
                                                                       weight.shape[0])
    parts = [prefix.replace(short, p) for p in FUSED[short]]
    weights, scales = [], []
    for part, shard in zip(parts, layer.shards):
        weight = files[f"model.{part}.weight"]
        scale = per_row(files[f"model.{part}.weight_scale"], weight.shape[0])
        weights.append(weight[shard.start:shard.start + shard.size])
        scales.append(scale[shard.start:shard.start + shard.size])
    return torch.cat([bits(w) for w in weights]).view(FP8), torch.cat(scales)


@pytest.mark.parametrize("preset,fmt", [("qwen3-tiny", "fp8-channel"), ("qwen2-tiny", "ct-channel"),
                                        ("llama-tiny-mqa", "fp8-tensor-static"), ("qwen3-tiny", "ct-tensor-static")])
@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_checkpoint_bytes_and_scales_reach_the_layers(fp8_models, preset, fmt, rank, size):
    path = fp8_models[preset, fmt]
    files = load_file(f"{path}/model.safetensors")
    model = load_rank(path, rank, size)
    layers = fp8_layers(model)
    assert len(layers) == 4 * model.config.num_layers  # qkv, o, gate_up, down; the LM head stays
    assert model.lm_head.weight.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.float32
    for prefix, layer in layers.items():
        weight, scale = expected_layer(files, prefix, layer, TPGroup(rank, size))
        assert layer.weight.dtype == FP8 and torch.equal(bits(layer.weight), bits(weight)), prefix
        assert torch.equal(layer.weight_scale, scale), prefix
        if layer.input_scale is not None:  # make_model writes one static scale for every layer
            assert layer.input_scale.item() == files["model.layers.0.mlp.down_proj.input_scale"].item()
    assert (layers["layers.0.self_attn.qkv_proj"].input_scale is not None) == fmt.endswith("static")


def test_per_tensor_scales_of_fused_parts_stay_per_part(fp8_models):
    path = fp8_models["qwen3-tiny", "fp8-tensor-static"]
    files = load_file(f"{path}/model.safetensors")
    qkv = load_rank(path).layers[0].self_attn.qkv_proj
    q_rows, kv_rows = qkv.shards[0].size, qkv.shards[1].size
    expected = [files[f"model.layers.0.self_attn.{p}_proj.weight_scale"].item() for p in "qkv"]
    assert len(set(expected)) == 3  # three different scales, one per part
    assert qkv.weight_scale.tolist() == pytest.approx(
        [expected[0]] * q_rows + [expected[1]] * kv_rows + [expected[2]] * kv_rows, rel=0, abs=0)


def test_static_input_scales_of_fused_parts_become_their_maximum(fp8_models, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(fp8_models["qwen3-tiny", "fp8-tensor-static"], path)
    files = load_file(path / "model.safetensors")
    files["model.layers.0.self_attn.k_proj.input_scale"] = torch.tensor([0.5])
    files["model.layers.0.mlp.up_proj.input_scale"] = torch.tensor(0.01)  # a 0-dim scale as AutoFP8 writes
    save_file(files, path / "model.safetensors")
    model = load_rank(str(path))
    assert model.layers[0].self_attn.qkv_proj.input_scale.item() == 0.5
    assert model.layers[0].mlp.gate_up_proj.input_scale.item() == files["model.layers.0.mlp.gate_proj.input_scale"].item()


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)])
def test_block_scaled_weights_are_requantized_per_channel(fp8_models, rank, size):
    path = fp8_models["qwen2-tiny", "fp8-block"]
    config = json.loads(open(f"{path}/config.json").read())["quantization_config"]
    assert config["weight_block_size"] == [128, 128] and config["quant_method"] == "fp8"
    files = load_file(f"{path}/model.safetensors")
    down = load_rank(path, rank, size).layers[1].mlp.down_proj
    q, scale = files["model.layers.1.mlp.down_proj.weight"], files["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert scale.shape == (1, 3)  # 128 rows, 320 columns: blocks of 128 x 128, the last one ragged
    rows, cols = torch.arange(q.shape[0]) // 128, torch.arange(q.shape[1]) // 128
    weight = q.float() * scale[rows][:, cols]
    row_scale = weight.abs().amax(dim=1) / 448
    cols_per_rank = q.shape[1] // size
    mine = slice(rank * cols_per_rank, (rank + 1) * cols_per_rank)
    assert torch.equal(down.weight_scale, row_scale)
    assert torch.equal(bits(down.weight), bits((weight / row_scale[:, None])[:, mine].to(FP8)))


def test_load_time_quantization_is_per_output_channel(tiny_models):
    path = tiny_models["llama-tiny"]  # tied embeddings: the FP8 LM head gets its own copy
    files = load_file(f"{path}/model.safetensors")
    model = load_rank(path, 1, 2, flag="fp8", lm_head=True)
    gate_up = model.layers[0].mlp.gate_up_proj
    up = files["model.layers.0.mlp.up_proj.weight"]
    shard, offset = gate_up.shards[1], gate_up.offsets[1]
    mine = up[shard.start:shard.start + shard.size]
    scale = mine.abs().amax(dim=1) / 448
    assert torch.equal(gate_up.weight_scale[offset:offset + shard.size], scale)
    assert torch.equal(bits(gate_up.weight[offset:offset + shard.size]), bits((mine / scale[:, None]).to(FP8)))
    head, embed = model.lm_head, files["model.embed_tokens.weight"]
    assert head.weight is not model.embed_tokens.weight and head.weight.dtype == FP8
    assert torch.equal(model.embed_tokens.weight, embed[head.start:head.start + head.rows_per_rank])
    rows = embed[head.start:head.start + head.rows_per_rank]
    assert torch.equal(head.weight_scale[:rows.shape[0]], rows.abs().amax(dim=1) / 448)


def test_written_configs_name_their_format(fp8_models):
    ct = json.loads(open(f"{fp8_models['qwen3-tiny', 'ct-tensor-static']}/config.json").read())["quantization_config"]
    group = ct["config_groups"]["group_0"]
    assert (ct["quant_method"], ct["format"], ct["ignore"]) == ("compressed-tensors", "float-quantized", ["lm_head"])
    assert group["weights"]["strategy"] == "tensor" and group["input_activations"]["dynamic"] is False
    scales = load_file(f"{fp8_models['qwen3-tiny', 'ct-tensor-static']}/model.safetensors")
    assert scales["model.layers.0.mlp.down_proj.weight_scale"].shape == (1,)
    assert scales["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert scales["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("flag,lm_head,fmt,message", [
    ("compressed-tensors", False, "fp8-channel", "--quantization compressed-tensors does not match the checkpoint's "
                                                 "quantization_config (quant_method fp8)"),
    ("fp8", False, "ct-channel", "--quantization fp8 does not match the checkpoint's quantization_config "
                                 "(quant_method compressed-tensors)"),
    ("compressed-tensors", False, None, "--quantization compressed-tensors needs a checkpoint quantized by "
                                        "compressed-tensors"),
    (None, True, None, "--quantize-lm-head needs --quantization fp8 or an FP8 checkpoint"),
])
def test_bad_combinations_are_refused_in_one_line(tiny_model, fp8_models, flag, lm_head, fmt, message):
    path = fp8_models["qwen3-tiny", fmt] if fmt else tiny_model
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        ModelConfig.from_path(path).with_quantization(flag, lm_head)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "bits": 4}, "the checkpoint is quantized with 'awq', which pdserve does not load"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "activation_scheme 'per-token' is neither"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}}, "weights type=int, num_bits=8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}, "input_activations": None}}},
     "weight-only FP8 is not served"),
])
def test_checkpoints_pdserve_cannot_run_are_refused_by_name(tiny_model, tmp_path, qc, message):
    path = tmp_path / "m"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_path(path)


def test_an_fp8_lm_head_needs_the_flag(fp8_models, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(fp8_models["qwen3-tiny", "fp8-channel"], path)
    files = load_file(path / "model.safetensors")
    files["lm_head.weight"] = files["lm_head.weight"].to(FP8)
    save_file(files, path / "model.safetensors")
    with pytest.raises(ValueError, match="'lm_head.weight' is FP8 but its layer is not .an FP8 LM head needs "
                                         "--quantize-lm-head."):
        load_rank(str(path))


def test_a_block_weight_without_its_scales_is_named(fp8_models, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(fp8_models["qwen3-tiny", "fp8-block"], path)
    files = load_file(path / "model.safetensors")
    del files["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    save_file(files, path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights: .*layers.1.self_attn.qkv_proj part 2: weight"):
        load_rank(str(path))


def test_unknown_methods_are_refused_on_the_command_line():
    with pytest.raises(ConfigError, match="--quantization gptq needs gptq quantized weights, which pdserve does not "
                                          "implement"):
        ServerArgs(model_path="m", quantization="gptq")
    result = subprocess.run([sys.executable, "-m", "pdserve.launch_server", "--model-path", "m", "--quantization",
                             "awq"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--quantization awq needs awq quantized weights" in result.stderr


def test_the_decode_roofline_reads_fp8_weights_as_one_byte(tiny_model):
    from pdserve.bench.roofline import ModelCost

    cfg = ModelConfig.from_path(tiny_model)
    bf16, fp8 = ModelCost.of(cfg, itemsize=2), ModelCost.of(cfg.with_quantization("fp8", False), itemsize=2)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    assert fp8.weight_bytes - head == (bf16.weight_bytes - head) // 2 == bf16.layer_params
    assert ModelCost.of(cfg.with_quantization("fp8", True), itemsize=2).weight_bytes == bf16.layer_params + head // 2


def _with_unquantized(fp8_path: str, fp32_path: str, out: Path, modules: list[str], ignore: list[str]) -> str:
    """A copy of the FP8 checkpoint whose `modules` are the fp32 ones, listed as `ignore` in its config."""
    shutil.copytree(fp8_path, out)
    files, originals = load_file(out / "model.safetensors"), load_file(f"{fp32_path}/model.safetensors")
    for module in modules:
        files = {n: t for n, t in files.items() if not n.startswith(f"{module}.")}
        files[f"{module}.weight"] = originals[f"{module}.weight"]
    save_file(files, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    qc["ignore" if "ignore" in qc else "ignored_layers"] = ignore
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("fmt,ignore,down_layers", [
    ("ct-channel", ["lm_head", "model.layers.1.mlp.down_proj", r"re:.*layers\.0\.self_attn\.[qkv]_proj$"], [1]),
    ("fp8-tensor-static", ["lm_head", "down_proj", "re:.*0.self_attn.[qkv]_proj"], [0, 1]),  # a last name part
])
def test_layers_the_checkpoint_leaves_unquantized_stay_in_the_model_dtype(tiny_models, fp8_models, tmp_path, fmt,
                                                                          ignore, down_layers):
    fp32 = tiny_models["qwen3-tiny"]
    down = [f"model.layers.{i}.mlp.down_proj" for i in down_layers]
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    path = _with_unquantized(fp8_models["qwen3-tiny", fmt], fp32, tmp_path / "m", down + qkv, ignore)
    model = load_rank(path, 1, 2)
    originals = load_file(f"{fp32}/model.safetensors")
    assert model.layers[1].mlp.down_proj.weight_scale is None
    assert torch.equal(model.layers[1].mlp.down_proj.weight, originals["model.layers.1.mlp.down_proj.weight"][:, 96:])
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == FP8
    assert model.layers[1].mlp.gate_up_proj.weight.dtype == FP8
    assert (model.layers[0].mlp.down_proj.weight.dtype == FP8) == (0 not in down_layers)


def test_a_fused_layer_left_partly_unquantized_is_refused(tiny_models, fp8_models, tmp_path):
    path = _with_unquantized(fp8_models["qwen3-tiny", "ct-channel"], tiny_models["qwen3-tiny"], tmp_path / "m",
                             ["model.layers.0.mlp.up_proj"], ["lm_head", "model.layers.0.mlp.up_proj"])
    with pytest.raises(ConfigError, match="quantizes some of model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj "
                                          "but not all"):
        load_rank(path)


def test_dummy_weights_are_quantized_like_a_checkpoints(tiny_model):
    from pdserve.models.loader import load_model

    cfg = ModelConfig.from_path(tiny_model).with_quantization("fp8", True)
    model = load_model(tiny_model, cfg, torch.float32, torch.device("cpu"), dummy=True)
    layers = fp8_layers(model)
    assert len(layers) == 4 * cfg.num_layers + 1  # and the LM head
    for layer in layers.values():
        dequantized = layer.weight.float() * layer.weight_scale[:, None]
        assert layer.weight.abs().float().amax(dim=1).tolist() == [448.0] * layer.weight.shape[0]
        assert 0.015 < dequantized.std().item() < 0.025  # normal(0, 0.02)
