#!/usr/bin/env bash
# Third lent-GPU session (nvidia-h200-x2, carry .whl .deb): figures after overlap scheduling and the chunk-push fix.
set -u
source scripts/gpu_env.sh || exit 1
step 40 make_06b python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out $M/qwen3-0.6b
step 60 make_8b python3 -m pdserve.tools.make_model --preset llama-3.1-8b --out $M/llama-3.1-8b
step 45 offline_overlap python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT/overlap"
step 45 offline_sync python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT/sync" --disable-overlap-schedule
step 45 one_batch_06b python3 -m pdserve.bench.one_batch --model-path $M/qwen3-0.6b --batch-sizes 1 64 --input-lens 1024 --output-lens 64 --out "$OUT/b06"
step 60 one_batch_8b python3 -m pdserve.bench.one_batch --model-path $M/llama-3.1-8b --batch-sizes 1 --input-lens 1024 8192 --output-lens 32 --out "$OUT/b8"
TAILN=40 step 80 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu -m gpu
TAILN=12 step 100 pd_nccl_8b python3 scripts/pd_check.py --model-path $M/llama-3.1-8b --backends nccl mooncake --out "$OUT" --ttft-lens 4096
