#!/usr/bin/env bash
# Sixth lent-GPU run (nvidia-h200 or -x2, carry .whl .deb): decode host time after the persistent InputBatch and
# sampled-batch overlap, the seeds' offline workload overlapped vs synchronous, and the router bench on an idle host.
set -u
source scripts/gpu_env.sh || exit 1
TAILN=12
step 40 make_06b python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out $M/qwen3-0.6b
step 60 one_batch_06b python3 -m pdserve.bench.one_batch --model-path $M/qwen3-0.6b --batch-sizes 1 64 --input-lens 1024 --output-lens 64 --out "$OUT/b06"
step 60 decode_host_sampled python3 -m pdserve.bench.decode_host --model-path $M/qwen3-0.6b --batch-size 64 --input-len 1024 --steps 64 --temperature 0.6 --repeats 3 --out "$OUT/dh_sampled.json"
step 60 decode_host_greedy python3 -m pdserve.bench.decode_host --model-path $M/qwen3-0.6b --batch-size 64 --input-len 1024 --steps 64 --temperature 0 --repeats 3 --out "$OUT/dh_greedy.json"
step 60 offline_overlap python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT/overlap"
step 60 offline_sync python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT/sync" --disable-overlap-schedule
step 150 router_bench python3 -m pdserve_router.bench --router-cpu 0 --stub-cpu 2-9 --client-procs 4 --per-stream 20 --json "$OUT/router.json"
