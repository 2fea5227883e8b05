"""The kernel tuning cache (issue 38) on CPU: a stored choice comes back for the same device key and shape; another
GPU name, driver, Triton version or shape misses it; a corrupt or foreign file is ignored with a warning and
rewritten; a value that names no candidate config is ignored; `none` writes nothing; and the tuner looks the cache
up before timing, so a warm cache skips the timing."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.config import ServerArgs, build_arg_parser
from pdserve.kernels import skinny, tuning_cache

KEY = {"gpu": "NVIDIA H200", "capability": "9.0", "driver": "550.54.15", "cuda": "12.8", "torch": "2.9.0",
       "triton": "3.6.0", "tuner": str(tuning_cache.TUNER_VERSION)}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The cache on in tmp_path, with KEY as the device key of every device; TRITON_CACHE_DIR restored after."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(tuning_cache, "device_key", lambda device: dict(KEY))
    directory = tuning_cache.configure(str(tmp_path / "tuning"))
    yield directory
    os.environ.pop("TRITON_CACHE_DIR", None)
    monkeypatch.setattr(tuning_cache, "_directory", None)
    tuning_cache._caches.clear()


def test_resolve_dir_flag_env_xdg_and_off(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert tuning_cache.resolve_dir("/x/y", {tuning_cache.ENV: "/env"}) == tuning_cache.Path("/x/y")
    assert tuning_cache.resolve_dir(None, {tuning_cache.ENV: "/env"}) == tuning_cache.Path("/env")
    assert tuning_cache.resolve_dir(None, {"XDG_CACHE_HOME": "/xdg"}) == tuning_cache.Path("/xdg/pdserve/tuning")
    assert tuning_cache.resolve_dir(None, env).parts[-3:] == (".cache", "pdserve", "tuning")
    for off in ("none", "None", "", " "):
        assert tuning_cache.resolve_dir(off, {tuning_cache.ENV: "/env"}) is None
        assert tuning_cache.resolve_dir(None, {tuning_cache.ENV: off}) is None


def test_flag_parses_and_defaults_to_unset():
    args = build_arg_parser().parse_args(["--model-path", "m", "--kernel-tuning-cache-dir", "/tmp/t"])
    assert args.kernel_tuning_cache_dir == "/tmp/t"
    assert ServerArgs(model_path="m").kernel_tuning_cache_dir is None


def test_configure_points_triton_cache_under_the_directory(cache_dir, monkeypatch):
    assert os.environ["TRITON_CACHE_DIR"] == str(cache_dir / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/user/choice")  # the user's own setting stays
    tuning_cache.configure(str(cache_dir))
    assert os.environ["TRITON_CACHE_DIR"] == "/user/choice"


def test_round_trip_and_key_invalidation(cache_dir):
    cache = tuning_cache.TuningCache(cache_dir, KEY)
    assert cache.get("e") is None
    cache.put("e", {"config": [1, 2]})
    cache.save()
    files = list(cache_dir.glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("NVIDIA-H200-")
    assert not list(cache_dir.glob("*.tmp"))  # written through a temporary file, renamed
    assert tuning_cache.TuningCache(cache_dir, KEY).get("e") == {"config": [1, 2]}  # a new process
    assert tuning_cache.TuningCache(cache_dir, KEY).get("other shape") is None
    for field, other in (("gpu", "NVIDIA H100 80GB HBM3"), ("driver", "560.1"), ("triton", "3.7.0"),
                         ("cuda", "13.0"), ("tuner", "999")):
        assert tuning_cache.TuningCache(cache_dir, {**KEY, field: other}).get("e") is None, field


def test_concurrent_writers_merge(cache_dir):
    a, b = tuning_cache.TuningCache(cache_dir, KEY), tuning_cache.TuningCache(cache_dir, KEY)
    a.get("x"), b.get("x")  # both loaded the empty file
    a.put("a", 1)
    a.save()
    b.put("b", 2)
    b.save()
    fresh = tuning_cache.TuningCache(cache_dir, KEY)
    assert fresh.get("a") == 1 and fresh.get("b") == 2


def test_entries_are_bounded(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning_cache, "MAX_ENTRIES", 3)
    cache = tuning_cache.TuningCache(cache_dir, KEY)
    for i in range(5):
        cache.put(f"e{i}", i)
    cache.save()
    fresh = tuning_cache.TuningCache(cache_dir, KEY)
    assert [fresh.get(f"e{i}") for i in range(5)] == [None, None, 2, 3, 4]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"schema": "other", "key": {}, "entries": {}}',
                                     "\x00\xff garbage", None])
def test_corrupt_file_is_ignored_with_a_warning_and_rewritten(cache_dir, caplog, content):
    cache = tuning_cache.TuningCache(cache_dir, KEY)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if content is None:  # well-formed, but another device key's entries under this file's name
        cache.path.write_text(json.dumps({"schema": tuning_cache.SCHEMA, "key": {**KEY, "gpu": "other"},
                                          "entries": {"e": 1}}))
    else:
        cache.path.write_bytes(content.encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.tuning_cache"):
        assert cache.get("e") is None
        assert cache.get("f") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ignoring" in warnings[0].getMessage()
    cache.put("e", 7)
    cache.save()
    data = json.loads(cache.path.read_text())
    assert data["schema"] == tuning_cache.SCHEMA and data["key"] == KEY and data["entries"] == {"e": 7}


def test_unwritable_directory_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = tuning_cache.TuningCache(blocker / "sub", KEY)  # a directory under a file cannot be made
    cache.put("e", 1)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.tuning_cache"):
        cache.save()
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    assert cache.get("e") == 1  # still served from memory


# the tuner on CPU: `_tunable` lets CPU weights through, `_graph_us` counts its calls instead of timing on a GPU
@pytest.fixture
def fake_timing(monkeypatch):
    calls = []

    def graph_us(fn, calls_=10, reps=7):
        calls.append(fn)
        return 10.0 if len(calls) % (len(skinny.CANDIDATES) + 1) == 1 else 5.0 + len(calls) % 3  # baseline first

    monkeypatch.setattr(skinny, "_tunable", lambda w: w.dim() == 2)
    monkeypatch.setattr(skinny, "_graph_us", graph_us)
    monkeypatch.setattr(skinny, "cold_weights", lambda w: lambda: w)
    monkeypatch.setattr(skinny, "_choice", {})
    return calls


def tune(weights, rows=(1, 2)):
    return skinny.SkinnyTuner(rows).tune(weights, baseline=F.linear, candidate=lambda x, w, cfg: F.linear(x, w))


def test_tuner_stores_then_a_second_start_skips_the_timing(cache_dir, fake_timing, caplog):
    w = torch.randn(48, 32)
    first = tune([w])
    timed = len(fake_timing)
    assert timed == 2 * (1 + len(skinny.CANDIDATES))  # 2 row counts x (baseline + each candidate)
    chosen = dict(skinny._choice)
    assert all(cfg in skinny.CANDIDATES for cfg in chosen.values())
    skinny._choice.clear()
    tuning_cache._caches.clear()  # a new process: the choices come from the file
    with caplog.at_level(logging.INFO, logger="pdserve.kernels.skinny"):
        second = tune([w])
    assert len(fake_timing) == timed  # nothing timed
    assert skinny._choice == chosen and second == first
    assert any("2 of 2 from the tuning cache" in r.getMessage() for r in caplog.records)
    tune([torch.randn(64, 32)])  # another shape misses
    assert len(fake_timing) == 2 * timed
    tune([w], rows=(1, 2, 3))  # another row count misses; the cached two do not
    assert len(fake_timing) == 2 * timed + 1 + len(skinny.CANDIDATES)


def test_tuner_misses_on_another_gpu_or_triton(cache_dir, fake_timing, monkeypatch):
    w = torch.randn(48, 32)
    tune([w])
    timed = len(fake_timing)
    for field, other in (("gpu", "NVIDIA H100 80GB HBM3"), ("triton", "3.7.0"), ("driver", "560.1")):
        monkeypatch.setattr(tuning_cache, "device_key", lambda device, f=field, o=other: {**KEY, f: o})
        before = len(fake_timing)
        tune([w])
        assert len(fake_timing) == before + timed, field


def test_tuner_ignores_entries_naming_no_candidate(cache_dir, fake_timing):
    w = torch.randn(48, 32)
    tune([w], rows=(1,))
    per_tune = len(fake_timing)
    path = next(cache_dir.glob("*.json"))
    data = json.loads(path.read_text())
    for bad in ({"block_n": 4096, "block_k": 1, "num_warps": 64, "num_stages": 99}, "SkinnyConfig(32, 256, 4, 4)",
                [32, 256, 4, 4], {"block_n": 32}):
        for value in data["entries"].values():
            value["config"] = bad
        path.write_text(json.dumps(data))
        tuning_cache._caches.clear()
        skinny._choice.clear()
        before = len(fake_timing)
        tune([w], rows=(1,))
        assert len(fake_timing) == before + per_tune, bad  # timed again, not served the bad value
        assert all(cfg is None or cfg in skinny.CANDIDATES for cfg in skinny._choice.values())


def test_tuner_with_the_cache_off_writes_nothing(tmp_path, fake_timing, monkeypatch):
    monkeypatch.setenv(tuning_cache.ENV, str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    try:
        assert tuning_cache.configure("none") is None
        assert "TRITON_CACHE_DIR" not in os.environ
        w = torch.randn(48, 32)
        tune([w])
        timed = len(fake_timing)
        tune([w])
        assert len(fake_timing) == 2 * timed  # no cache: timed each time
        assert list(tmp_path.rglob("*")) == []
    finally:
        monkeypatch.setattr(tuning_cache, "_directory", None)


def test_fp8_rows_configs_round_trip(cache_dir):
    """The FP8 tuner's configs (with a bool and split_k) come back as the same candidate objects."""
    from pdserve.quantization.fp8 import FP8_MAX_ROWS, fp8_candidates

    tuner = skinny.SkinnyTuner([1, 64], "FP8 rows linear", fp8_candidates, FP8_MAX_ROWS)
    cache = tuning_cache.for_device("cpu")
    for m in (1, 64):
        for cfg in fp8_candidates(m):
            entry = tuner._entry(m, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16, torch.bfloat16)
            cache.put(entry, json.loads(json.dumps({"config": skinny.dataclasses.asdict(cfg), "baseline_us": 2.0,
                                                    "best_us": 1.0})))
            assert tuner._cached(cache, entry, m) == (cfg, (2.0, 1.0))
    in_kernel = next(c for c in fp8_candidates(1) if c.quantize_in_kernel)
    entry = tuner._entry(64, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16, torch.bfloat16)
    cache.put(entry, {"config": skinny.dataclasses.asdict(in_kernel), "baseline_us": 2.0, "best_us": 1.0})
    assert tuner._cached(cache, entry, 64) is None  # a config valid at 1 row only is not served at 64
