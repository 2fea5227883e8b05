"""GET /dashboard rendered by a real browser (headless Debian Chromium): the page's script fills the instance
table from /dashboard/status."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import pytest
from cluster_util import free_port

CHROMIUM = shutil.which("chromium")
CHROMIUM_TIMEOUT = 60.0


class TableRows(HTMLParser):
    """The text of every cell of one table's body rows, by the table's id."""

    def __init__(self, table_id: str):
        super().__init__()
        self.table_id = table_id
        self.depth = 0  # > 0 inside the wanted table
        self.in_body = False
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and (self.depth or dict(attrs).get("id") == self.table_id):
            self.depth += 1
        elif self.depth and tag == "tbody":
            self.in_body = True
        elif self.in_body and tag == "tr":
            self.rows.append([])
        elif self.in_body and tag == "td":
            self.cell = []

    def handle_endtag(self, tag):
        if tag == "table" and self.depth:
            self.depth -= 1
        elif tag == "tbody":
            self.in_body = False
        elif tag == "td" and self.cell is not None:
            self.rows[-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def table_rows(dom: str, table_id: str) -> list[list[str]]:
    parser = TableRows(table_id)
    parser.feed(dom)
    return parser.rows


def render(url: str) -> str:
    """The page's DOM after its script ran (virtual time lets the first poll finish before the dump)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-chromium-") as profile:
        done = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=3000", "--dump-dom",
             url], capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")
def test_dashboard_renders_instances_pairs_and_recent_errors(stubs, start_router):
    prefill, decode = stubs.add("prefill"), stubs.add("decode")
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: it fails its health checks
    router = start_router("--prefill", prefill.url, "--prefill-bootstrap-ports", "9100", "--decode", decode.url,
                          gone)
    router.wait_for(lambda: not router.workers()[gone]["healthy"])
    assert router.post("/generate", {"text": "hi"}).status == 200

    dom = render(router.url + "/dashboard")

    rows = {row[1]: row for row in table_rows(dom, "instances")}
    assert rows == {
        prefill.url: ["prefill", prefill.url, "in rotation", "closed", "0", "9100"],
        decode.url: ["decode", decode.url, "in rotation", "closed", "0", ""],
        gone: ["decode", gone, "not ready", "closed", "0", ""],
    }
    assert table_rows(dom, "pairs") == [[prefill.url, decode.url]]
    errors = [row[2] for row in table_rows(dom, "errors")]
    assert any(gone in message and "out of rotation" in message for message in errors), errors


def test_dashboard_status_is_json_and_the_page_is_html(stubs, start_router):
    decode = stubs.add("decode")
    router = start_router("--decode", decode.url)
    page = router.get("/dashboard")
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    status = router.get("/dashboard/status").json()
    assert status["mode"] == "pd" and status["pairs"] == []
    assert [(i["url"], i["role"], i["in_rotation"]) for i in status["instances"]] == [(decode.url, "decode", True)]
