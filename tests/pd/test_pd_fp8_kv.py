"""PD with an FP8 KV cache, real servers on the CPU: scales calibrated by `pdserve.tools.calibrate_kv_scales` and
loaded by every server; a prefill at TP 2 hands FP8 pages to a decode at TP 1 over tcp and mooncake (KV checksum on)
and the answers equal a colocated server's with the same settings, token for token; the prompt logprobs PD returns
(the prefill computes them) and the decode's output logprobs agree with colocated at every position from 88 to the
end of a 256-token prompt and past it (SGLang #25790); a decode whose KV dtype or scales differ is refused at the
handshake with a message naming both sides' values (SGLang #19398)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_util import (NO_MOONCAKE, PDCluster, Proc, decode_server, free_port, mooncake_available,
                          prefill_server, router, server, start_all, stop_all, wait_kv_free)

from pdserve.tools import calibrate_kv_scales

pytestmark = pytest.mark.timeout(900)  # the first test also pays for starting the servers

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
LONG_IDS = [(i * 37 + 11) % 1000 + 3 for i in range(100)]  # > 3 chunks of the prefill's 32
LOGPROB_IDS = [(i * 53 + 7) % 1100 + 3 for i in range(256)]
LOGPROB_FROM = 88
LOGPROB_TOLERANCE = 5e-5  # the differences measured here (float32, CPU) are about 4e-6
BACKENDS = ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(not mooncake_available(), reason=NO_MOONCAKE))]


@pytest.fixture(scope="module")
def scales_file(tiny_model, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fp8") / "scales.json"
    document = calibrate_kv_scales.main(["--model-path", tiny_model, "--out", str(path), "--device", "cpu",
                                         "--max-total-tokens", "1024"])
    assert document["num_tokens"] > 100 and all(s < 0.1 for s in document["k_scale"] + document["v_scale"])
    return str(path)


@pytest.fixture(scope="module")
def fp8_servers(tiny_model, scales_file) -> Iterator[dict]:
    fp8 = ["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scales", scales_file]
    backends = ["tcp"] + (["mooncake"] if mooncake_available() else [])
    procs: dict[str, Proc] = {"colocated": server("colocated-fp8", tiny_model, *fp8)}
    bootstraps = {backend: free_port() for backend in backends}
    for backend in backends:
        procs[f"prefill-{backend}"] = prefill_server(tiny_model, backend, bootstraps[backend], *fp8, "--tp-size", "2",
                                                     "--chunked-prefill-size", "32",
                                                     "--disaggregation-layerwise-min-tokens", "16")
        procs[f"decode-{backend}"] = decode_server(tiny_model, backend, *fp8, "--disaggregation-enable-kv-checksum",
                                                   name=f"decode-fp8-{backend}")
    procs["decode-auto"] = decode_server(tiny_model, "tcp", name="decode-auto-kv")
    procs["decode-unscaled"] = decode_server(tiny_model, "tcp", "--kv-cache-dtype", "fp8_e4m3", name="decode-unscaled")
    start_all(list(procs.values()))
    tcp_prefill = (procs["prefill-tcp"], bootstraps["tcp"])
    routers = {backend: router([(procs[f"prefill-{backend}"], bootstraps[backend])], [procs[f"decode-{backend}"]],
                               name=f"router-fp8-{backend}") for backend in backends}
    routers |= {name: router([tcp_prefill], [procs[f"decode-{name}"]], "--max-retries", "0", name=f"router-{name}")
                for name in ("auto", "unscaled")}
    try:
        start_all(list(routers.values()))
    except BaseException:
        stop_all(procs.values())
        raise
    clusters = {b: PDCluster(b, procs[f"prefill-{b}"], bootstraps[b], procs[f"decode-{b}"], routers[b])
                for b in backends}
    yield {"colocated": procs["colocated"], "clusters": clusters, "routers": routers, "procs": procs}
    stop_all([*routers.values(), *procs.values()])


@pytest.fixture(params=BACKENDS)
def pd(request, fp8_servers) -> PDCluster:
    return fp8_servers["clusters"][request.param]


def generate(proc: Proc, **body) -> dict | list:
    reply = proc.post("/generate", {"sampling_params": GREEDY, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def output_ids(out: dict | list) -> list:
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def test_pd_with_fp8_pages_equals_colocated(pd: PDCluster, fp8_servers):
    colocated = fp8_servers["colocated"]
    for prompt in ({"text": PROMPTS}, {"input_ids": LONG_IDS}):
        assert output_ids(generate(pd.router, **prompt)) == output_ids(generate(colocated, **prompt))
    assert pd.decode.get("/get_server_info").json()["kv_cache_dtype"] == "fp8_e4m3"
    wait_kv_free([colocated, pd.prefill, pd.decode])


def test_prompt_and_output_logprobs_agree_with_colocated(pd: PDCluster, fp8_servers):
    body = {"input_ids": LOGPROB_IDS, "return_logprob": True, "logprob_start_len": 0}
    got, want = generate(pd.router, **body), generate(fp8_servers["colocated"], **body)
    assert got["output_ids"] == want["output_ids"]
    prompt_got, prompt_want = got["meta_info"]["input_token_logprobs"], want["meta_info"]["input_token_logprobs"]
    assert len(prompt_got) == len(prompt_want) == len(LOGPROB_IDS)
    for position in range(LOGPROB_FROM, len(LOGPROB_IDS)):
        (p, token, _), (w, want_token, _) = prompt_got[position], prompt_want[position]
        assert token == want_token == LOGPROB_IDS[position]
        assert abs(p - w) < LOGPROB_TOLERANCE, f"prompt position {position}: PD {p}, colocated {w}"
    outputs = zip(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"])
    for step, ((p, _, _), (w, _, _)) in enumerate(outputs):
        assert abs(p - w) < LOGPROB_TOLERANCE, f"output token {step} (position {len(LOGPROB_IDS) + step}): {p} vs {w}"


@pytest.mark.parametrize("decode_name, expected", [
    ("auto", "dtype mismatch: prefill has float8_e4m3fn, decode has float32"),
    ("unscaled", "k_scales mismatch at layer 0: prefill has 0.0"),
])
def test_decode_with_other_kv_dtype_or_scales_is_refused(fp8_servers, decode_name, expected):
    reply = fp8_servers["routers"][decode_name].post("/generate", {"text": PROMPTS[0], "sampling_params": GREEDY},
                                                     timeout=20)
    assert reply.status == 502, reply.body
    message = reply.json()["error"]["message"]
    assert expected in message, message
    if decode_name == "unscaled":
        assert "decode has 1.0" in message
    decode = fp8_servers["procs"][f"decode-{decode_name}"]
    wait_kv_free([decode, fp8_servers["clusters"]["tcp"].prefill], timeout=20)
