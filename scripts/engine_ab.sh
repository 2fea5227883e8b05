#!/usr/bin/env bash
# The engine before and after a restructuring, interleaved in one lent-GPU call (device tool; carry .whl .deb and
# .before, a `git archive REV pdserve router` of the earlier tree):   bash scripts/engine_ab.sh
# Runs the offline throughput workload (qwen3-0.6b) and one batch of llama-3.1-8b (decode TBT at batch 1 and 64,
# prefill of 8k) on the earlier tree and on this one, twice each in the order before, after, before, after.
set -u
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
site=$SESSION_DIR/site
small=$M/qwen3-0.6b big=$M/llama-3.1-8b
step 120 make_small python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out "$small"
step 120 make_big python3 -m pdserve.tools.make_model --preset llama-3.1-8b --out "$big"
for round in 1 2; do
  for tree in before after; do
    root=$PWD; [ "$tree" = before ] && root=$PWD/.before
    export PYTHONPATH="$root:$root/router:$site"
    TAILN=4 step 120 "offline_${tree}_$round" python3 -m pdserve.bench.offline --model-path "$small" \
      --out "$OUT/offline_${tree}_$round"
    TAILN=8 step 120 "one_batch_${tree}_$round" python3 -m pdserve.bench.one_batch --model-path "$big" \
      --batch-sizes 1 64 --input-lens 1024 --output-lens 32 --out "$OUT/one_batch_${tree}_$round"
  done
done
