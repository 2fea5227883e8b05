"""The FP8 checkpoint formats the quantization tests write with make_model."""

from __future__ import annotations

from pdserve.quantization.formats import Fp8Checkpoint
from pdserve.tools.make_model import make_model

FORMATS = {
    "fp8-channel": Fp8Checkpoint("fp8", "channel"),
    "fp8-tensor-static": Fp8Checkpoint("fp8", "tensor", static_activations=True),
    "fp8-block": Fp8Checkpoint("fp8", "block"),
    "ct-channel": Fp8Checkpoint("compressed-tensors", "channel"),
    "ct-tensor-static": Fp8Checkpoint("compressed-tensors", "tensor", static_activations=True),
}


class Fp8Models(dict):
    """Folder of each (preset, format in FORMATS) FP8 checkpoint, seed 0 (the same weights as `tiny_models`),
    built once, on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, key: tuple[str, str]) -> str:
        preset, fmt = key
        self[key] = str(make_model(preset, self.root / f"{preset}-{fmt}", seed=0, fp8=FORMATS[fmt]))
        return self[key]

