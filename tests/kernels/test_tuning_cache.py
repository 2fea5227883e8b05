"""The kernel tuning cache (issue 38) on CPU: a stored choice comes back for the same device key and shape; another
GPU name, driver, Triton version or shape misses it; a corrupt or foreign file is ignored with a warning and
rewritten; a value that names no candidate config is ignored; `none` writes nothing; and the tuner looks the cache
up before timing, so a warm cache skips the timing. The shipped tables: exported from a filled cache, used where
the cache has no entry (across drivers and Triton versions, for the same GPU name, capability and tuner version,
where the config runs), never over the cache's own entry; a corrupt table is ignored with a warning."""

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


@pytest.fixture(autouse=True)
def no_package_tables(tmp_path, monkeypatch):
    """The shipped tables read from an empty folder of this test's (never the package's), none loaded before."""
    tables = tmp_path / "tables"
    monkeypatch.setenv(tuning_cache.TABLES_ENV, str(tables))
    monkeypatch.setattr(tuning_cache, "_tables", {})
    return tables


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
            assert tuner._stored(cache.get(entry), m) == (cfg, (2.0, 1.0))
    in_kernel = next(c for c in fp8_candidates(1) if c.quantize_in_kernel)
    entry = tuner._entry(64, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16, torch.bfloat16)
    cache.put(entry, {"config": skinny.dataclasses.asdict(in_kernel), "baseline_us": 2.0, "best_us": 1.0})
    assert tuner._stored(cache.get(entry), 64) is None  # a config valid at 1 row only is not served at 64


# the shipped tables
def test_table_names_and_folder(tmp_path):
    assert tuning_cache.table_name("NVIDIA H200") == "nvidia-h200.json"
    assert tuning_cache.table_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    assert tuning_cache.tables_dir({}) == tuning_cache.PACKAGE_TABLES
    assert tuning_cache.PACKAGE_TABLES.is_dir()  # shipped with the package (pyproject.toml package-data)
    assert tuning_cache.tables_dir({tuning_cache.TABLES_ENV: str(tmp_path)}) == tmp_path
    assert tuning_cache.tables_dir({tuning_cache.TABLES_ENV: "none"}) is None


def shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, weights, rows=(1, 2)) -> dict:
    """Tunes weights into the cache, exports it as the shipped tables, then empties the cache as on a fresh
    machine (another directory, a new process); returns the choices the timing made."""
    from pdserve.tools import export_tuned_table

    tune(weights, rows)
    assert export_tuned_table.main([str(cache_dir), "--out", str(no_package_tables)]) == 0
    chosen = dict(skinny._choice)
    skinny._choice.clear()
    tuning_cache.configure(str(tmp_path / "fresh"))
    monkeypatch.setattr(tuning_cache, "_tables", {})
    return chosen


def test_shipped_entry_used_when_the_cache_is_empty(tmp_path, cache_dir, no_package_tables, fake_timing, caplog,
                                                    monkeypatch):
    w = torch.randn(48, 32)
    chosen = shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, [w])
    assert (no_package_tables / "nvidia-h200.json").is_file()
    timed = len(fake_timing)
    ran = []
    with caplog.at_level(logging.INFO, logger="pdserve.kernels.skinny"):
        skinny.SkinnyTuner((1, 2)).tune([w], candidate=lambda x, w_, cfg: ran.append(cfg) or F.linear(x, w_))
    assert len(fake_timing) == timed and skinny._choice == chosen  # nothing timed, the same choices
    assert ran == [cfg for cfg in chosen.values() if cfg is not None]  # each shipped config run once first
    assert any("0 of 2 from the tuning cache, 2 from the shipped table" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "fresh").glob("*.json"))  # shipped choices are not copied into the cache
    tuning_cache.configure("none")  # the cache off: the table still answers
    skinny._choice.clear()
    tune([w])
    assert len(fake_timing) == timed and skinny._choice == chosen
    tune([torch.randn(64, 32)])  # a shape the table lacks is timed
    assert len(fake_timing) > timed


def test_the_cache_overrides_the_shipped_table(tmp_path, cache_dir, no_package_tables, fake_timing, monkeypatch):
    w = torch.randn(48, 32)
    shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, [w], rows=(1,))
    cache = tuning_cache.for_device("cpu")
    tuner = skinny.SkinnyTuner((1,))
    entry = tuner._entry(1, 48, 32, w.dtype, w.dtype, w.dtype)
    table_choice = tuner._stored(tuning_cache.shipped_entries("cpu")[entry], 1)[0]
    own = next(cfg for cfg in skinny.CANDIDATES if cfg != table_choice)
    cache.put(entry, {"config": skinny.dataclasses.asdict(own), "baseline_us": 9.0, "best_us": 3.0})
    cache.save()
    tuning_cache._caches.clear()
    timed = len(fake_timing)
    tune([w], rows=(1,))
    assert len(fake_timing) == timed and skinny._choice[(1, 48, 32, w.dtype, w.dtype, None)] == own


