#!/usr/bin/env bash
# One lent-GPU session (nvidia-h200-x2, carry .whl .deb): engine GPU tests, PD on two GPUs, benchmarks.
# Logs and JSON land in $OUT. Each step has its own time limit so one slow step cannot eat the others.
set -u
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
python3 -c "import torch, mooncake.engine as m; print(torch.__version__, torch.cuda.device_count(), 'mooncake cuda', m.SUPPORT_CUDA, 'nvlink_intra', getattr(m, 'SUPPORT_INTRA_NVLINK', None))"
step 120 make_model python3 -m pdserve.tools.make_model --preset qwen3-0.6b --out $M/qwen3-0.6b
step 170 gpu_tests python3 -m pytest -q -x -p no:cacheprovider tests/gpu -m gpu
step 170 pd_check python3 scripts/pd_check.py --model-path $M/qwen3-0.6b --out "$OUT" --ttft-lens 1024 4096
step 120 offline python3 -m pdserve.bench.offline --model-path $M/qwen3-0.6b --out "$OUT"
step 60 one_batch python3 -m pdserve.bench.one_batch --model-path $M/qwen3-0.6b --batch-sizes 1 64 --input-lens 1024 --output-lens 64 --out "$OUT"
