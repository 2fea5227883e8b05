# 2026-11-27 (ninth session) call 3: one_batch llama-3.1-8b batch 1 x 1k, FP8 weights, graphs for batch 1 only:
# this tree (the first weight block read before the PDL wait) against the two-block experiment (ab_preload2/,
# exported from branch exp-preload2), interleaved twice; then where this tree's FP8 step goes (step_profile), then
# the GPU tests of the changed kernels. Everything is tarred into $OUT/call3.tar.gz (the file count).
export PDSERVE_GPU_MODELS=/tmp/models
R=$(mktemp -d) && REAL_OUT=$OUT && export OUT=$R
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
SITE=$(echo "$PYTHONPATH" | tr ':' '\n' | grep /site$)
big=$(model llama-3.1-8b)
overlay() { local d; d=$(mktemp -d) && cp -r router "$d"/ && cp -r "$1"/pdserve "$d"/ && echo "$d"; }
TWO=$(overlay ab_preload2)
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --batch-sizes 1 --input-lens 1024 --output-lens 64 --cuda-graph-max-bs 1 --out "$OUT/$name"; }
in_tree() { local tree=$1; shift; (cd "$tree" && PYTHONPATH="$tree:$tree/router:$SITE" "$@"); }
ob bs1_fp8_one_block 100 --quantization fp8
in_tree "$TWO" ob bs1_fp8_two_blocks 100 --quantization fp8
ob bs1_fp8_one_block_again 70 --quantization fp8
in_tree "$TWO" ob bs1_fp8_two_blocks_again 70 --quantization fp8
TAILN=45 step 100 step_profile_bs1_fp8 python3 -m pdserve.bench.step_profile --model-path "$big" --batch-sizes 1 \
  --context-len 1024 --quantization fp8 --cuda-graph-max-bs 1 --out "$OUT/step_profile_bs1_fp8"
TAILN=15 step 170 gpu_tests python3 -m pytest -q -m "gpu or fp8_gpu" -p no:cacheprovider \
  tests/kernels/test_fp8_rows_linear.py tests/kernels/test_pdl.py tests/kernels/test_attention_gpu.py
tar -czf "$REAL_OUT/call3.tar.gz" -C "$OUT" .
