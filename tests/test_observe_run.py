"""The observation layer end to end: one `vsup run` over two fake vLLM instances under a steady
load, looked at the ways an operator would: Prometheus text from the proxy, `vsup status`,
`vsup top` in a real terminal (tmux), the /status page in a real browser (Chromium, headless),
and the Grafana dashboard's queries checked against what the proxy really exports.

VSUP_UPDATE_DOCS=1 also writes what docs/operations.md and docs/metrics.md show:
docs/status-page.png and docs/vsup-top.txt.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.tools import need_tool
from tests.vsup_harness import VSUP, VsupRun, make_config

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
KEY = "s3cret-key"
UPDATE_DOCS = os.environ.get("VSUP_UPDATE_DOCS") == "1"


class Load:
    """A few clients streaming completions through the proxy until stopped."""

    def __init__(self, port: int, clients: int = 3) -> None:
        self.port = port
        self.stop = threading.Event()
        self.done = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        body = json.dumps({"model": "fake-model", "prompt": "one two three four", "max_tokens": 30, "stream": True})
        while not self.stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                conn.request("POST", "/v1/completions", body=body,
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
                response = conn.getresponse()
                data = response.read()
                if response.status != 200:
                    self.failed.append(f"HTTP {response.status}: {data[:200]!r}")
                self.done += 1
            except OSError as exc:
                self.failed.append(repr(exc))
            finally:
                conn.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(run, load): two ready instances, figures collected every 0.5 s, a load running."""
    tmp = tmp_path_factory.mktemp("observe")
    config = make_config(tmp, proxy={"api_key": KEY}, metrics={"interval": 0.5, "timeout": 1.0},
                         log={"dir": str(tmp / "logs"), "echo": False, "level": "info"},
                         vllm={"env": {"FAKE_VLLM_TOKEN_DELAY": "0.02", "FAKE_VLLM_ACCESS_LOG": "0"}})
    config["vllm"]["base_port"] = config["vllm"]["base_port"]
    run = VsupRun(tmp, config)
    load = None
    try:
        run.wait_ready()
        load = Load(run.proxy_port)
        # a minute's rate needs two collections with tokens counted in between
        run.wait_for(lambda s: all((i["metrics"] or {}).get("generation_tokens_per_s") for i in s["instances"]),
                     timeout=30, what="tokens/s of both instances")
        yield run, load
    finally:
        if load is not None:
            load.close()
        run.close()