@pytest.mark.parametrize("field, other, used", [("gpu", "NVIDIA H100 80GB HBM3", False), ("capability", "8.0", False),
                                                ("tuner", "999", False), ("driver", "999.1", True),
                                                ("triton", "9.9.9", True), ("torch", "9.0", True),
                                                ("cuda", "99.0", True)])
def test_a_shipped_table_matches_gpu_capability_and_tuner_only(tmp_path, cache_dir, no_package_tables, fake_timing,
                                                                monkeypatch, field, other, used):
    w = torch.randn(48, 32)
    chosen = shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, [w])
    monkeypatch.setattr(tuning_cache, "device_key", lambda device: {**KEY, field: other})
    timed = len(fake_timing)
    tune([w])
    assert (len(fake_timing) == timed) == used, field
    assert not used or skinny._choice == chosen


def test_a_table_naming_another_gpu_is_ignored_with_a_warning(tmp_path, cache_dir, no_package_tables, fake_timing,
                                                              monkeypatch, caplog):
    w = torch.randn(48, 32)
    shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, [w])
    path = no_package_tables / "nvidia-h200.json"
    path.write_text(path.read_text().replace('"NVIDIA H200"', '"NVIDIA H200 NVL"'))  # H200's file, another GPU's
    timed = len(fake_timing)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.tuning_cache"):
        tune([w])
    assert len(fake_timing) > timed
    assert [r.getMessage() for r in caplog.records if "shipped table" in r.getMessage() and "another gpu" in
            r.getMessage()]


@pytest.mark.parametrize("content", ["{not json", "[]", '{"schema": "pdserve-tuning-cache/1", "entries": {}}',
                                     "\x00\xff", "entries"])
def test_a_corrupt_shipped_table_is_ignored_with_a_warning(tmp_path, cache_dir, no_package_tables, fake_timing,
                                                           monkeypatch, caplog, content):
    w = torch.randn(48, 32)
    shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, [w])
    path = no_package_tables / "nvidia-h200.json"
    if content == "entries":  # well-formed, but each entry names no candidate config
        data = json.loads(path.read_text())
        data["entries"] = {k: {"config": {"block_n": 7}} for k in data["entries"]}
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(content.encode("latin-1"))
    before = path.read_bytes()
    timed = len(fake_timing)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.tuning_cache"):
        tune([w])
        tune([w], rows=(3,))  # read once per process: one warning
    assert len(fake_timing) == timed + 3 * (1 + len(skinny.CANDIDATES))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (content != "entries")
    assert path.read_bytes() == before  # a table is never written at run time


def test_a_shipped_config_that_does_not_run_here_is_timed(tmp_path, cache_dir, no_package_tables, fake_timing,
                                                          monkeypatch, caplog):
    w = torch.randn(48, 32)
    chosen = shipped(tmp_path, cache_dir, no_package_tables, monkeypatch, [w], rows=(1,))
    assert list(chosen.values())[0] is not None  # fake_timing makes a candidate win

    def candidate(x, w_, cfg):
        if len(fake_timing) == timed:  # the check before any timing: as a Triton lacking shared memory raises
            raise RuntimeError("out of resource: shared memory")
        return F.linear(x, w_)

    timed = len(fake_timing)
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.skinny"):
        skinny.SkinnyTuner((1,)).tune([w], candidate=candidate)
    assert len(fake_timing) == timed + 1 + len(skinny.CANDIDATES)
    assert any("does not run here" in r.getMessage() for r in caplog.records)


