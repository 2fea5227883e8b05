"""Experiment of call 5 (kept with its results; needs the PDL tree of tools/pdl_experiment.patch): greedy tokens with PDL off, releasing after the wait, and small kernels releasing first
(eager, so each mode's launches run as set), qwen3-0.6b with FP8 weights + FP8 KV (the qk-norm kernel too)."""
import os, sys
from pdserve import LLM, SamplingParams
from pdserve.kernels import pdl
llm = LLM(sys.argv[1], quantization="fp8", kv_cache_dtype="fp8_e4m3", disable_cuda_graph=True,
          skip_server_warmup=True)
prompts = [[1 + (i * 7919 + j * 104729) % 1000 for j in range(300 + 170 * i)] for i in range(6)]
sp = SamplingParams(temperature=0, max_tokens=48)
outs = {}
for mode in ("1", "0", "late", "1"):
    os.environ["PDSERVE_PDL"] = mode
    pdl._mode.cache_clear()
    outs.setdefault(mode, []).append([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    print(mode, outs[mode][-1][0][:8], flush=True)
runs = [r for rs in outs.values() for r in rs]
print("PDL token identity over", len(runs), "runs:", all(r == runs[0] for r in runs))
llm.shutdown()
