"""The FP8 rows tuner's report on llama-3.1-8b shapes at 1-8 rows, every kind of rows (the gate_up shape also with its SiLU-and-mul)"""
import logging
import sys

import torch

logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(message)s")
for noisy in ("triton", "torch", "matplotlib"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
from pdserve.quantization import fp8

layers = []
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    w_q, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    layers.append((w_q, scale))
report = fp8.tune_fp8_rows([1, 2, 4, 8], layers, torch.bfloat16, gated=[layers[2][0]])
for key, (reference, best) in sorted(report.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], str(kv[0][3:]))):
    print("REPORT", key, f"baseline {reference:.2f} us  best {best:.2f} us")
