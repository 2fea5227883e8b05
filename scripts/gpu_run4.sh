#!/usr/bin/env bash
# Fourth lent-GPU session (nvidia-h200-x2, carry .whl .deb): overlap scheduling with pinned host staging.
set -u
source scripts/gpu_env.sh || exit 1
step 30 make_06b python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out $M/qwen3-0.6b
step 40 offline_overlap python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT"
step 40 one_batch_06b python3 -m pdserve.bench.one_batch --model-path $M/qwen3-0.6b --batch-sizes 1 64 --input-lens 1024 --output-lens 64 --out "$OUT/b06"
step 30 make_8b python3 -m pdserve.tools.make_model --preset llama-3.1-8b --out $M/llama-3.1-8b
step 50 one_batch_8b python3 -m pdserve.bench.one_batch --model-path $M/llama-3.1-8b --batch-sizes 1 --input-lens 1024 --output-lens 32 --out "$OUT/b8"
