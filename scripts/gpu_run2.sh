#!/usr/bin/env bash
# Second lent-GPU session (nvidia-h200-x2, carry .whl .deb): llama-3.1-8b figures, KV handoff, re-run of offline.
set -u
source scripts/gpu_env.sh || exit 1
step 100 make_8b python3 -m pdserve.tools.make_model --preset llama-3.1-8b --out $M/llama-3.1-8b
step 40 make_06b python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out $M/qwen3-0.6b
CUDA_LAUNCH_BLOCKING=1 TAILN=40 step 60 graph_test python3 -m pytest -q -x -p no:cacheprovider tests/gpu -m gpu -k cuda_graph
step 70 kv_transfer python3 -m pdserve.bench.kv_transfer --backends mooncake,nccl --sizes-mib 256 --tokens 1024,4096,16384 --page-sizes 16 --patterns contiguous --iters 5 --timeout 30
TAILN=30 step 150 pd_check_8b python3 scripts/pd_check.py --model-path $M/llama-3.1-8b --out "$OUT" --ttft-lens 1024 4096 16384
step 80 one_batch_8b python3 -m pdserve.bench.one_batch --model-path $M/llama-3.1-8b --batch-sizes 1 --input-lens 1024 8192 --output-lens 32 --out "$OUT/8b"
step 60 offline python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT"
