"""The observation layer's pieces, each on its own: numa_maps and process figures read from real
child processes' /proc, counters to rates, scraped text relabelled and merged, the collector over
real fake-vLLM processes, the /status page and its auth, and the views of `vsup status`/`vsup top`."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
import textwrap
import time

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from tests.proxy_support import metrics_text, ready_pool, running_proxy, start_fakes, url
from vsup.cli.status import render_instances
from vsup.cli.top import view
from vsup.observe import fmt, numa, procstats, scrape
from vsup.observe.collector import Collector, Target
from vsup.observe.families import instance_families
from vsup.observe.page import render_page, status_page
from vsup.observe.rates import CounterWindow, increase
from vsup.proxy.auth import BearerAuth
from vsup.supervisor.metrics import tree_pids

MiB = 1024 * 1024


# ---- real child processes ---------------------------------------------------------------------------

def child(code: str) -> subprocess.Popen:
    """A Python child that prints "go" once its work is set up, then runs `code`'s loop."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    return proc


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        started.append(child(code))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


HOLDS_64M = """
    import time
    block = bytearray(64 * 1024 * 1024)
    for i in range(0, len(block), 4096):
        block[i] = 1  # touched: resident
    print("go", flush=True)
    time.sleep(600)
"""
SPINS = """
    print("go", flush=True)
    while True:
        pass
"""
SLEEPS = """
    import time
    print("go", flush=True)
    time.sleep(600)
"""


# ---- numa.py ------------------------------------------------------------------------------------------

TWO_NODES = """\
55d0c0a00000 default file=/usr/bin/python3.11 mapped=300 N0=200 N1=100 kernelpagesize_kB=4
7f0000000000 bind:1 anon=512 dirty=512 N1=512 kernelpagesize_kB=4
7f1000000000 default anon=4 dirty=4 N0=4 kernelpagesize_kB=2048
7ffd0000000 default stack anon=3 dirty=3 N0=3
7ffe000000 default
"""


def test_numa_maps_pages_count_with_each_mappings_page_size():
    by_node = numa.parse_numa_maps(TWO_NODES, page_size=4096)
    assert by_node == {0: (200 + 3) * 4096 + 4 * 2 * MiB, 1: (100 + 512) * 4096}
    local, remote = numa.local_split(by_node, [1])
    assert (local, remote) == (by_node[1], by_node[0])
    assert numa.local_ratio(by_node, [1]) == pytest.approx(by_node[1] / sum(by_node.values()))
    assert numa.local_ratio({}, [0]) is None
    assert numa.add_up([{0: 1, 1: 2}, {1: 3}]) == {0: 1, 1: 5}


def test_numa_bytes_of_a_real_process_hold_what_it_touched(children):
    proc = children(HOLDS_64M)
    by_node = numa.read_numa_bytes(proc.pid)
    assert by_node is not None and sum(by_node.values()) >= 64 * MiB
    assert numa.read_numa_bytes(2**22 + 7) is None  # no such process


# ---- procstats.py -------------------------------------------------------------------------------------

def test_rss_and_pss_of_a_real_tree_add_up_over_its_processes(children):
    big, small = children(HOLDS_64M), children(SLEEPS)
    figures = [procstats.read_process(p.pid) for p in (big, small)]
    assert all(f is not None for f in figures)
    assert figures[0].rss >= 64 * MiB and figures[0].pss is not None and figures[0].pss <= figures[0].rss
    tree = procstats.read_tree([big.pid, small.pid, 2**22 + 7], at=0.0)  # a vanished pid is skipped
    assert tree.pids == tuple(sorted((big.pid, small.pid)))
    assert tree.rss == sum(f.rss for f in figures if f) or abs(tree.rss - sum(f.rss for f in figures)) < 4 * MiB
    assert procstats.read_process(2**22 + 7) is None


