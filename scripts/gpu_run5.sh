#!/usr/bin/env bash
# Fifth lent-GPU session (nvidia-h200-x2, carry .whl .deb): PD TTFT after the wake-up fd, layer-wise KV push and
# kv_done sent by the KV writer; greedy identity PD vs colocated on both backends.
set -u
source scripts/gpu_env.sh || exit 1
TAILN=40
step 40 make_06b python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out $M/qwen3-0.6b
step 60 make_8b python3 -m pdserve.tools.make_model --preset llama-3.1-8b --out $M/llama-3.1-8b
step 150 pd_06b python3 scripts/pd_check.py --model-path $M/qwen3-0.6b --backends mooncake nccl --ttft-lens 1024 4096 --out "$OUT/pd06"
step 330 pd_8b python3 scripts/pd_check.py --model-path $M/llama-3.1-8b --backends mooncake nccl --chunk-push-too --out "$OUT/pd8"
