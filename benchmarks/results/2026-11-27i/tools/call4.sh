# 2026-11-27 (ninth session) call 4: the FP8 rows GPU test (bf16 rows) with its failure text (call 3 saw it fail,
# killed before the report); then one_batch llama-3.1-8b batch 1 x 1k, graphs for batch 1 only: FP8 weights, bf16,
# FP8 again, on this tree. Tarred into $OUT/call4.tar.gz.
export PDSERVE_GPU_MODELS=/tmp/models
R=$(mktemp -d) && REAL_OUT=$OUT && export OUT=$R
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
big=$(model llama-3.1-8b)
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --batch-sizes 1 --input-lens 1024 --output-lens 64 --cuda-graph-max-bs 1 --out "$OUT/$name"; }
TAILN=60 step 220 gpu_test_fp8_rows python3 -m pytest -x -q --tb=short -m "gpu or fp8_gpu" -p no:cacheprovider \
  "tests/kernels/test_fp8_rows_linear.py::test_fp8_rows_on_gpu_and_tuner_choice[dtype0]"
ob bs1_fp8 150 --quantization fp8
ob bs1_bf16 70
ob bs1_fp8_again 70 --quantization fp8
tar -czf "$REAL_OUT/call4.tar.gz" -C "$OUT" .
