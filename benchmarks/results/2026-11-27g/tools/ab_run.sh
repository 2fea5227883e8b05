# temporary A/B driver (not committed)
export PDSERVE_GPU_MODELS=/tmp/models
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
SITE=$(echo "$PYTHONPATH" | tr ':' '\n' | grep /site$)
big=$M/llama-3.1-8b
[ -d "$big" ] || step 150 make_llama python3 -m pdserve.tools.make_model --preset llama-3.1-8b --out "$big"
TAILN=3 step 240 tune_report python3 tune_report.py
grep -h "REPORT\|faster than\|does not run" $OUT/tune_report.log | cut -c1-400
ob() { local name=$1; shift; TAILN=3 step 200 "$name" "$@" --model-path "$big" --batch-sizes 1 --input-lens 1024 --output-lens 64 --out "$OUT/$name"; }
ob bs1_bf16 python3 -m pdserve.bench.one_batch
ob bs1_fp8_fused python3 -m pdserve.bench.one_batch --quantization fp8
BASE=$(mktemp -d) && cp -r pdserve router "$BASE"/ && cp -r ab_base/pdserve "$BASE"/ && rm "$BASE"/pdserve/kernels/pending_rows.py
(cd "$BASE" && PYTHONPATH="$BASE:$BASE/router:$SITE" ob bs1_fp8_base python3 -m pdserve.bench.one_batch --quantization fp8)
ob bs1_fp8_fused_again python3 -m pdserve.bench.one_batch --quantization fp8
