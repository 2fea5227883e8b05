"""What a decoder layer hands its attention backend: q, k, v read in place from the qkv projection's output,
and their K/V already in the pool at the backend's slots (one fused norm + rotary + store, no copies)."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.engine.model_runner import ModelRunner
from pdserve.forward_batch import ForwardMode, build_forward_batch
from pdserve.models.model_config import ModelConfig

PAGE_SIZE = 4


def recording_backend(runner: ModelRunner, monkeypatch) -> list[dict]:
    """Wrap the backend's forward: record, per layer, the views and whether the pool held them at call time."""
    calls, attend = [], runner.backend.forward

    def forward(q, k, v, layer_id, pool, scaling):
        loc = runner.backend.out_cache_loc
        calls.append(dict(
            storages={t.untyped_storage().data_ptr() for t in (q, k, v)},
            offsets=(q.storage_offset(), k.storage_offset(), v.storage_offset()),
            row_strides={q.stride(0), k.stride(0), v.stride(0)},
            stored=torch.equal(pool.k_buffer(layer_id)[loc], k) and torch.equal(pool.v_buffer(layer_id)[loc], v),
        ))
        return attend(q, k, v, layer_id, pool, scaling)

    monkeypatch.setattr(runner.backend, "forward", forward)
    return calls


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
def test_layers_attend_over_in_place_views_already_stored(tiny_models, preset, monkeypatch):
    path = tiny_models[preset]
    cfg = ModelConfig.from_path(path)
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="float32", page_size=PAGE_SIZE,
                                    max_total_tokens=64, attention_backend="torch_native"), cfg)
    calls = recording_backend(runner, monkeypatch)
    prompt, pages = list(range(3, 13)), [5, 2, 7]  # 10 tokens on non-contiguous pages
    slots = [pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(len(prompt))]
    batch = build_forward_batch(ForwardMode.EXTEND, prompt, list(range(len(prompt))), slots, [0], [len(prompt)],
                                [pages], [len(prompt) - 1], PAGE_SIZE, runner.device)
    runner.forward(batch)

    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert len(calls) == cfg.num_layers
    for call in calls:
        assert len(call["storages"]) == 1 and call["offsets"] == (0, q_size, q_size + kv_size)
        assert call["row_strides"] == {q_size + 2 * kv_size}
        assert call["stored"]