def test_cpu_percent_of_a_spinning_and_a_sleeping_process(children):
    spinner, sleeper = children(SPINS), children(SLEEPS)
    before = procstats.read_tree([spinner.pid], time.monotonic()), procstats.read_tree([sleeper.pid], time.monotonic())
    time.sleep(1.0)
    after = procstats.read_tree([spinner.pid], time.monotonic()), procstats.read_tree([sleeper.pid], time.monotonic())
    busy, idle = procstats.cpu_percent(before[0], after[0]), procstats.cpu_percent(before[1], after[1])
    # one busy loop: far above the sleeper, at most ~100 (how far above 0 depends on the machine's load)
    assert busy > max(5, 10 * idle)
    assert busy < 120
    assert idle < 5
    assert procstats.cpu_percent(None, after[0]) is None


def test_a_process_gone_between_samples_never_makes_cpu_negative(children):
    spinner, sleeper = children(SPINS), children(SLEEPS)
    time.sleep(0.3)
    before = procstats.read_tree([spinner.pid, sleeper.pid], time.monotonic())
    spinner.kill()
    spinner.wait(10)
    after = procstats.read_tree([spinner.pid, sleeper.pid], time.monotonic() + 0.5)
    assert after.pids == (sleeper.pid,)
    assert 0 <= procstats.cpu_percent(before, after) < 5


# ---- rates.py -----------------------------------------------------------------------------------------

def test_counter_rates_survive_a_reset_and_age_out():
    assert increase([10, 20, 5, 8]) == 10 + 5 + 3  # 20 -> 5: restarted, 5 were added since
    window = CounterWindow(window=60)
    window.add(0, 100)
    assert window.rate() is None
    window.add(10, 150)
    assert window.rate() == 5.0
    window.add(70, 450)  # the sample at 0 falls out of the 60 s window
    assert window.rate() == pytest.approx(300 / 60)
    window.prune(200)
    assert window.rate() is None


