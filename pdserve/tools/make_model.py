"""Random-weight models in real Hugging Face format, so tests and benchmarks need no download.

    python -m pdserve.tools.make_model --preset qwen3-tiny --out /tmp/qwen3-tiny [--seed 0] [--dtype float32]
        [--quantization fp8|compressed-tensors [--weight-scales channel|tensor|block] [--static-activations]]

A model directory holds config.json, generation_config.json, model.safetensors (or shards and
model.safetensors.index.json), and a byte-level BPE tokenizer trained here on `CORPUS` (tokenizer.json,
tokenizer_config.json with a ChatML chat template, special_tokens_map.json). Transformers loads it as is.

Presets: `*-tiny` run on a CPU in tests (2 layers, GQA 4/2 heads, float32): `llama-tiny` has tied embeddings
(as Llama-3.2-1B) and `llama3` RoPE scaling (as Llama-3.1); `qwen2-tiny` has q/k/v biases and `linear` RoPE
scaling (Qwen's own `yarn` is left out: `linear` and `llama3` are what a from-scratch engine reproduces
exactly); `qwen3-tiny` has q/k RMSNorm and head_dim 32 != hidden 64 / 4 heads. `qwen3-0.6b` and
`llama-3.1-8b` have the exact shapes of the released models (bfloat16) and initialise on the GPU when there is
one: per tensor on the device, then to the CPU, while a writer thread saves the previous ~4.5 GB shard.

Weights: projections normal(0, 1/sqrt(fan_in)), o_proj/down_proj 4x that (each sub-layer outweighs the token
embedding in the residual stream, so tied models do not echo their input), q/k/v biases std 0.2, embedding
and lm_head rows of norm 2 (logits of std ~2), RMSNorm weights 1. Greedy decoding then gives varied,
context-dependent tokens. Each tensor has its own generator seeded from (seed, name): the same seed gives
the same bytes on the same kind of device; tiny presets always initialise on the CPU.

`--quantization` writes an FP8 checkpoint of the same weights in that `quantization_config` format
(`pdserve/quantization/formats.py`): every q/k/v/o/gate/up/down weight float8_e4m3fn with its scales, the
embeddings, norms and LM head in `--dtype`. Static input scales are not calibrated: each covers activations up to
STATIC_INPUT_AMAX.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pdserve.quantization.formats import Fp8Checkpoint

FORMAT_VERSION = 1
MARKER_FILE = "make_model.json"
DEFAULT_SHARD_BYTES = 4_500_000_000
TOKENIZER_TRAIN_VOCAB = 4096
LOGIT_STD = 2.0  # embedding and lm_head rows have this norm: logits of std ~2
BIAS_STD = 0.2
BRANCH_GAIN = 4.0  # o_proj and down_proj: each sub-layer outweighs the token embedding in the residual
STATIC_INPUT_AMAX = 32.0  # the activation magnitude a static FP8 input scale covers (larger values saturate)
LINEAR_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, IM_START, IM_END)

# Llama-3 / Qwen2 pre-tokenizer split: contractions, words, single digits, punctuation runs, whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if add_bos %}{{- bos_token }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine turns requests into tokens and tokens into text.
Prefill reads the whole prompt at once; decode then writes one token at a time for every running request.
The scheduler batches requests, the cache keeps keys and values in pages, and the router sends each request
to a prefill worker and a decode worker. When the prefill is done, its key-value cache moves to the decoder.
It's a small model, but it's a real one: they're random weights, we'll see varied tokens, and you'd better
check the output. I've read that she'd rather not. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1e-6.
Prices went from $19.99 to $24.50 (+22.6%) on 2025-03-14 at 09:30 UTC; call +1-555-0100 or mail a@b.org.
Once upon a time there was a little town by the river. Every morning the baker opened the shop, the children
walked to school, and the old clock on the square struck eight. Nobody remembered who had built the clock.
In the evening the lights came on one by one, and the river carried the reflections of the windows away.
Science is a way of asking questions. We measure, we compare, we make a model, and then we test the model
against new measurements. A good model explains what we saw and predicts what we have not seen yet.
Water boils at one hundred degrees Celsius at sea level. The Earth goes around the Sun once a year, and the
Moon goes around the Earth about once a month. Light from the Sun takes a little more than eight minutes.
def attention(query, key, value):
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    return torch.softmax(scores, dim=-1) @ value

for i in range(10):
    print(f"step {i}: loss={loss:.4f}")
{"model": "qwen3", "max_tokens": 128, "temperature": 0.7, "stream": true, "messages": [{"role": "user"}]}
<html><body><p>Hello, world!</p></body></html>  SELECT name, count(*) FROM users GROUP BY name;
Le renard brun rapide saute par-dessus le chien paresseux. Où est la bibliothèque ? Très bien, merci beaucoup.
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München! Straße, Mädchen, schön, Käse.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación? ¡Qué día tan bonito, señor!
A raposa marrom rápida pula sobre o cão preguiçoso. Não sei, mas vou ver amanhã. Obrigado pela atenção.
La volpe marrone veloce salta sopra il cane pigro. Perché no? Andiamo al mare questa estate, è più bello.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо, всё хорошо. Москва.
Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Καλημέρα! Ευχαριστώ πολύ. Αθήνα και Θεσσαλονίκη.
Szybki brązowy lis przeskakuje nad leniwym psem. Dzień dobry! Źdźbło trawy, żółć, gęś, łódź i ćma.
Hızlı kahverengi tilki tembel köpeğin üzerinden atlar. Günaydın! Teşekkür ederim, İstanbul çok güzel.
敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据和计算。
北京是中国的首都，上海是最大的城市。请问，火车站怎么走？谢谢你的帮助。我喜欢喝茶，也喜欢看书。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界！東京は日本の首都です。ありがとうございます。
ひらがな、カタカナ、漢字を使います。今日はいい天気ですね。ラーメンとすしが大好きです。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 세계! 서울은 한국의 수도입니다. 감사합니다.
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم! شكرا جزيلا. القاهرة ودمشق وبغداد.
השועל החום המהיר קופץ מעל הכלב העצלן. שלום עולם! תודה רבה. ירושלים ותל אביב.
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। नमस्ते दुनिया! धन्यवाद। दिल्ली और मुंबई।
สุนัขจิ้งจอกสีน้ำตาลกระโดดข้ามสุนัขขี้เกียจ สวัสดีชาวโลก ขอบคุณมาก กรุงเทพมหานคร
Con cáo nâu nhanh nhẹn nhảy qua con chó lười. Xin chào thế giới! Cảm ơn rất nhiều. Hà Nội và Sài Gòn.
Emoji: 😀 😂 🥲 😍 🤖 🚀 🔥 ✨ 🎉 👍 👍🏽 ❤️ 🇯🇵 🇫🇷 👨‍👩‍👧‍👦 🏳️‍🌈 ☕ 🍣 🐍 🦀 ✅ ❌ ⚠️ → ← ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π λ µ °C €
Math: E = mc², a² + b² = c², ∀x ∈ ℝ: x² ≥ 0. Fractions ½ ¼ ¾; Roman numerals Ⅰ Ⅱ Ⅲ Ⅳ; quotes “curly” ‘single’ «guillemets».
"""


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    model_type: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    add_bos: bool

    @property
    def is_tiny(self) -> bool:
        return self.name.endswith("-tiny")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="llama-tiny", model_type="llama", architecture="LlamaForCausalLM",
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=2048, max_position_embeddings=4096, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 512},
            rms_norm_eps=1e-5, tie_word_embeddings=True, qkv_bias=False, qk_norm=False, dtype="float32",
            add_bos=True,
        ),
        Preset(
            name="qwen2-tiny", model_type="qwen2", architecture="Qwen2ForCausalLM",
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=320, vocab_size=1536, max_position_embeddings=4096, rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, qk_norm=False, dtype="float32",
            add_bos=False,
        ),
        Preset(
            name="qwen3-tiny", model_type="qwen3", architecture="Qwen3ForCausalLM",
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=192, vocab_size=1280, max_position_embeddings=4096, rope_theta=1000000.0,
            rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=True,
            dtype="float32", add_bos=False,
        ),
        Preset(
            name="qwen3-0.6b", model_type="qwen3", architecture="Qwen3ForCausalLM",
            hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
            rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False, qk_norm=True,
            dtype="bfloat16", add_bos=False,
        ),
        Preset(
            name="llama-3.1-8b", model_type="llama", architecture="LlamaForCausalLM",
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
            rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False, qk_norm=False, dtype="bfloat16",
            add_bos=True,
        ),
    )
}

