# 2026-11-27 (ninth session) call 6, on call 5's warm machine (its Triton cache): one_batch llama-3.1-8b batch 64 at
# 4k, FP8 weights + FP8 KV then bf16, graphs over all batch sizes; then the FP8 rows GPU test (bf16 rows) and the
# PDL graph test. Tarred into $OUT/call6.tar.gz.
export PDSERVE_GPU_MODELS=/tmp/models
R=$(mktemp -d) && REAL_OUT=$OUT && export OUT=$R
source scripts/gpu_env.sh || exit 1
source <(sed -n '/^model()/,/^}/p' scripts/gpu_session.sh)
big=$(model llama-3.1-8b)
ob() { local name=$1 limit=$2; shift 2; TAILN=2 step "$limit" "$name" python3 -m pdserve.bench.one_batch "$@" \
  --model-path "$big" --output-lens 64 --out "$OUT/$name"; }
ob 4k_fp8 240 --batch-sizes 64 --input-lens 4096 --quantization fp8 --kv-cache-dtype fp8_e4m3
ob 4k_bf16 80 --batch-sizes 64 --input-lens 4096
TAILN=30 step 200 gpu_tests python3 -m pytest -x -q --tb=short -m "gpu or fp8_gpu" -p no:cacheprovider \
  "tests/kernels/test_fp8_rows_linear.py::test_fp8_rows_on_gpu_and_tuner_choice[dtype0]" tests/kernels/test_pdl.py
tar -czf "$REAL_OUT/call6.tar.gz" -C "$OUT" .
