"""PD with FP8 weights and an FP8 KV cache together, real servers on the CPU: a compressed-tensors FP8 checkpoint
(detected from its config, no flag) with calibrated KV scales; the prefill hands FP8 pages to the decode over tcp
and mooncake and the answers, prompt logprobs included, equal a colocated server's with the same settings. Both PD
sides run TP 1 here: with FP8 weights, a row-parallel layer at TP 2 quantizes its activations per rank (as SGLang and
vLLM do), so TP 2 answers are not TP 1 answers; TP 2 -> TP 1 with FP8 pages is tests/pd/test_pd_fp8_kv.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import (NO_MOONCAKE, Proc, decode_server, free_port, mooncake_available, prefill_server, router,
                          server, start_all, stop_all, wait_kv_free)

from pdserve.quantization.formats import Fp8Checkpoint
from pdserve.tools import calibrate_kv_scales
from pdserve.tools.make_model import make_model

pytestmark = pytest.mark.timeout(900)

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT_IDS = [(i * 29 + 5) % 1000 + 3 for i in range(120)]
BACKENDS = ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason=NO_MOONCAKE))]


@pytest.fixture(scope="module")
def fp8_flags(tmp_path_factory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("fp8-both")
    model = str(make_model("qwen3-tiny", root / "model", seed=0, fp8=Fp8Checkpoint("compressed-tensors")))
    scales = root / "scales.json"
    calibrate_kv_scales.main(["--model-path", model, "--out", str(scales), "--device", "cpu",
                              "--max-total-tokens", "1024"])
    return model, ["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scales", str(scales)]


@pytest.fixture(scope="module")
def servers(fp8_flags) -> Iterator[dict[str, Proc]]:
    model, flags = fp8_flags
    backends = ["tcp"] + (["mooncake"] if mooncake_available() else [])
    procs = {"colocated": server("colocated-fp8-both", model, *flags)}
    ports = {backend: free_port() for backend in backends}
    for backend in backends:
        procs[f"prefill-{backend}"] = prefill_server(model, backend, ports[backend], *flags,
                                                     "--chunked-prefill-size", "48")
        procs[f"decode-{backend}"] = decode_server(model, backend, *flags, name=f"decode-fp8-both-{backend}")
    start_all(list(procs.values()))
    routers = {backend: router([(procs[f"prefill-{backend}"], ports[backend])], [procs[f"decode-{backend}"]],
                               name=f"router-fp8-both-{backend}") for backend in backends}
    try:
        start_all(list(routers.values()))
    except BaseException:
        stop_all(procs.values())
        raise
    yield procs | {f"router-{backend}": proc for backend, proc in routers.items()}
    stop_all([*routers.values(), *procs.values()])


def generate(proc: Proc, **body) -> dict:
    reply = proc.post("/generate", {"sampling_params": GREEDY, **body})
    assert reply.status == 200, reply.body
    return reply.json()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pd_with_fp8_weights_and_pages_equals_colocated(servers, backend):
    body = {"input_ids": PROMPT_IDS, "return_logprob": True, "logprob_start_len": 0}
    got, want = generate(servers[f"router-{backend}"], **body), generate(servers["colocated"], **body)
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        pairs = [(g, w) for g, w in zip(got["meta_info"][key], want["meta_info"][key]) if g[0] is not None]
        assert len(pairs) >= len(want["meta_info"][key]) - 1
        assert all(g[1] == w[1] and abs(g[0] - w[0]) < 5e-5 for g, w in pairs), key
    info = servers[f"decode-{backend}"].get("/get_server_info").json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    assert info["model_info"]["quantization"]["method"] == "compressed-tensors"
    wait_kv_free([servers["colocated"], servers[f"prefill-{backend}"], servers[f"decode-{backend}"]])
