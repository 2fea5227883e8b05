"""Where an FP8 KV cache's per-layer scales come from: the checkpoint's `k_scale`/`v_scale` tensors
(`model.layers.N.self_attn.k_scale`, the older shared `kv_scale`, or compressed-tensors'
`self_attn.k_proj.output_scale`), else a `--kv-cache-scales` file (`pdserve.tools.calibrate_kv_scales` writes
one), else 1.0 for every layer.

The file is JSON: {"format": "pdserve-kv-scales", "kv_cache_dtype": "fp8_e4m3", "k_scale": [per layer],
"v_scale": [per layer], ...}; the calibration command adds the amax it measured and where.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from safetensors import safe_open

from pdserve.mem_cache.kv_quant import KVScales

logger = logging.getLogger(__name__)

FILE_FORMAT = "pdserve-kv-scales"
_SCALE_NAMES = (
    re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$"),
    re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"),  # compressed-tensors
)


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when checkpoint tensor `name` is a KV-cache scale, else None."""
    for pattern in _SCALE_NAMES:
        if match := pattern.search(name):
            return int(match[1]), match[2]
    return None


def checkpoint_kv_scales(files: Iterable[Path], num_layers: int) -> KVScales | None:
    """The scales a checkpoint's safetensors carry (headers and the scale tensors only), None when it has none. A
    tensor of several scales (per head) gives its largest, which covers every head."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if (target := kv_scale_target(name)) is not None:
                    layer, which = target
                    value = float(f.get_tensor(name).float().max())
                    for kv in ("k", "v") if which == "kv" else (which,):
                        found[kv][layer] = value
    if not found["k"] and not found["v"]:
        return None
    missing = [f"{kv}_scale of layer {i}" for kv in ("k", "v") for i in range(num_layers) if i not in found[kv]]
    if missing:
        raise ValueError(f"the checkpoint has KV-cache scales for some layers only: it lacks {', '.join(missing[:4])}")
    return KVScales(tuple(found["k"][i] for i in range(num_layers)), tuple(found["v"][i] for i in range(num_layers)))


def load_scales_file(path: str | Path, num_layers: int, kv_cache_dtype: str) -> KVScales:
    """The scales of a `--kv-cache-scales` file, checked against the model's layers and the server's FP8 format."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--kv-cache-scales {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise ValueError(f"--kv-cache-scales {path}: not a {FILE_FORMAT} file")
    if data.get("kv_cache_dtype") != kv_cache_dtype:
        raise ValueError(f"--kv-cache-scales {path} was calibrated for {data.get('kv_cache_dtype')!r}, the server "
                         f"runs --kv-cache-dtype {kv_cache_dtype}")
    lists = [data.get("k_scale"), data.get("v_scale")]
    if not all(isinstance(x, list) and len(x) == num_layers for x in lists):
        raise ValueError(f"--kv-cache-scales {path}: k_scale and v_scale must list {num_layers} layers")
    try:
        return KVScales(tuple(lists[0]), tuple(lists[1]))
    except ValueError as exc:
        raise ValueError(f"--kv-cache-scales {path}: {exc}") from exc


def resolve_kv_scales(num_layers: int, checkpoint: Iterable[Path], scales_file: str | None,
                      kv_cache_dtype: str) -> KVScales:
    """The checkpoint's scales, else the file's, else 1.0 (each choice logged)."""
    scales = checkpoint_kv_scales(checkpoint, num_layers)
    if scales is not None:
        if scales_file is not None:
            logger.warning("--kv-cache-scales %s is not used: the checkpoint has its own KV-cache scales", scales_file)
        logger.info("FP8 KV cache (%s): the checkpoint's per-layer K and V scales", kv_cache_dtype)
        return scales
    if scales_file is not None:
        logger.info("FP8 KV cache (%s): per-layer K and V scales of %s", kv_cache_dtype, scales_file)
        return load_scales_file(scales_file, num_layers, kv_cache_dtype)
    logger.warning("FP8 KV cache (%s) with every scale 1.0: the checkpoint has no k_scale/v_scale and no "
                   "--kv-cache-scales was given (python -m pdserve.tools.calibrate_kv_scales writes one)",
                   kv_cache_dtype)
    return KVScales.ones(num_layers)
