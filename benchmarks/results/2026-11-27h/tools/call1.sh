# 2026-11-27 (eighth session) call: GPU tests of the PDL graph and the FP8 rows kernel (gated epilogue included),
# then one_batch llama-3.1-8b batch 1 x 1k, bf16 and FP8 weights, PDL on, each twice, interleaved; the tuner report.
export PDSERVE_GPU_MODELS=/tmp/models
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
source <(sed -n '/^model()/,/^}/p;/^bf16_then_fp8()/,/^}/p' scripts/gpu_session.sh)
TAILN=8 step 300 kernel_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or fp8_gpu" -k "dtype0 or pdl" \
  tests/kernels/test_fp8_rows_linear.py tests/kernels/test_pdl.py
model llama-3.1-8b > /dev/null
for round in 1 2; do
  bf16_then_fp8 "bs1_round$round" 300 "--quantization fp8" --batch-sizes 1 --input-lens 1024 --output-lens 64
done
TAILN=40 step 200 tune_report python3 benchmarks/results/2026-11-27h/tools/tune_report.py
