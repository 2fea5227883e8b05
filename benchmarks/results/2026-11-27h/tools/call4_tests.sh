# 2026-11-27 (eighth session) last call: the GPU tests of the final tree's FP8 rows kernel (RMSNorm, SiLU-and-mul,
# rotary + KV store epilogues, tuner), the PDL graph test and the FP8 engine GPU tests (bf16 ids only).
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
TAILN=30 step 420 gpu_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or fp8_gpu" -k "not dtype1 and not float16" \
  tests/kernels/test_fp8_rows_linear.py tests/kernels/test_pdl.py tests/quantization
