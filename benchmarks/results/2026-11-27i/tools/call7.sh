# 2026-11-27 (ninth session) call 7, the final tree (654eb43), graphs over all batch sizes: one_batch llama-3.1-8b
# batch 64 at 4k, FP8 weights + FP8 KV (scales 1.0), then bf16 (results written straight into $OUT).
export PDSERVE_GPU_MODELS=/tmp/models
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
big=$(model llama-3.1-8b)
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --output-lens 64 --out "$OUT/$name"; }
ob 4k_fp8 390 --batch-sizes 64 --input-lens 4096 --quantization fp8 --kv-cache-dtype fp8_e4m3
ob 4k_bf16 90 --batch-sizes 64 --input-lens 4096
