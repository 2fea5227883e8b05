"""The FP8 rows tuner's report on llama-3.1-8b shapes at 1 row, every kind of rows and epilogue (rows with their amax
in parts for o and down, where the tree has them)."""
import inspect
import logging
import sys

import torch

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
for noisy in ("triton", "torch", "matplotlib"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
from pdserve.quantization import fp8

layers = []
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    w_q, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    layers.append((w_q, scale))
kwargs = dict(gated=[layers[2][0]], rotary=[(layers[0][0], 32, 8, 128)])
if "amax_parts" in inspect.signature(fp8.tune_fp8_rows).parameters:
    kwargs["amax_parts"] = [(layers[1][0], 512), (layers[3][0], 32)]
report = fp8.tune_fp8_rows([1], layers, torch.bfloat16, **kwargs)
for key, (reference, best) in sorted(report.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], str(kv[0][3:]))):
    print("REPORT", key, f"baseline {reference:.2f} us  best {best:.2f} us")