# one KV head for four query heads: with tensor parallelism every rank holds a replica of it
PRESETS["llama-tiny-mqa"] = replace(PRESETS["llama-tiny"], name="llama-tiny-mqa", num_key_value_heads=1)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Literal["normal", "rows", "ones"]  # rows: normal rows rescaled to the norm `scale`
    scale: float = 1.0  # std for "normal", row norm for "rows"


def tensor_specs(preset: Preset) -> list[TensorSpec]:
    """Every tensor of the checkpoint, with Hugging Face names, in a fixed order."""
    h, hd, inter = preset.hidden_size, preset.head_dim, preset.intermediate_size
    q_out, kv_out = preset.num_attention_heads * hd, preset.num_key_value_heads * hd
    specs = [TensorSpec("model.embed_tokens.weight", (preset.vocab_size, h), "rows", LOGIT_STD)]
    for i in range(preset.num_hidden_layers):
        layer = f"model.layers.{i}"
        specs.append(TensorSpec(f"{layer}.input_layernorm.weight", (h,), "ones"))
        for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            specs.append(TensorSpec(f"{layer}.self_attn.{proj}.weight", (out, h), "normal", h**-0.5))
            if preset.qkv_bias:
                specs.append(TensorSpec(f"{layer}.self_attn.{proj}.bias", (out,), "normal", BIAS_STD))
        if preset.qk_norm:
            specs.append(TensorSpec(f"{layer}.self_attn.q_norm.weight", (hd,), "ones"))
            specs.append(TensorSpec(f"{layer}.self_attn.k_norm.weight", (hd,), "ones"))
        specs.append(TensorSpec(f"{layer}.self_attn.o_proj.weight", (h, q_out), "normal", BRANCH_GAIN * q_out**-0.5))
        specs.append(TensorSpec(f"{layer}.post_attention_layernorm.weight", (h,), "ones"))
        specs.append(TensorSpec(f"{layer}.mlp.gate_proj.weight", (inter, h), "normal", h**-0.5))
        specs.append(TensorSpec(f"{layer}.mlp.up_proj.weight", (inter, h), "normal", h**-0.5))
        specs.append(TensorSpec(f"{layer}.mlp.down_proj.weight", (h, inter), "normal", BRANCH_GAIN * inter**-0.5))
    specs.append(TensorSpec("model.norm.weight", (h,), "ones"))
    if not preset.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (preset.vocab_size, h), "rows", LOGIT_STD))
    return specs


