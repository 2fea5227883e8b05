"""Prometheus and Grafana against the cluster the systemd units start: a real Prometheus (Debian's package) scrapes
it with deploy/prometheus/prometheus.yml, and every query of deploy/grafana/pdserve.json names a metric that the
router or a server exports."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from cluster_util import free_port, http
from deploy_util import DEPLOY

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = DEPLOY / "grafana" / "pdserve.json"
METRIC_NAME = re.compile(r"\bpdserve_[a-z0-9_]+\b")
SCRAPE_TIMEOUT = 60.0


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every query of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] if panel["type"] != "row"
            for target in panel["targets"]]


def exported_names(metrics_text: str) -> set[str]:
    """Every family (`# TYPE` line) and every series name (a histogram's _bucket/_sum/_count) in a /metrics page."""
    families = {line.split()[2] for line in metrics_text.splitlines() if line.startswith("# TYPE ")}
    series = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in metrics_text.splitlines()
              if line and not line.startswith("#")}
    return families | series


def cluster_names(cluster) -> set[str]:
    return {name for proc in cluster.jobs.values() for name in exported_names(proc.get("/metrics").body.decode())}


def test_dashboard_loads_as_a_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    (variable,) = dashboard["templating"]["list"]
    assert variable == {**variable, "name": "datasource", "type": "datasource", "query": "prometheus"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_every_dashboard_query_names_an_exported_metric(systemd_cluster):
    known = cluster_names(systemd_cluster)
    for title, expr in dashboard_targets():
        names = set(METRIC_NAME.findall(expr))
        assert names, f"{title}: {expr} names no pdserve metric"
        assert names <= known, f"{title}: {sorted(names - known)} is exported by neither the router nor a server"


@pytest.fixture
def prometheus(systemd_cluster, tmp_path) -> Iterator[str]:
    """Prometheus with deploy/prometheus/prometheus.yml, its targets rewritten to the test cluster's ports and its
    scrape interval shortened."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = systemd_cluster.jobs
    assert {job["job_name"] for job in config["scrape_configs"]} == set(jobs)
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        static["targets"] = [jobs[job["job_name"]].url.removeprefix("http://")]
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={url[7:]}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: ready(url), f"Prometheus not ready:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def ready(url: str) -> bool:
    try:
        return http("GET", url + "/-/ready", timeout=2).status == 200
    except OSError:
        return False


def wait_until(condition, message: str, timeout: float = SCRAPE_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.25)


def query(prometheus_url: str, expr: str) -> dict:
    reply = http("GET", f"{prometheus_url}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=10)
    assert reply.status == 200, f"{expr}: {reply.body[:500]!r}"
    body = reply.json()
    assert body["status"] == "success", body
    return body["data"]


def values_by_job(data: dict) -> dict[str, float]:
    return {sample["metric"]["job"]: float(sample["value"][1]) for sample in data["result"]}


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus package")
def test_prometheus_scrapes_the_request_counter(systemd_cluster, prometheus):
    router = systemd_cluster.router
    for i in range(2):
        assert router.post("/generate", {"text": f"count me {i}", "max_new_tokens": 2}, timeout=120).status == 200
    lines = router.get("/metrics").body.decode().splitlines()
    (line,) = [line for line in lines if line.startswith('pdserve_router_requests_total{route="/generate"}')]
    sent = float(line.split()[-1])
    expr = 'pdserve_router_requests_total{route="/generate"}'
    wait_until(lambda: values_by_job(query(prometheus, expr)).get("pdserve-router") == sent,
               f"Prometheus never saw {sent} requests: {query(prometheus, expr)}")
    wait_until(lambda: values_by_job(query(prometheus, "up")) == dict.fromkeys(systemd_cluster.jobs, 1.0),
               f"not every target is up: {query(prometheus, 'up')}")
    received = values_by_job(query(prometheus, "pdserve_requests_received_total"))
    assert set(received) == {"pdserve-prefill", "pdserve-decode"} and min(received.values()) >= 2


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus package")
def test_every_dashboard_query_runs_in_prometheus(prometheus):
    for title, expr in dashboard_targets():
        query(prometheus, expr.replace("$__rate_interval", "1m"))  # Grafana's interval variable, as it fills it


# SGLang's dashboard (sgl-project/sglang examples/monitoring/grafana/dashboards/json/sglang-dashboard.json) and the
# templates built on it query SGLang's own names; these are its queries, written out here, with its variables
# $__rate_interval and $model_name as Grafana fills them.
SGLANG_HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds")
SGLANG_QUERIES = (
    *(f"histogram_quantile({q}, sum by (le) (rate(sglang:{h}_bucket[$__rate_interval])))"
      for h in SGLANG_HISTOGRAMS for q in (0.99, 0.9, 0.5)),
    *(f"avg(rate(sglang:{h}_sum[$__rate_interval]) / rate(sglang:{h}_count[$__rate_interval]))"
      for h in SGLANG_HISTOGRAMS[:2]),  # a PD prefill server measures no inter-token latency: its 0 / 0 is NaN
    *(f'sum by (le) (increase(sglang:{h}_bucket{{model_name=~"$model_name"}}[$__rate_interval]))'
      for h in SGLANG_HISTOGRAMS),
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:gen_throughput",
    "rate(sglang:prompt_tokens_total[$__rate_interval])", "rate(sglang:generation_tokens_total[$__rate_interval])",
)
SERVER_JOBS = ("pdserve-prefill", "pdserve-decode")


SGLANG_RENAMED = {"token_usage": "kv_cache_usage_ratio", "cache_hit_rate": "prefix_cache_hit_rate",
                  "gen_throughput": "decode_tokens_per_second"}  # the other names are pdserve's with its prefix


def samples_by_name(metrics_text: str) -> dict[tuple[str, tuple], float]:
    """Each sample of a /metrics page by (name, sorted labels)."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics_text) for sample in family.samples}


def test_sglang_names_carry_the_same_values_as_pdserves(systemd_cluster):
    router = systemd_cluster.router
    assert router.post("/generate", {"text": "same values", "max_new_tokens": 3}, timeout=120).status == 200
    model = systemd_cluster.prefill.get("/get_model_info").json()["served_model_name"]
    expected = {"prompt_tokens_total", "generation_tokens_total", "num_running_reqs", "num_queue_reqs", "token_usage",
                "cache_hit_rate", "gen_throughput", *(h + part for h in SGLANG_HISTOGRAMS for part in ("_bucket", "_sum", "_count"))}
    for proc in (systemd_cluster.prefill, systemd_cluster.decode):
        samples = samples_by_name(proc.get("/metrics").body.decode())
        sglang = [(name.removeprefix("sglang:"), dict(labels)) for name, labels in samples if name.startswith("sglang:")]
        assert {name for name, _ in sglang} == expected
        for name, labels in sglang:
            assert labels.pop("model_name") == model, name
            own = ("pdserve_" + SGLANG_RENAMED.get(name, name), tuple(sorted(labels.items())))
            assert samples[("sglang:" + name, tuple(sorted({**labels, "model_name": model}.items())))] == \
                samples[own], name
    decode = samples_by_name(systemd_cluster.decode.get("/metrics").body.decode())
    assert decode[("sglang:generation_tokens_total", (("model_name", model),))] >= 3


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus package")
def test_sglang_dashboard_queries_answer_from_a_scraped_server(systemd_cluster, prometheus):
    wait_until(lambda: set(values_by_job(query(prometheus, "sglang:num_running_reqs"))) == set(SERVER_JOBS),
               f"Prometheus never scraped SGLang's names: {query(prometheus, 'sglang:num_running_reqs')}")
    router = systemd_cluster.router
    for i in range(3):  # after the first scrape, so that rates and increases over the window see them
        assert router.post("/generate", {"text": f"dashboard {i}", "max_new_tokens": 4}, timeout=120).status == 200
    model = systemd_cluster.decode.get("/get_model_info").json()["served_model_name"]
    assert model in query_label_values(prometheus, "model_name")
    done = "sum(sglang:e2e_request_latency_seconds_count)"
    wait_until(lambda: float(query(prometheus, done)["result"][0]["value"][1]) >= 3, f"{query(prometheus, done)}")
    time.sleep(2)  # two more scrapes: the rates' windows hold the requests' increases
    for expr in SGLANG_QUERIES:
        filled = expr.replace("$__rate_interval", "1m").replace("$model_name", model)
        values = [float(sample["value"][1]) for sample in query(prometheus, filled)["result"]]
        assert values and not any(math.isnan(value) for value in values), f"{filled}: {values}"


def query_label_values(prometheus_url: str, label: str) -> list[str]:
    """Grafana's label_values(label): the values of `label` across every series."""
    reply = http("GET", f"{prometheus_url}/api/v1/label/{label}/values", timeout=10)
    assert reply.status == 200, reply.body[:500]
    return reply.json()["data"]
