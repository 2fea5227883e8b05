"""A hub model id (`org/name`) resolves through a Hugging Face cache folder the test builds (HF_HOME,
HF_HUB_OFFLINE=1), for the server and the offline API alike; a path that is neither a folder nor an id fails in
one line."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import cluster_util
import pytest

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_env(tiny_model, tmp_path_factory) -> dict:
    """HF_HOME holding the tiny model as `test-org/tiny` in the hub cache layout, and offline."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--test-org--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return {**cluster_util.CHILD_ENV, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_offline_api_serves_a_hub_id(hub_env):
    result = _python("from pdserve import LLM, SamplingParams\n"
                     "llm = LLM('test-org/tiny', device='cpu', max_total_tokens=4096, skip_server_warmup=True)\n"
                     "print(llm.args.model_path, llm.args.model_name)\n"
                     "print(len(llm.generate('hi', SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids))",
                     hub_env)
    assert result.returncode == 0, result.stderr[-2000:]
    folder, name, tokens = result.stdout.split()
    assert folder.endswith(f"models--test-org--tiny/snapshots/{SNAPSHOT}") and name == "test-org/tiny"
    assert tokens == "2"


def test_the_server_serves_a_hub_id(hub_env, tmp_path):
    server = dataclasses.replace(cluster_util.server("hub", "test-org/tiny"), env=hub_env,
                                 log_path=str(tmp_path / "hub.log"))
    cluster_util.start_all([server])
    try:
        assert server.get("/v1/models").json()["data"][0]["id"] == "test-org/tiny"
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["test-org/missing", "/no/such/folder"])
def test_a_path_neither_folder_nor_id_fails_in_one_line(hub_env, path):
    server = _python(f"from pdserve.launch_server import main; main(['--model-path', {path!r}])", hub_env)
    assert server.returncode == 2 and server.stderr.count("\n") == 1, server.stderr
    assert server.stderr.startswith(f"python -m pdserve.launch_server: error: model path {path!r}")
    offline = _python(f"from pdserve import LLM\ntry:\n    LLM({path!r})\nexcept ValueError as exc:\n    print(exc)",
                      hub_env)
    assert offline.stdout.count("\n") == 1 and offline.stdout.startswith(f"model path {path!r}"), offline.stdout