def get(run: VsupRun, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", run.proxy_port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def scrape(run: VsupRun) -> list:
    status, _, body = get(run, "/metrics", {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    return list(text_string_to_metric_families(body.decode()))


def samples(families, name: str) -> dict[str, float]:
    """instance label -> value of the samples called `name` (summed over other labels)."""
    out: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            if s.name == name:
                out[s.labels.get("instance", "")] = out.get(s.labels.get("instance", ""), 0.0) + s.value
    return out


# ---- one Prometheus target ---------------------------------------------------------------------------

def test_proxy_metrics_carry_every_instances_vllm_metrics_and_process_figures(fleet):
    run, load = fleet
    families = scrape(run)
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family appears twice in the proxy's text"
    assert samples(families, "vllm:generation_tokens_total").keys() == {"0", "1"}
    assert all(v > 0 for v in samples(families, "vllm:generation_tokens_total").values())
    for histogram in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert all(v > 0 for v in samples(families, histogram).values()), histogram
    assert samples(families, "vllm:num_requests_running").keys() == {"0", "1"}
    assert samples(families, "process_resident_memory_bytes").keys() == {"0", "1"}  # vLLM's own, kept as is
    status = run.status()
    for inst in status["instances"]:
        name, pids = str(inst["index"]), inst["metrics"]["pids"]
        assert inst["pid"] in pids and len(pids) == 3  # API server, EngineCore, Worker
        assert samples(families, "vsup_instance_processes")[name] == 3
        assert samples(families, "vsup_instance_cpu_seconds_total")[name] > 0
        assert samples(families, "vsup_instance_rss_bytes")[name] > 3 * 10 * 2**20
        assert 0 < samples(families, "vsup_instance_pss_bytes")[name] <= samples(families, "vsup_instance_rss_bytes")[name]
        assert samples(families, "vsup_instance_numa_local_ratio")[name] == 1.0  # node 0 is the plan's, and the only one
        assert samples(families, "vsup_instance_metrics_up")[name] == 1
    numa = next(f for f in families if f.name == "vsup_instance_numa_memory_bytes")
    assert {(s.labels["node"], s.labels["local"]) for s in numa.samples} == {("0", "true")}
    # a single-model config's one model is named beside instance, on vLLM's series and vsup's
    for name in ("vllm:generation_tokens_total", "process_resident_memory_bytes", "vsup_instance_rss_bytes",
                 "vsup_instance_numa_memory_bytes", "vsup_instance_metrics_up"):
        assert {s.labels.get("model") for f in families for s in f.samples if s.name == name} == {"fake-model"}, name
    assert not load.failed


def test_status_shows_the_figures_as_text_and_json(fleet):
    run, _ = fleet
    data = json.loads(subprocess.run([*VSUP, "status", "--socket", run.socket, "--format", "json"], capture_output=True,
                                     text=True, timeout=30, check=True).stdout)
    assert data["vsup"]["metrics_interval"] == 0.5
    assert data["models"] == [{"name": "fake-model", "instances": [0, 1], "ready": 2, "states": {"ready": 2},
                               "in_flight": data["models"][0]["in_flight"]}]
    assert {inst["model"] for inst in data["instances"]} == {"fake-model"}
    for inst in data["instances"]:
        m = inst["metrics"]
        assert m["scrape"] == "ok" and m["age"] < 5
        assert m["generation_tokens_per_s"] > 0 and m["requests_running"] is not None and m["requests_waiting"] is not None
        assert m["kv_cache_usage"] is not None and m["cpu_percent"] is not None
        assert m["rss_bytes"] > 0 and m["numa_local_ratio"] == 1.0
    text = subprocess.run([*VSUP, "status", "--socket", run.socket], capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()
    header = text[1].split()  # one model: no MODEL column, no model lines
    assert header[:3] == ["IDX", "STATE", "PHASE"] and header[11:18] == ["TOK/S", "RUN", "WAIT", "KV", "CPU%", "RSS", "LOCAL"]
    for line in text[2:4]:
        cells = line.split()
        assert cells[1:3] == ["ready", "-"] and float(cells[11]) > 0 and cells[17] == "100%", line


# ---- Grafana --------------------------------------------------------------------------------------------

_FUNCTIONS = {"sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "time", "vector",
              "by", "without", "or", "and", "unless", "on", "ignoring", "label_values", "abs", "clamp_min", "delta",
              "deriv", "changes", "max_over_time", "min_over_time", "predict_linear"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, grouping labels, functions,
    durations and numbers aside)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    words = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
    return {w for w in words if w not in _FUNCTIONS}


def exported_names(run: VsupRun) -> set[str]:
    exported = set()
    for family in scrape(run):  # a family without samples yet (no upstream error so far) is exported too
        exported |= {family.name, *(s.name for s in family.samples)}
        exported |= {"counter": {family.name + "_total"},
                     "histogram": {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}}.get(family.type, set())
    return exported


def test_every_grafana_panel_queries_metrics_the_proxy_exports(fleet):
    run, _ = fleet
    exported = exported_names(run)
    dashboard = json.loads((ROOT / "docs/grafana/vsup.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    seen = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} not in the proxy's /metrics"
            seen |= names
    for wanted in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket", "vsup_instance_cpu_percent",
                   "vsup_instance_numa_memory_bytes", "vsup_instance_rss_bytes", "vsup_proxy_requests_total"):
        assert wanted in seen
    assert metric_names('sum by (exported_instance, le) (rate(vllm:x_bucket{instance=~"$host"}[5m]))') == {"vllm:x_bucket"}


def test_every_alert_rule_reads_metrics_the_proxy_exports(fleet):
    run, _ = fleet
    exported = exported_names(run)
    rules = yaml.safe_load((ROOT / "docs/prometheus/vsup-alerts.yml").read_text())["groups"][0]["rules"]
    assert len(rules) >= 10
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names and names <= exported, f"{rule['alert']}: {sorted(names - exported)}"
        assert rule["alert"] in (ROOT / "docs" / "operations.md").read_text(), f"{rule['alert']} is not explained in docs/operations.md"


# ---- the status page, in a real browser -------------------------------------------------------------------

def test_status_page_needs_the_key_and_lists_the_instances(fleet):
    run, _ = fleet
    status, headers, _ = get(run, "/status")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic realm=")
    password = "Basic " + base64.b64encode(f"ops:{KEY}".encode()).decode()
    status, headers, body = get(run, "/status", {"Authorization": password})
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert headers["Cache-Control"] == "no-store"
    page = body.decode()
    assert '<meta http-equiv="refresh" content="2">' in page  # metrics.interval 0.5 -> the 2 s floor
    assert page.count('<span class="state ready">ready</span>') >= 2


def test_status_page_renders_in_headless_chromium(fleet, tmp_path):
    browser = need_tool("chromium", "chromium-browser", package="chromium")
    run, _ = fleet
    address = f"http://ops:{KEY}@127.0.0.1:{run.proxy_port}/status"  # Basic auth, as a browser's login prompt sends it
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", address], capture_output=True, text=True, timeout=120).stdout
    rows = re.findall(r"<tr>(.*?)</tr>", dom.split('id="instances"', 1)[1].split("</table>", 1)[0], re.S)
    cells = [found for row in rows if (found := re.findall(r"<td[^>]*>(.*?)</td>", row, re.S))]  # thead has <th>
    assert [re.sub(r"<[^>]+>", "", c[1]) for c in cells] == ["ready", "ready"], dom[-2000:]
    table = dom.split('id="instances"', 1)[1].split("</table>", 1)[0]
    heads = [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<th>(.*?)</th>", table, re.S)]
    tok_s, local = heads.index("Tok/s"), heads.index("Node-local mem")
    for c in cells:
        assert float(c[tok_s]) > 0, (heads, c)
        assert c[local].startswith("100%")
    assert "Recent transitions" in dom and "healthy" in dom
    shot = tmp_path / "status.png"
    subprocess.run([*flags, "--hide-scrollbars", "--window-size=1500,560", f"--screenshot={shot}", address],
                   capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if UPDATE_DOCS:
        shutil.copy(shot, ROOT / "docs" / "status-page.png")


# ---- vsup top, in a real terminal ---------------------------------------------------------------------------

@pytest.fixture
def tmux(tmp_path):
    need_tool("tmux")
    server = ["tmux", "-S", str(tmp_path / "tmux.sock"), "-f", "/dev/null"]  # a server of its own, its socket in tmp

    def tm(*args: str) -> str:
        return subprocess.run([*server, *args], capture_output=True, text=True, timeout=30, check=True).stdout

    yield tm
    subprocess.run([*server, "kill-server"], capture_output=True, timeout=30)


def pane(tm) -> str:
    return tm("capture-pane", "-p", "-t", "top")


def wait_pane(tm, predicate, what: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = pane(tm)
        if predicate(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; pane:\n{text}")
        time.sleep(0.2)


@pytest.mark.parametrize("quit_key", ["q", "C-c"])
def test_top_refreshes_in_a_terminal_and_quits_cleanly(fleet, tmux, quit_key):
    run, _ = fleet
    # pytest exports COLUMNS/LINES (80x24), which rich would take over the pane's real size
    top = " ".join(["env", "-u", "COLUMNS", "-u", "LINES", *VSUP, "top", "--socket", run.socket, "--interval", "0.5"])
    # after top: its exit code, and whether the terminal is back in canonical mode with echo
    script = f"{top}; echo TOP_EXIT=$?; stty -a | tr ' ;' '\\n\\n' | grep -x -e '-*icanon' -e '-*echo'; sleep 120"
    tmux("new-session", "-d", "-s", "top", "-x", "150", "-y", "12", script)
    first = wait_pane(tmux, lambda t: len(re.findall(r"^\s*\d+\s+ready\s", t, re.M)) == 2, "two ready rows")
    assert "TOK/S" in first and "LOCAL" in first and "2/2 ready" in first
    up = re.search(r"\bup (\S+)", first).group(1)
    wait_pane(tmux, lambda t: re.search(r"\bup (\S+)", t) and re.search(r"\bup (\S+)", t).group(1) != up, "a refresh")
    live = wait_pane(tmux, lambda t: all(float(m) > 0 for m in re.findall(r"^\s*\d+\s+ready\s+\d+\s+\S+\s+\S+\s+\S+\s+\d+\s+\d+\s+([\d.]+)", t, re.M))
                     and len(re.findall(r"^\s*\d+\s+ready", t, re.M)) == 2, "tokens/s in both rows")
    if UPDATE_DOCS and quit_key == "q":
        (ROOT / "docs" / "vsup-top.txt").write_text("\n".join(line.rstrip() for line in live.splitlines()).strip("\n") + "\n")
    tmux("send-keys", "-t", "top", quit_key)
    # (stty's lines come a moment after the exit code on a loaded machine)
    after = wait_pane(tmux, lambda t: re.search(r"TOP_EXIT=\d+\s+\S*icanon\s+\S*echo\b", t) is not None, "vsup top to exit")
    assert "TOP_EXIT=0" in after
    assert after.split("TOP_EXIT=0", 1)[1].split() == ["icanon", "echo"]  # not -icanon / -echo: restored
    assert "TOK/S" not in after  # the alternate screen is gone; the shell's screen is back
