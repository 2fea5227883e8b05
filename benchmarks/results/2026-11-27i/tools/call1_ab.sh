# 2026-11-27 (ninth session) A/B call: one_batch llama-3.1-8b batch 1 x 1k on one machine, PDL on everywhere, graphs
# for batch 1 only (--cuda-graph-max-bs 1: the tuner compiles for one row count); bf16 on this tree; FP8 weights on this
# tree (the down and o projections' kernels reading the amax parts the gated kernel and the decode attention leave)
# and on the session's start tree ca26aae (its pdserve/ exported into an untracked ab_base/, overlaid on a copy),
# interleaved, twice each.
export PDSERVE_GPU_MODELS=/tmp/models
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
SITE=$(echo "$PYTHONPATH" | tr ':' '\n' | grep /site$)
big=$(model llama-3.1-8b)
BASE=$(mktemp -d) && cp -r router "$BASE"/ && cp -r ab_base/pdserve "$BASE"/
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --batch-sizes 1 --input-lens 1024 --output-lens 64 --cuda-graph-max-bs 1 --out "$OUT/$name"; }
base() { (cd "$BASE" && PYTHONPATH="$BASE:$BASE/router:$SITE" ob "$@"); }
ob bs1_bf16 100
ob bs1_fp8_parts 200 --quantization fp8
base bs1_fp8_start 200 --quantization fp8
ob bs1_fp8_parts_again 90 --quantization fp8
base bs1_fp8_start_again 90 --quantization fp8
grep -h "amax parts\|SiLU-and-mul tuned\|rows linear tuned" "$OUT"/bs1_fp8_parts.log | cut -c1-400
