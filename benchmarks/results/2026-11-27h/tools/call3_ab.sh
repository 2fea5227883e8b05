# 2026-11-27 (eighth session) A/B call: one_batch llama-3.1-8b batch 1 x 1k on one machine, PDL on everywhere:
# bf16; FP8 weights on this tree (the FP8 rows kernel prefetching its first weight blocks into L2 before its amax pass)
# and on the tree before the L2 prefetch, e34d0ac (its pdserve/ exported into an untracked ab_base/, overlaid on a copy), interleaved.
export PDSERVE_GPU_MODELS=/tmp/models
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
SITE=$(echo "$PYTHONPATH" | tr ':' '\n' | grep /site$)
big=$(model llama-3.1-8b)
BASE=$(mktemp -d) && cp -r router "$BASE"/ && cp -r ab_base/pdserve "$BASE"/
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --batch-sizes 1 --input-lens 1024 --output-lens 64 --out "$OUT/$name"; }
base() { (cd "$BASE" && PYTHONPATH="$BASE:$BASE/router:$SITE" ob "$@"); }
ob bs1_bf16 100
ob bs1_fp8_fused 240 --quantization fp8
base bs1_fp8_no_prefetch 200 --quantization fp8
ob bs1_fp8_fused_again 100 --quantization fp8
base bs1_fp8_no_prefetch_again 100 --quantization fp8
