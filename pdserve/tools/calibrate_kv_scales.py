"""Per-layer FP8 KV-cache scales for a model that has none in its checkpoint, measured on prompts.

    python -m pdserve.tools.calibrate_kv_scales --model-path M --out scales.json [--kv-cache-dtype fp8_e4m3]
        [--prompts-file prompts.txt] [--max-prompt-tokens 2048] [engine flags: --device, --dtype, ...]

Runs the prompts (one per line of the file, else a built-in set) through the model's prefill with a KV cache in the
model's dtype, takes the largest |K| and |V| each layer stored (amax), and writes scale = amax / the format's largest
value (448 for E4M3, 57344 for E5M2) with the amax, for `--kv-cache-scales scales.json`. Tensor parallel size 1:
each layer's scale covers all its heads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.mem_cache.kv_quant import KV_CACHE_DTYPES, fp8_max, is_fp8
from pdserve.models.kv_scales import FILE_FORMAT

FP8_CHOICES = tuple(name for name, dtype in KV_CACHE_DTYPES.items() if dtype is not None and is_fp8(dtype))
DEFAULT_PROMPTS = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the fall "
    "of Constantinople.",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[len(items) // 2]\n",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a by-product.",
    "Q: What is 17 times 23? A: 17 times 23 is 391. Q: What is the square root of 1764? A:",
    "Dear team, please find attached the quarterly report. Revenue grew 12% while costs fell by 3%.",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz Aldrin walked on its surface.",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY name;",
    "Il était une fois, dans un pays lointain, un roi qui avait trois filles.",
)


class KVAmax:
    """Per-layer amax of the K and V each forward pass stored, as a `ModelRunner.forward_observers` entry: a batch's
    slots are read when the next batch arrives (its forward has run by then) and once more at the end."""

    def __init__(self, pool):
        self.pool = pool
        self.amax = torch.zeros(2, pool.layout.num_layers, dtype=torch.float32, device=pool.buffer.device)
        self.pending: torch.Tensor | None = None
        self.num_tokens = 0

    def observe(self, batch: ForwardBatch) -> None:
        self.flush()
        self.pending = batch.out_cache_loc.clone()

    def flush(self) -> None:
        if self.pending is None:
            return
        stored = self.pool.buffer.index_select(2, self.pending).float().abs()
        self.amax = torch.maximum(self.amax, stored.amax(dim=(2, 3, 4)))
        self.num_tokens += len(self.pending)
        self.pending = None


def calibrate(llm, prompts: list, max_prompt_tokens: int) -> tuple[list[float], list[float], int]:
    """(K amax per layer, V amax per layer, tokens seen) over the prompts' prefill."""
    from pdserve import SamplingParams

    runner = llm.scheduler.runner
    recorder = KVAmax(runner.pool)
    ids = [llm.tokenizer.encode(p)[:max_prompt_tokens] if isinstance(p, str) else p for p in prompts]
    runner.forward_observers.append(recorder.observe)
    try:
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        recorder.flush()
    finally:
        runner.forward_observers.remove(recorder.observe)
    k_amax, v_amax = recorder.amax.cpu().tolist()
    return k_amax, v_amax, recorder.num_tokens


def scales_document(k_amax: list[float], v_amax: list[float], kv_cache_dtype: str, model: str, num_prompts: int,
                    num_tokens: int) -> dict:
    """The --kv-cache-scales file: scale = amax / the FP8 format's max (1.0 for a layer that stored only zeros)."""
    limit = fp8_max(KV_CACHE_DTYPES[kv_cache_dtype])

    def scales(amax: list[float]) -> list[float]:
        return [a / limit if a > 0 else 1.0 for a in amax]

    return {"format": FILE_FORMAT, "kv_cache_dtype": kv_cache_dtype, "k_scale": scales(k_amax),
            "v_scale": scales(v_amax), "k_amax": k_amax, "v_amax": v_amax, "model": model,
            "num_prompts": num_prompts, "num_tokens": num_tokens, "date": time.strftime("%Y-%m-%d")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="HF-format model folder")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--kv-cache-dtype", choices=FP8_CHOICES, default="fp8_e4m3", help="the FP8 format served")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line (default: a built-in set)")
    parser.add_argument("--max-prompt-tokens", type=int, default=2048, help="longest prompt, in tokens")
    return parser


def main(argv: list[str] | None = None) -> dict:
    from pdserve import LLM
    from pdserve.config import ServerArgs, build_arg_parser, exit_on_config_error, parse_server_cli

    parser = build_parser()
    args, engine_flags = parser.parse_known_args(argv)
    engine = exit_on_config_error(parser.prog, lambda: parse_server_cli(
        build_arg_parser(), ["--model-path", args.model_path, *engine_flags])[1])
    if engine.tp_size != 1 or engine.kv_cache_dtype != "auto":
        parser.error("calibrate with --tp-size 1 and the KV cache in the model's dtype (no --kv-cache-dtype "
                     "engine flag: --kv-cache-dtype here names the format the scales are for)")
    prompts = (args.prompts_file.read_text().splitlines() if args.prompts_file else list(DEFAULT_PROMPTS))
    prompts = [p for p in prompts if p.strip()]
    defaults = ServerArgs(model_path=args.model_path)
    overrides = {k: getattr(engine, k) for k in ServerArgs.__dataclass_fields__
                 if k not in ("model_path", "sglang_flag_notes") and getattr(engine, k) != getattr(defaults, k)}
    overrides.update(disable_radix_cache=True, skip_server_warmup=True, disable_overlap_schedule=True)
    llm = LLM(args.model_path, **overrides)
    try:
        k_amax, v_amax, tokens = calibrate(llm, prompts, args.max_prompt_tokens)
    finally:
        llm.shutdown()
    document = scales_document(k_amax, v_amax, args.kv_cache_dtype, args.model_path, len(prompts), tokens)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}: {len(k_amax)} layers, {tokens} tokens of {len(prompts)} prompts; "
          f"K scales {min(document['k_scale']):.3g}..{max(document['k_scale']):.3g}, "
          f"V scales {min(document['v_scale']):.3g}..{max(document['v_scale']):.3g}")
    return document


if __name__ == "__main__":
    main()
