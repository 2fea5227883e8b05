# 2026-11-27 (ninth session) call 5: the shipped tree, graphs captured over all 35 batch sizes (the default):
# one_batch llama-3.1-8b batch 64 at 4k, FP8 weights + FP8 KV (scales 1.0) then bf16; batch 1 at 1k, FP8 weights,
# bf16, FP8 again. Tarred into $OUT/call5.tar.gz.
export PDSERVE_GPU_MODELS=/tmp/models
R=$(mktemp -d) && REAL_OUT=$OUT && export OUT=$R
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
big=$(model llama-3.1-8b)
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --output-lens 64 --out "$OUT/$name"; }
ob 4k_fp8 270 --batch-sizes 64 --input-lens 4096 --quantization fp8 --kv-cache-dtype fp8_e4m3
ob 4k_bf16 90 --batch-sizes 64 --input-lens 4096
ob bs1_fp8 80 --batch-sizes 1 --input-lens 1024 --quantization fp8
ob bs1_bf16 60 --batch-sizes 1 --input-lens 1024
ob bs1_fp8_again 60 --batch-sizes 1 --input-lens 1024 --quantization fp8
tar -czf "$REAL_OUT/call5.tar.gz" -C "$OUT" .