def hf_config(preset: Preset, dtype: str) -> dict[str, Any]:
    """config.json in the layout the released checkpoints use (`rope_theta` and `rope_scaling` at the top)."""
    ids = special_token_ids(preset.vocab_size)
    config: dict[str, Any] = {
        "architectures": [preset.architecture],
        "model_type": preset.model_type,
        "attention_bias": preset.qkv_bias,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BEGIN_OF_TEXT] if preset.add_bos else ids[END_OF_TEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[END_OF_TEXT],
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": dict(preset.rope_scaling) if preset.rope_scaling else None,  # transformers edits it
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    if preset.model_type == "llama":
        config["mlp_bias"] = False
    else:
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": preset.num_hidden_layers}
    return config


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Special tokens take the last ids of the vocabulary."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def build_tokenizer(preset: Preset) -> Any:
    """A byte-level BPE trained on CORPUS, padded with never-produced `<|reserved_N|>` entries, specials last."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    n_regular = preset.vocab_size - len(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE())
    if preset.model_type.startswith("qwen"):
        tokenizer.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json, and transformers' Qwen2Tokenizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(n_regular, TOKENIZER_TRAIN_VOCAB),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)

    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for i in range(len(vocab), n_regular):
        vocab[f"<|reserved_{i}|>"] = i
    data["added_tokens"] = [
        {"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for token, token_id in special_token_ids(preset.vocab_size).items()
    ]
    tokenizer = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    byte_level = processors.ByteLevel(trim_offsets=False)
    if preset.add_bos:
        bos_id = special_token_ids(preset.vocab_size)[BEGIN_OF_TEXT]
        bos = processors.TemplateProcessing(
            single=f"{BEGIN_OF_TEXT}:0 $A:0",
            pair=f"{BEGIN_OF_TEXT}:0 $A:0 {BEGIN_OF_TEXT}:1 $B:1",
            special_tokens=[(BEGIN_OF_TEXT, bos_id)],
        )
        tokenizer.post_processor = processors.Sequence([byte_level, bos])
    else:
        tokenizer.post_processor = byte_level
    return tokenizer


def write_tokenizer(preset: Preset, out_dir: Path) -> None:
    tokenizer = build_tokenizer(preset)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == preset.vocab_size
    tokenizer.save(str(out_dir / "tokenizer.json"))
    bos = BEGIN_OF_TEXT if preset.add_bos else None
    added_tokens_decoder = {
        str(token_id): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for token, token_id in special_token_ids(preset.vocab_size).items()
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": bos,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": preset.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": preset.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE.replace("add_bos", "true" if preset.add_bos else "false"),
    }
    special_tokens_map = {"eos_token": IM_END, "pad_token": END_OF_TEXT, "additional_special_tokens": [IM_START, IM_END]}
    if bos:
        special_tokens_map["bos_token"] = bos
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    write_json(out_dir / "special_tokens_map.json", special_tokens_map)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, spec.name))
    tensor = torch.empty(spec.shape, dtype=torch.float32, device=device)
    if spec.init == "rows":
        tensor.normal_(0.0, 1.0, generator=generator)
        tensor *= spec.scale / tensor.norm(dim=1, keepdim=True)
    else:
        tensor.normal_(0.0, spec.scale, generator=generator)
    return tensor.to(dtype)


def init_device(preset: Preset) -> torch.device:
    if not preset.is_tiny and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def stored_bytes(spec: TensorSpec, itemsize: int, fp8: Fp8Checkpoint | None) -> int:
    """The bytes of the tensor (an FP8 weight: one per element; its scales are left out)."""
    return _numel(spec.shape) * (1 if fp8 is not None and LINEAR_WEIGHT.fullmatch(spec.name) else itemsize)


def stored_tensors(spec: TensorSpec, tensor: torch.Tensor, fp8: Fp8Checkpoint | None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one spec: itself, or an FP8 linear weight with its scales."""
    if fp8 is None or not LINEAR_WEIGHT.fullmatch(spec.name):
        return {spec.name: tensor}
    return fp8.quantize(spec.name.removesuffix(".weight"), tensor, STATIC_INPUT_AMAX)


def shard_plan(specs: list[TensorSpec], itemsize: int, max_shard_bytes: int, fp8: Fp8Checkpoint | None = None
               ) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        nbytes = stored_bytes(spec, itemsize, fp8)
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def write_weights(preset: Preset, out_dir: Path, seed: int, dtype: torch.dtype, max_shard_bytes: int,
                  fp8: Fp8Checkpoint | None = None) -> None:
    """Generate tensor by tensor on the init device; a writer thread saves the previous shard meanwhile."""
    specs = tensor_specs(preset)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = shard_plan(specs, itemsize, max_shard_bytes, fp8)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    device = init_device(preset)
    total_bytes = sum(stored_bytes(s, itemsize, fp8) for s in specs)
    progress = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"{preset.name} weights",
                    disable=preset.is_tiny)
    weight_map: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=1) as writer, progress:
        pending = None
        for shard, file in zip(shards, files):
            tensors = {}
            for spec in shard:
                stored = stored_tensors(spec, init_tensor(spec, seed, dtype, device), fp8)
                tensors |= {name: t.cpu() for name, t in stored.items()}
                progress.update(stored_bytes(spec, itemsize, fp8))
            weight_map |= dict.fromkeys(tensors, file)
            if pending is not None:
                pending.result()
            pending = writer.submit(save_file, tensors, str(out_dir / file), {"format": "pt"})
        pending.result()
    if len(shards) > 1:
        write_json(out_dir / "model.safetensors.index.json",
                   {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})


