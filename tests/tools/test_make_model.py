from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve.tools import make_model as mm

TINY = ("llama-tiny", "qwen2-tiny", "qwen3-tiny")
TEXT = "Hello, 世界! こんにちは 안녕 👨‍👩‍👧‍👦 🇯🇵 👍🏽 naïve café — ∑x² ≥ 0\n\ttabs  and  spaces\x00 end"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {preset: mm.make_model(preset, root / preset) for preset in TINY}


@pytest.mark.parametrize("preset", TINY)
def test_files_and_config(models: dict[str, Path], preset: str) -> None:
    out, spec = models[preset], mm.PRESETS[preset]
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", mm.MARKER_FILE}
    config = json.loads((out / "config.json").read_text())
    ids = mm.special_token_ids(spec.vocab_size)
    assert config["vocab_size"] == spec.vocab_size
    assert config["eos_token_id"] == ids[mm.IM_END]
    assert config["tie_word_embeddings"] == spec.tie_word_embeddings
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [
        ids[mm.IM_END], ids[mm.END_OF_TEXT]]
    hf = AutoConfig.from_pretrained(out)
    assert hf.max_position_embeddings == 4096
    assert hf.num_key_value_heads < hf.num_attention_heads


def test_rope_and_architecture_choices() -> None:
    llama, qwen2, qwen3 = (AutoConfig.for_model(**mm.hf_config(mm.PRESETS[p], "float32")) for p in TINY)
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert qwen2.rope_parameters["rope_type"] == "linear"
    assert qwen3.head_dim * qwen3.num_attention_heads != qwen3.hidden_size
    assert sorted(p.tie_word_embeddings for p in map(mm.PRESETS.get, TINY)) == [False, False, True]


@pytest.mark.parametrize("preset", TINY)
def test_transformers_loads_every_weight(models: dict[str, Path], preset: str) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(models[preset], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    saved = load_file(models[preset] / "model.safetensors")
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    if mm.PRESETS[preset].tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])


@pytest.mark.parametrize("preset", TINY)
def test_tokenizer_round_trips_multibyte_text(models: dict[str, Path], preset: str) -> None:
    hf = AutoTokenizer.from_pretrained(models[preset])
    raw = Tokenizer.from_file(str(models[preset] / "tokenizer.json"))
    assert len(hf) == raw.get_vocab_size() == mm.PRESETS[preset].vocab_size
    ids = hf(TEXT).input_ids
    assert ids == raw.encode(TEXT).ids
    assert hf.decode(ids, skip_special_tokens=True) == TEXT
    assert (ids[0] == hf.convert_tokens_to_ids(mm.BEGIN_OF_TEXT)) == mm.PRESETS[preset].add_bos
    assert len(ids) < len(TEXT.encode()) - 8  # merges apply, also across multibyte characters
    assert hf.decode(hf("你好，世界").input_ids, skip_special_tokens=True) == "你好，世界"


@pytest.mark.parametrize("preset", TINY)
def test_chat_template(models: dict[str, Path], preset: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models[preset])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好 🤖"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好 🤖<|im_end|>\n<|im_start|>assistant\n"
    bos = mm.BEGIN_OF_TEXT if mm.PRESETS[preset].add_bos else ""
    assert text == bos + expected
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids(mm.IM_START)) == 3
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert "user\nHi there<|im_end|>" in tokenizer.apply_chat_template(parts, tokenize=False)


@pytest.mark.parametrize("preset", TINY)
def test_greedy_generation_is_varied_and_context_dependent(models: dict[str, Path], preset: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[preset]).eval()
    tokenizer = AutoTokenizer.from_pretrained(models[preset])
    outputs = []
    for prompt in ("The quick brown fox", "Once upon a time there was", "敏捷的棕色狐狸"):
        x = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(x, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, x.shape[1]:].tolist())
    assert len({tuple(o) for o in outputs}) == 3
    assert all(len(set(o)) >= 6 for o in outputs), outputs


def test_same_seed_same_bytes_other_seed_other_weights(models: dict[str, Path], tmp_path: Path) -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "pdserve.tools.make_model", "--preset", "qwen3-tiny", "--out", str(tmp_path / "a")],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert cli.stdout.strip() == str(tmp_path / "a")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (models["qwen3-tiny"] / name).read_bytes(), name
    mm.make_model("qwen3-tiny", tmp_path / "b", seed=1, dtype="bfloat16")
    other = load_file(tmp_path / "b" / "model.safetensors")
    assert other["lm_head.weight"].dtype == torch.bfloat16
    assert not torch.equal(other["lm_head.weight"].float(),
                           load_file(tmp_path / "a" / "model.safetensors")["lm_head.weight"])
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sharded_checkpoint_matches_single_file(models: dict[str, Path], tmp_path: Path) -> None:
    out = mm.make_model("qwen2-tiny", tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    merged = {k: v for f in files for k, v in load_file(out / f).items()}
    single = load_file(models["qwen2-tiny"] / "model.safetensors")
    assert merged.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    mm.make_model("qwen2-tiny", out)  # a rerun into its own output replaces it, stale shards included
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("preset", sorted(mm.PRESETS))
def test_tensor_names_and_shapes_match_transformers(preset: str) -> None:
    spec = mm.PRESETS[preset]
    config = AutoConfig.for_model(**mm.hf_config(spec, spec.dtype))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert {s.name: s.shape for s in mm.tensor_specs(spec)} == expected


def test_exact_shape_presets() -> None:
    def count(name: str) -> int:
        return sum(math.prod(s.shape) for s in mm.tensor_specs(mm.PRESETS[name]))

    assert count("llama-3.1-8b") == 8_030_261_248
    qwen = mm.PRESETS["qwen3-0.6b"]
    assert count("qwen3-0.6b") - qwen.vocab_size * qwen.hidden_size == 440_467_456  # "0.44B non-embedding"
    config = mm.hf_config(mm.PRESETS["llama-3.1-8b"], "bfloat16")
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert (config["rope_theta"], config["max_position_embeddings"]) == (500000.0, 131072)
    shards = mm.shard_plan(mm.tensor_specs(mm.PRESETS["llama-3.1-8b"]), 2, mm.DEFAULT_SHARD_BYTES)
    assert len(shards) == 4


def test_large_vocab_tokenizer_is_padded_to_exact_size() -> None:
    tokenizer = mm.build_tokenizer(mm.PRESETS["qwen3-0.6b"])
    assert tokenizer.get_vocab_size() == 151936
    assert tokenizer.token_to_id(mm.IM_END) == 151935
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT


def test_default_model_dir_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = mm.default_model_dir("qwen3-tiny")
    assert path == tmp_path / "models" / "qwen3-tiny"
    assert AutoTokenizer.from_pretrained(path).decode([72]) != ""

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a cached model")

    with monkeypatch.context() as patch:
        patch.setattr(mm, "make_model", fail)
        assert mm.default_model_dir("qwen3-tiny") == path
    (path / mm.MARKER_FILE).write_text(json.dumps({"format_version": -1}))  # stale: rebuilt in place
    assert mm.default_model_dir("qwen3-tiny") == path
    assert json.loads((path / mm.MARKER_FILE).read_text()) == mm.marker("qwen3-tiny", 0, "float32")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["qwen3-tiny"]


def test_refuses_directory_with_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        mm.make_model("qwen3-tiny", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError):
        mm.make_model("gpt-5", tmp_path / "x")