# ---- scrape.py ----------------------------------------------------------------------------------------

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 2.0
# HELP vllm:gpu_cache_usage_perc old name
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.25
vllm:gpu_cache_usage_perc{model_name="m",engine="1"} 0.5
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m",engine="0"} 100.0
vllm:generation_tokens_total{model_name="m",engine="1"} 50.0
# HELP vllm:time_to_first_token_seconds TTFT
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m",engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m",engine="0"} 2.0
vllm:time_to_first_token_seconds_count{model_name="m",engine="0"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="m",engine="0"} 0.7
# HELP vsup_proxy_in_flight an instance that is a vsup itself
# TYPE vsup_proxy_in_flight gauge
vsup_proxy_in_flight{instance="a"} 4.0
"""


def test_summary_sums_engines_and_reads_the_old_kv_cache_name():
    summary = scrape.summarize(scrape.parse(VLLM_TEXT))
    assert summary == {"requests_running": 5.0, "requests_waiting": None, "kv_cache_usage": 0.5,
                       "prompt_tokens_total": None, "generation_tokens_total": 150.0}


def test_relabel_adds_instance_and_renames_only_what_clashes():
    families = {f.name: f for f in scrape.relabel(scrape.parse(VLLM_TEXT), "1")}
    sample = families["vllm:num_requests_running"].samples[0]
    assert sample.name == "vllm:num_requests_running" and sample.labels == {"instance": "1", "model_name": "m", "engine": "0"}
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    clash = families["instance_vsup_proxy_in_flight"].samples[0]
    assert clash.name == "instance_vsup_proxy_in_flight"
    assert clash.labels == {"instance": "1", "exported_instance": "a"}


def test_merged_text_has_each_family_once_and_parses_back():
    merged, dropped = scrape.merge([(name, scrape.relabel(scrape.parse(VLLM_TEXT), name)) for name in ("0", "1")])
    assert dropped == []
    text = generate_latest(scrape.Families(merged)).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    running = next(f for f in families if f.name == "vllm:num_requests_running")
    assert sorted((s.labels["instance"], s.labels["engine"]) for s in running.samples) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert text.count("# TYPE vllm:generation_tokens_total counter") == 1


def test_a_family_whose_type_differs_between_instances_keeps_the_first():
    gauge = scrape.parse("# TYPE x gauge\nx 1\n")
    counter = scrape.parse("# TYPE x_total counter\nx_total 2\n")  # family "x", a counter
    merged, dropped = scrape.merge([("0", scrape.relabel(gauge, "0")), ("1", scrape.relabel(counter, "1"))])
    assert [(f.name, f.type, len(f.samples)) for f in merged] == [("x", "gauge", 1)]
    assert dropped == [scrape.Dropped("1", "x", "clash")]


def test_text_that_is_not_prometheus_is_a_value_error():
    with pytest.raises(ValueError):
        scrape.parse("<html>not metrics</html>\n{{{")


# ---- families.py --------------------------------------------------------------------------------------

def test_process_families_mark_local_nodes_and_scrape_health():
    figures = {"0": {"nodes": [1], "pids": [10, 11], "cpu_seconds": 3.5, "cpu_percent": 50.0, "rss_bytes": 100,
                     "pss_bytes": 80, "numa_bytes": {"0": 30, "1": 70}, "numa_local_ratio": 0.7, "scrape": "ok"},
               "1": {"nodes": [0], "pids": [], "cpu_seconds": None, "scrape": "HTTP 503"}}
    text = generate_latest(scrape.Families(instance_families(figures, 1700000000.0, 0.02))).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("vsup_instance_cpu_seconds_total", (("instance", "0"),))] == 3.5
    assert samples[("vsup_instance_numa_memory_bytes", (("instance", "0"), ("local", "false"), ("node", "0")))] == 30
    assert samples[("vsup_instance_numa_memory_bytes", (("instance", "0"), ("local", "true"), ("node", "1")))] == 70
    assert samples[("vsup_instance_processes", (("instance", "0"),))] == 2
    assert samples[("vsup_instance_metrics_up", (("instance", "1"),))] == 0
    assert ("vsup_instance_cpu_seconds_total", (("instance", "1"),)) not in samples
    assert samples[("vsup_metrics_collected_timestamp_seconds", ())] == 1700000000.0


# ---- collector.py over real fake vLLM processes ---------------------------------------------------------

async def test_collector_scrapes_and_measures_real_instances(fake_vllm):
    srv = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.001"}).wait_ready()
    refused = fake_vllm(name="x")  # started but we scrape a closed port in its name below
    refused.wait_ready()
    targets = [
        Target("0", srv.url, (0,), leader=srv.pid),
        Target("1", "http://127.0.0.1:9", (0,), leader=refused.pid),  # nothing listens on 9
        Target("2", None, (0,), leader=None),  # not serving, no process
    ]
    async with aiohttp.ClientSession() as session:
        collector = Collector(lambda: targets, session, interval=1.0, timeout=2.0, pids=tree_pids)
        await collector.collect()
        body = {"model": "fake-model", "prompt": "a b", "max_tokens": 40}
        async with session.post(f"{srv.url}/v1/completions", json=body) as response:
            assert response.status == 200
        await asyncio.sleep(0.3)
        snapshot = await collector.collect()
    first = collector.figures("0")
    assert first["scrape"] == "ok" and first["generation_tokens_total"] == 40
    assert first["generation_tokens_per_s"] > 0 and first["prompt_tokens_per_s"] > 0
    assert set(first["pids"]) == set(srv.pids()) and len(first["pids"]) == 3  # server, EngineCore, Worker
    assert first["cpu_percent"] is not None and first["rss_bytes"] > 10 * MiB
    assert first["numa_local_ratio"] == 1.0 and first["numa_bytes"] == {"0": first["numa_local_bytes"]}
    assert 0 <= first["age"] < 5
    assert collector.figures("1")["scrape"].startswith("Cannot connect") or collector.figures("1")["scrape"]
    assert collector.figures("1")["rss_bytes"] > 0  # its process is still measured
    two = collector.figures("2")  # once: each call computes its own "age"
    assert two == {**two, "scrape": None, "pids": [], "rss_bytes": None}
    text = snapshot.text.decode()
    assert 'vllm:generation_tokens_total{engine="0",instance="0",model_name="fake-model"} 40.0' in text
    assert 'vsup_instance_metrics_up{instance="1"} 0.0' in text
    assert 'instance="2"' not in text


async def test_pss_and_numa_are_read_at_most_every_page_walk_period(fake_vllm, monkeypatch):
    from vsup.observe import collector as collector_mod

    srv = fake_vllm().wait_ready()
    walks: list[int] = []
    real = numa.read_numa_bytes

    def counted(pid, *args, **kwargs):
        walks.append(pid)
        return real(pid, *args, **kwargs)

    monkeypatch.setattr(numa, "read_numa_bytes", counted)
    monkeypatch.setattr(collector_mod, "PAGE_WALK_EVERY", 0.5)
    pids = list(srv.pids())
    async with aiohttp.ClientSession() as session:
        collector = Collector(lambda: [Target("0", srv.url, (0,), leader=srv.pid)], session, interval=1.0, timeout=2.0,
                              pids=lambda target: pids)
        await collector.collect()
        first = collector.figures("0")
        assert len(walks) == len(pids) and first["pss_bytes"] and first["numa_bytes"]
        await collector.collect()  # within the period: the last walk's figures, no new walk
        again = collector.figures("0")
        assert len(walks) == len(pids)
        assert (again["pss_bytes"], again["numa_bytes"]) == (first["pss_bytes"], first["numa_bytes"])
        assert again["rss_bytes"] > 0 and again["cpu_seconds"] >= first["cpu_seconds"]  # these every round
        pids.pop()  # a process of the tree gone: walked again at once
        await collector.collect()
        assert len(walks) == 2 * len(pids) + 1
        await asyncio.sleep(0.6)
        await collector.collect()
        assert len(walks) == 3 * len(pids) + 1


async def test_a_hung_instance_costs_the_timeout_not_the_round(fake_vllm):
    hung = fake_vllm(env={"FAKE_VLLM_HANG_AFTER": "1"}).wait_ready()
    hung.wait_event("hang", timeout=10)
    async with aiohttp.ClientSession() as session:
        collector = Collector(lambda: [Target("0", hung.url, (0,))], session, interval=1.0, timeout=0.5, pids=tree_pids)
        began = time.monotonic()
        await collector.collect()
    assert time.monotonic() - began < 3
    assert collector.figures("0")["scrape"] == "no answer within 0.5s"


# ---- the proxy: cached text appended, /status only where added ----------------------------------------

async def test_proxy_appends_the_cached_text_and_serves_pages_behind_the_key():
    fakes = start_fakes(["a"])
    try:
        async with running_proxy(ready_pool(fakes), api_key="k3y") as proxy:
            proxy.extra_metrics = lambda: b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{instance=\"a\"} 7.0\n"
            text = await metrics_text(proxy, api_key="k3y")
            assert 'vllm:num_requests_running{instance="a"} 7.0' in text and "vsup_proxy_in_flight" in text
            async with aiohttp.ClientSession() as session:
                async with session.get(url(proxy, "/status")) as response:
                    assert response.status == 404  # a standalone proxy has no status page
                proxy.add_page("/status", status_page(lambda: SAMPLE_STATUS, 5.0))
                async with session.get(url(proxy, "/status")) as response:
                    assert response.status == 401
                    assert response.headers["WWW-Authenticate"].startswith("Basic")
                basic = "Basic " + base64.b64encode(b"anyone:k3y").decode()
                for header in ("Bearer k3y", basic):
                    async with session.get(url(proxy, "/status"), headers={"Authorization": header}) as response:
                        assert response.status == 200 and response.content_type == "text/html"
                        assert "<table" in await response.text()
                wrong = "Basic " + base64.b64encode(b"anyone:nope").decode()
                async with session.get(url(proxy, "/status"), headers={"Authorization": wrong}) as response:
                    assert response.status == 401
    finally:
        for fake in fakes:
            fake.cleanup()


class _Request:
    def __init__(self, authorization: str | None) -> None:
        self.authorization = authorization or ""


def test_browser_auth_takes_bearer_or_the_key_as_basic_password_only():
    auth = BearerAuth("k3y")
    assert auth.allows_browser(_Request("Bearer k3y"))
    assert auth.allows_browser(_Request("Basic " + base64.b64encode(b"u:k3y").decode()))
    assert not auth.allows_browser(_Request("Basic " + base64.b64encode(b"k3y:").decode()))
    assert not auth.allows_browser(_Request("Basic !!notbase64"))
    assert not auth.allows_browser(_Request(None))
    assert not auth.allows(_Request("Basic " + base64.b64encode(b"u:k3y").decode()))  # the API stays Bearer-only
    assert BearerAuth(None).allows_browser(_Request(None))


# ---- what people read -----------------------------------------------------------------------------------

METRICS = {"generation_tokens_per_s": 12.34, "requests_running": 2.0, "requests_waiting": 1.0, "kv_cache_usage": 0.125,
           "cpu_percent": 97.0, "rss_bytes": 3 * 1024**3, "pss_bytes": 2 * 1024**3, "numa_local_ratio": 0.9,
           "numa_remote_bytes": 300 * MiB, "age": 1.0, "something_new": 1}
SAMPLE_STATUS = {
    "vsup": {"pid": 42, "uptime": 3700, "proxy": "127.0.0.1:8000", "ready": 1, "in_flight": 3, "metrics_interval": 5.0,
             "reload": {"state": "idle"}},  # a field another part of vsup may add
    "instances": [
        {"index": 0, "state": "ready", "pid": 100, "port": 8100, "cpus": [0, 1], "nodes": [0], "uptime": 3600,
         "restarts": 0, "in_flight": 3, "placement_ok": True, "last_exit": None, "metrics": METRICS, "warmup": "done",
         "transitions": [{"at": 1.0, "from": "stopped", "to": "starting", "event": "start", "reason": "start"},
                         {"at": 5.0, "from": "starting", "to": "ready", "event": "healthy", "reason": "/health 200"}]},
        {"index": 1, "state": "backoff", "pid": None, "port": 8101, "cpus": [2, 3], "nodes": [1], "uptime": None,
         "restarts": 2, "next_start_in": 4.2, "placement_ok": None, "last_exit": "exited with code 1 <script>x</script>",
         "metrics": None,
         "transitions": [{"at": 3000.0, "from": "ready", "to": "stopping", "event": "exited", "reason": "code <1>"}]},
    ],
}


def test_units():
    assert (fmt.size(None), fmt.size(512), fmt.size(1536), fmt.size(3 * 1024**3), fmt.size(20 * MiB)) == ("-", "512B", "1.5K", "3.0G", "20M")
    assert (fmt.percent(0.125), fmt.percent(None), fmt.number(2.0), fmt.number(12.34, 1)) == ("12%", "-", "2", "12.3")
    assert (fmt.duration(59), fmt.duration(61), fmt.duration(3700), fmt.duration(90000)) == ("59s", "1m01s", "1h01m", "1d01h")


def test_status_text_shows_the_figures_and_dashes_where_there_are_none():
    lines = render_instances(SAMPLE_STATUS["instances"])
    assert lines[0].split()[11:18] == ["TOK/S", "RUN", "WAIT", "KV", "CPU%", "RSS", "LOCAL"]
    assert lines[1].split()[11:18] == ["12.3", "2", "1", "12%", "97", "3.0G", "90%"]
    assert lines[2].split()[12:19] == ["-"] * 7  # "backoff (4s)" is two words


def test_top_view_renders_every_instance_and_tolerates_new_fields():
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(view(SAMPLE_STATUS, None, 2.0))
    out = console.file.getvalue()
    assert "1/2 ready" in out and "12.3 tok/s" in out and "figures every 5s" in out
    row0 = next(line for line in out.splitlines() if line.lstrip().startswith("0 "))
    assert row0.split()[:2] == ["0", "ready"] and "12.3" in row0 and "3.0G" in row0 and "90%" in row0
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(view({"vsup": {}, "instances": []}, "vsup did not answer", 2.0))
    assert "not answering: vsup did not answer" in console.file.getvalue()


def test_status_page_escapes_and_lists_transitions_newest_first():
    page = render_page(SAMPLE_STATUS, 5)
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "code &lt;1&gt;" in page
    assert page.index("stopping") < page.index("/health 200") < page.index(">start<")
    assert "90% (300M remote)" in page and "backoff (4s)" in page