OWN_FILES = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|model\.safetensors\.index)\.json"
    r"|model(-\d{5}-of-\d{5})?\.safetensors|" + re.escape(MARKER_FILE)
)


def prepare_out_dir(out_dir: Path) -> None:
    """Create `out_dir`, or clear a previous make_model output there; refuse a directory holding anything else."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = list(out_dir.iterdir())
    foreign = [e.name for e in entries if not (e.is_file() and OWN_FILES.fullmatch(e.name))]
    if foreign:
        raise FileExistsError(f"{out_dir} holds files make_model did not write: {sorted(foreign)[:5]}")
    for entry in entries:
        entry.unlink()


def make_model(
    preset: str, out_dir: str | os.PathLike[str], seed: int = 0, dtype: str | None = None,
    *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, fp8: Fp8Checkpoint | None = None,
) -> Path:
    """Write a random-weight model of `preset` into `out_dir` (its linear weights in FP8 with `fp8`) and return
    its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    spec = PRESETS[preset]
    dtype_name = dtype or spec.dtype
    if dtype_name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; choose from {sorted(DTYPES)}")
    out = Path(out_dir)
    prepare_out_dir(out)
    config = hf_config(spec, dtype_name)
    if fp8 is not None:
        config["quantization_config"] = fp8.config()
    write_json(out / "config.json", config)
    ids = special_token_ids(spec.vocab_size)
    write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [ids[IM_END], ids[END_OF_TEXT]],
        "pad_token_id": ids[END_OF_TEXT],
    })
    write_tokenizer(spec, out)
    write_weights(spec, out, seed, DTYPES[dtype_name], max_shard_bytes, fp8)
    write_json(out / MARKER_FILE, marker(preset, seed, dtype_name) | ({"quantization": fp8.config()} if fp8 else {}))
    return out


