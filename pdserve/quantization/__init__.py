"""FP8 (E4M3) weights: the GEMM with per-token activation scales (`pdserve/quantization/fp8.py`) and the
checkpoint formats that hold them (`pdserve/quantization/formats.py`)."""