def test_export_merges_replaces_and_skips(tmp_path, cache_dir, capsys):
    from pdserve.tools import export_tuned_table

    old = tuning_cache.TuningCache(cache_dir, KEY)
    old.put("a", {"config": None})
    old.put("b", {"config": None, "best_us": 1.0})
    old.save()
    newer = tuning_cache.TuningCache(tmp_path / "second", {**KEY, "triton": "3.7.0"})
    newer.put("b", {"config": None, "best_us": 2.0})
    newer.save()
    os.utime(newer.path, (old.path.stat().st_mtime + 10,) * 2)
    stale = tuning_cache.TuningCache(tmp_path / "second", {**KEY, "tuner": "0"})
    stale.put("c", {"config": None})
    stale.save()
    (tmp_path / "second" / "junk.json").write_text("{")
    out = tmp_path / "out"
    assert export_tuned_table.main([str(cache_dir), str(tmp_path / "second"), "--out", str(out)]) == 0
    text = (out / "nvidia-h200.json").read_text()
    table = tuning_cache.read_file(out / "nvidia-h200.json", tuning_cache.TABLE_SCHEMA,
                                   {"gpu": "NVIDIA H200", "capability": "9.0", "tuner": KEY["tuner"]})
    assert table["entries"] == {"a": {"config": None}, "b": {"config": None, "best_us": 2.0}}  # the newer file's b
    assert sorted(m["triton"] for m in table["measured_with"]) == ["3.6.0", "3.7.0"]
    assert sum(line.startswith('  "') for line in text.splitlines()) == 2  # one entry a line
    assert "skipped" in capsys.readouterr().err  # the stale tuner's file and the junk
    third = tuning_cache.TuningCache(tmp_path / "third", KEY)
    third.put("d", {"config": None})
    third.save()
    export_tuned_table.main([str(tmp_path / "third"), "--out", str(out)])
    merged = json.loads((out / "nvidia-h200.json").read_text())["entries"]
    assert sorted(merged) == ["a", "b", "d"]
    export_tuned_table.main([str(tmp_path / "third"), "--out", str(out), "--replace"])
    assert sorted(json.loads((out / "nvidia-h200.json").read_text())["entries"]) == ["d"]
    assert export_tuned_table.main([str(tmp_path / "empty"), "--out", str(out)]) == 1


def test_the_start_script_parses_and_its_flags_exist(monkeypatch):
    """scripts/fp8_start.sh (run on a GPU only): bash parses it, and the flags it gives the server and the export
    tool are theirs."""
    import re
    import subprocess
    from pathlib import Path

    from pdserve.tools import export_tuned_table

    script = Path(__file__).resolve().parents[2] / "scripts" / "fp8_start.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    commands = [line for line in script.read_text().replace("\\\n", " ").splitlines()
                if not line.lstrip().startswith("#")]
    launch = next(line for line in commands if "-m pdserve.launch_server" in line)
    starts = [line for line in commands if re.match(r"(want \w+ && )?(\w+=\S+ )?start \w+ ", line)]
    assert len(starts) == 6
    server_options = build_arg_parser()._option_string_actions
    for flag in re.findall(r" (--[a-z0-9-]+)", " ".join([launch, *starts])):
        assert flag in server_options, flag
    exports = [line for line in commands if "-m pdserve.tools.export_tuned_table" in line]
    called = []
    monkeypatch.setattr(export_tuned_table, "export", lambda *a: called.append(a) or {Path("t.json"): 1})
    for export in exports:  # the llama preset's table made anew, another preset's entries merged into it
        args = [arg.strip('"') for arg in export.split("-m pdserve.tools.export_tuned_table", 1)[1].split()]
        assert export_tuned_table.main(args) == 0
    caches = [Path("$CACHES/bf16"), Path("$CACHES/fp8")]
    assert called == [(caches, Path("$OUT/tuned"), True), (caches, Path("$OUT/tuned"), False)]


@pytest.mark.gpu
def test_shipped_table_on_the_gpu(tmp_path, monkeypatch, no_package_tables):
    """On a GPU: the skinny tuner's choices exported as a table are taken on an empty cache without any timing (each
    shipped config launched once), and the layer through them equals F.linear."""
    from pdserve.tools import export_tuned_table

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(skinny, "_choice", {})
    try:
        tuning_cache.configure(str(tmp_path / "measured"))
        weights = [torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) / 64 for n in (1024, 6144)]
        skinny.SkinnyTuner((1, 4)).tune(weights)
        chosen = dict(skinny._choice)
        assert export_tuned_table.main([str(tmp_path / "measured"), "--out", str(no_package_tables)]) == 0
        skinny._choice.clear()
        tuning_cache._tables.clear()  # the first tune read the folder while it had no table (read once per process)
        tuning_cache.configure(str(tmp_path / "fresh"))
        monkeypatch.setattr(skinny, "_graph_us", lambda *a, **k: pytest.fail("timed despite the shipped table"))
        skinny.SkinnyTuner((1, 4)).tune(weights)
        assert skinny._choice == chosen
        for w in weights:
            x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(skinny.linear(x, w), F.linear(x, w), rtol=2e-2, atol=2e-2)
    finally:
        os.environ.pop("TRITON_CACHE_DIR", None)
        monkeypatch.setattr(tuning_cache, "_directory", None)
        tuning_cache._caches.clear()