def marker(preset: str, seed: int, dtype: str) -> dict[str, Any]:
    return {"preset": preset, "seed": seed, "dtype": dtype, "format_version": FORMAT_VERSION}


def cache_root() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pdserve"


def default_model_dir(preset: str = "qwen3-tiny") -> Path:
    """The cached model of `preset` (seed 0, preset dtype), built on first use into <cache>/models/<preset>."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    target = cache_root() / "models" / preset
    expected = marker(preset, 0, PRESETS[preset].dtype)
    if _read_marker(target) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}.", dir=target.parent))
    try:
        make_model(preset, staging)
        _replace_dir(staging, target, expected)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _replace_dir(staging: Path, target: Path, expected: dict[str, Any]) -> None:
    """Rename `staging` onto `target`; a stale `target` is moved aside first, a concurrent winner is kept."""
    if target.exists() and _read_marker(target) != expected:
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
        try:
            os.rename(target, stale / "model")
        except OSError:
            pass  # another process moved it already
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if _read_marker(target) != expected:
            raise


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.tools.make_model", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=Path, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the preset's")
    parser.add_argument("--quantization", choices=["fp8", "compressed-tensors"], default=None,
                        help="write an FP8 checkpoint in this quantization_config format")
    parser.add_argument("--weight-scales", choices=["channel", "tensor", "block"], default="channel",
                        help="FP8 weight scales per output channel, per tensor or per 128x128 block (fp8 only)")
    parser.add_argument("--static-activations", action="store_true",
                        help=f"FP8: write static input scales (covering |x| <= {STATIC_INPUT_AMAX:g}) instead of "
                             "dynamic per-token activation scales")
    args = parser.parse_args(argv)
    fp8 = None
    if args.quantization is not None:
        try:
            fp8 = Fp8Checkpoint(args.quantization, args.weight_scales, args.static_activations)
        except ValueError as exc:
            parser.error(str(exc))
    path = make_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, fp8=fp8)
    print(path)


if __name__ == "__main__":
    main()
