"""The FP8 rows tuner's report on llama-3.1-8b's linear shapes (a CUDA GPU): for each row count and kind of rows,
the baseline (quantize + `_scaled_mm`) against the best rows-kernel config, one `REPORT` line each.

    python3 scripts/fp8_tune_report.py --rows 1 2 4 8 [--gated] [--rotary] [--amax-parts] [--debug]

--gated: the gate_up shape also with its SiLU-and-mul epilogue; --rotary: the qkv shape with the rotary and KV
store; --amax-parts: the o and down shapes reading their rows' amax in parts; --debug: the tuner's own lines.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from pdserve.quantization import fp8

QKV, O, GATE_UP, DOWN = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)  # llama-3.1-8b (out, in)
HEADS = (32, 8, 128)  # q heads, kv heads, head size
AMAX_PART_COLUMNS = {O: 512, DOWN: 32}  # one part per kv head's output (o), per SiLU-and-mul block (down)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--rotary", action="store_true")
    parser.add_argument("--amax-parts", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, stream=sys.stdout,
                        format="%(name)s %(message)s")
    for noisy in ("triton", "torch", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    shapes = (QKV, O, GATE_UP, DOWN)
    layers = [fp8.quantize_rows(torch.randn(*shape, device="cuda", dtype=torch.bfloat16)) for shape in shapes]
    weight = dict(zip(shapes, (w for w, _ in layers)))
    epilogues = {"gated": [weight[GATE_UP]] if args.gated else [],
                 "rotary": [(weight[QKV], *HEADS)] if args.rotary else [],
                 "amax_parts": [(weight[s], c) for s, c in AMAX_PART_COLUMNS.items()] if args.amax_parts else []}
    report = fp8.tune_fp8_rows(args.rows, layers, torch.bfloat16, **epilogues)
    for key, (reference, best) in sorted(report.items(), key=lambda kv: (*kv[0][:3], str(kv[0][3:]))):
        print("REPORT", key, f"baseline {reference:.2f} us  best {best:.2f} us")


if __name__ == "__main__":
    main()
