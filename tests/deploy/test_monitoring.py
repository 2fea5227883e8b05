"""Prometheus and Grafana against the cluster the systemd units start: a real Prometheus (Debian's package) scrapes
it with deploy/prometheus/prometheus.yml, and every query of deploy/grafana/pdserve.json names a metric that the
router or a server exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator

import pytest
import yaml
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
