# 2026-11-27 (ninth session) call 2: the FP8 rows tuner's 1-row report on this tree (amax parts) and on the
# preload experiment (ab_preload/: the first weight block read before the PDL wait, exported from branch
# exp-preload), then one_batch llama-3.1-8b batch 1 x 1k, graphs for batch 1 only, FP8 weights, three trees
# interleaved twice: this tree, preload, the session's start ca26aae (ab_base/).
export PDSERVE_GPU_MODELS=/tmp/models
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
SITE=$(echo "$PYTHONPATH" | tr ':' '\n' | grep /site$)
big=$(model llama-3.1-8b)
TOOLS=$PWD/benchmarks/results/2026-11-27i/tools
overlay() { local d; d=$(mktemp -d) && cp -r router "$d"/ && cp -r "$1"/pdserve "$d"/ && echo "$d"; }
BASE=$(overlay ab_base) PRELOAD=$(overlay ab_preload)
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --batch-sizes 1 --input-lens 1024 --output-lens 64 --cuda-graph-max-bs 1 --out "$OUT/$name"; }
in_tree() { local tree=$1; shift; (cd "$tree" && PYTHONPATH="$tree:$tree/router:$SITE" "$@"); }
TAILN=30 step 150 tune_parts python3 "$TOOLS/tune_report.py"
TAILN=30 in_tree "$PRELOAD" step 150 tune_preload python3 "$TOOLS/tune_report.py"
ob bs1_fp8_parts 100 --quantization fp8
in_tree "$PRELOAD" ob bs1_fp8_preload 100 --quantization fp8
in_tree "$BASE" ob bs1_fp8_start 100 --quantization fp8
ob bs1_fp8_parts_again 70 --quantization fp8
in_tree "$PRELOAD" ob bs1_fp8_preload_again 70 --quantization fp8
in_tree "$BASE" ob bs1_fp8_start_again 70 --quantization fp8
ob bs1_bf16 70
