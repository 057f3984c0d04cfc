"""Every view of a running vsup shows every model: the status JSON (`model` per instance, a
`models` list), systemd's STATUS=, `vsup status`, `vsup top`, the /status page and the collector's
`model` label. A fleet of one looks as before. A model's name comes from the config and clients
send it too: it is data wherever it shows (no markup, no terminal escape, no HTML).

The running vsup is a real Supervisor in-process (real proxy and control socket, the instances'
processes faked: tests/lifecycle_fakes.py) whose plan gives its instances two models; the collector
scrapes real fake-vLLM processes."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import re
import signal

import aiohttp
import pytest
import yaml
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from tests.host_fakes import RecordingHost
from tests.lifecycle_fakes import FakeOps
from tests.sysfs_builder import build_sysfs
from tests.test_metrics_merge import promtool_parses
from tests.test_observe import METRICS, SAMPLE_STATUS
from tests.test_supervisor_inprocess import reload_config, until
from vsup.cli.status import render_instances, render_models, status_command
from vsup.cli.top import view
from vsup.config.schema import load_config
from vsup.observe import by_model, scrape
from vsup.observe.collector import Collector, Target
from vsup.observe.page import render_page
from vsup.supervisor.control import request
from vsup.supervisor.metrics import tree_pids
from vsup.supervisor.preflight import checked_plan
from vsup.supervisor.status import status_line
from vsup.supervisor.supervisor import Supervisor
from vsup.systemd.notify import Notifier

pytestmark = pytest.mark.timeout(90)

# what a config may call a model: markup, HTML, a terminal title, a bidi override, quotes
HOSTILE = 'emb</td><script>x</script>[bold]b[/] \x1b]0;t\x07 \u202er "q\\'
HOSTILE_SHOWN = 'emb</td><script>x</script>[bold]b[/] \\x1b]0;t\\x07 \\u202er "q\\'  # printable()
SGR = re.compile(r"\x1b\[[0-9;]*m")


def two_models(name: str = "embed") -> dict:
    """SAMPLE_STATUS with a third instance: chat (0, 1 in backoff) and `name` (2, ready)."""
    status = copy.deepcopy(SAMPLE_STATUS)
    status["instances"][0]["model"] = status["instances"][1]["model"] = "chat"
    third = {**copy.deepcopy(status["instances"][0]), "index": 2, "pid": 102, "port": 8102, "cpus": [4, 5], "model": name,
             "in_flight": 1, "metrics": {**METRICS, "generation_tokens_per_s": 0.5}}
    status["instances"].append(third)
    status["vsup"].update(ready=2, in_flight=4)
    status["models"] = by_model.summarize(status["instances"], ["chat", name])
    return status


def one_model() -> dict:
    """SAMPLE_STATUS as a vsup with models writes it for a single-model config."""
    status = copy.deepcopy(SAMPLE_STATUS)
    for e in status["instances"]:
        e["model"] = "m"
    status["models"] = by_model.summarize(status["instances"])
    return status


def shown(renderable) -> str:
    console = Console(file=io.StringIO(), width=260, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


# ---- by_model.py ------------------------------------------------------------------------------------------

def test_models_are_grouped_in_the_configs_order_with_their_states_counted():
    instances = [{"index": 0, "model": "b", "state": "ready", "in_flight": 2}, {"index": 3, "model": "a", "state": "failed"},
                 {"index": 1, "model": "b", "state": "starting", "in_flight": 1}, {"index": 2, "model": "c", "state": "ready"}]
    models = by_model.summarize(instances, ["a", "b"])
    assert [m["name"] for m in models] == ["a", "b", "c"]  # the config's order, then the others as they come
    assert models[1] == {"name": "b", "instances": [0, 1], "ready": 1, "states": {"ready": 1, "starting": 1}, "in_flight": 3}
    assert by_model.ready_text(models[0]) == "a 0/1 ready" and by_model.not_ready(models[1]) == "1 starting"
    assert by_model.models({"instances": instances[:1]}) == [by_model.summarize(instances[:1])[0]]  # an older vsup: computed
    assert not by_model.several({"instances": [{"index": 0, "state": "ready"}]})  # no model at all: a fleet of one


# ---- the views of a status with two models --------------------------------------------------------------

def test_vsup_status_text_has_a_model_column_and_a_line_per_model():
    status = two_models()
    lines = render_instances(status["instances"], models=True)
    assert lines[0].split()[:3] == ["IDX", "MODEL", "STATE"]
    assert [line.split()[:3] for line in lines[1:4]] == [["0", "chat", "ready"], ["1", "chat", "backoff"], ["2", "embed", "ready"]]
    assert lines[1].split()[12:19] == ["12.3", "2", "1", "12%", "97", "3.0G", "90%"]  # after MODEL and PHASE, intact
    assert render_models(status) == [
        "model chat: 1/2 ready (1 backoff), 3 in flight, 12.3 tok/s, instances 0-1",
        "model embed: 1/1 ready, 1 in flight, 0.5 tok/s, instances 2",
    ]


def test_top_groups_the_rows_under_each_models_totals():
    out = shown(view(two_models(), None, 2.0))
    lines = out.splitlines()
    assert "2/3 ready" in lines[0] and "12.8 tok/s" in lines[0]
    assert "chat 1/2 ready" in lines[1] and "embed 1/1 ready" in lines[1]  # the models' line under the head
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "MODEL", "STATE"])
    rows = [line.split() for line in lines[head + 1:] if re.match(r"^\s*(\d+\s+)?(chat|embed)\s", line)]
    assert [row[:3] for row in rows] == [["chat", "1/2", "ready"], ["0", "chat", "ready"], ["1", "chat", "backoff"],
                                         ["embed", "1/1", "ready"], ["2", "embed", "ready"]]
    total = rows[0]
    assert total[3:7] == ["3", "12.3", "2", "1"]  # in flight, tok/s, running, waiting of chat's instances
    assert rows[3][3:5] == ["1", "0.5"]


def test_the_status_page_has_a_models_table_and_a_model_column():
    page = render_page(two_models(), 5)
    models = page.split('<table id="models">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", models, re.S)
    cells = [[re.sub(r"<[^>]+>", "", c) for c in found] for row in rows if (found := re.findall(r"<td[^>]*>(.*?)</td>", row))]
    assert cells == [["chat", "1/2", "1 backoff", "0-1", "3", "12.3"], ["embed", "1/1", "-", "2", "1", "0.5"]]
    head = page.split('<table id="instances">', 1)[1].split("</thead>", 1)[0]
    assert re.findall(r"<th>(.*?)</th>", head)[:3] == ["#", "Model", "State"]
    instances = page.split('<table id="instances">', 1)[1].split("</table>", 1)[0]
    assert [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<tr><td>(\d+)</td><td>(.*?)</td>", instances, re.S)
            for c in c[1:]] == ["chat", "chat", "embed"]


def test_a_single_model_looks_exactly_as_before():
    before, after = SAMPLE_STATUS, one_model()  # a status without models, and the same with its one model named
    assert render_page(after, 5) == render_page(before, 5) and "Model" not in render_page(after, 5)
    assert render_instances(after["instances"]) == render_instances(before["instances"])
    assert shown(view(after, None, 2.0)) == shown(view(before, None, 2.0))
    assert "MODEL" not in shown(view(after, None, 2.0))


def test_a_hostile_model_name_is_shown_as_written_and_steers_nothing():
    status = two_models(HOSTILE)
    page = render_page(status, 5)
    assert "<script>" not in page and "</td><script>" not in page and "\x1b" not in page and "\u202e" not in page
    assert "emb&lt;/td&gt;&lt;script&gt;x&lt;/script&gt;[bold]b[/] \\x1b]0;t\\x07 \\u202er &quot;q\\" in page
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="truecolor", width=400).print(view(status, None, 2.0))
    text = out.getvalue()
    assert "\x1b" not in SGR.sub("", text) and "\u202e" not in text, repr(text)  # colours only
    assert HOSTILE_SHOWN in SGR.sub("", text)  # [bold]b[/] as written, not read as markup
    lines = [*render_models(status), *render_instances(status["instances"], models=True)]
    assert all("\x1b" not in line and "\u202e" not in line for line in lines)
    assert any(HOSTILE_SHOWN in line for line in lines[:2])


# ---- a running vsup: a real Supervisor whose plan has two models ---------------------------------------------

class TwoModelVsup:
    """A Supervisor over FakeOps, run in-process, its four instances serving chat (0, 1) and
    `second` (2, 3) as a fleet plan names them; `models=False`: the plan as a single-model config makes it."""

    def __init__(self, tmp_path, second: str = "embed", models: bool = True) -> None:
        fsroot = build_sysfs(tmp_path / "machine", nodes=(4, 4))
        path = tmp_path / "vsup.yaml"
        path.write_text(yaml.safe_dump(reload_config(tmp_path, instances=4)))
        config = load_config(path)
        _machine, plan = checked_plan(config, str(fsroot), {}, runs_here=True)
        if models:
            names = ["chat", "chat", second, second]
            plan = dataclasses.replace(plan, instances=tuple(
                dataclasses.replace(inst, model=names[inst.index], replica=inst.index % 2) for inst in plan.instances))
        self.ops = FakeOps(load_time=2.0, stop_time=0.5)
        self.notes: list[str] = []
        self.sup = Supervisor(config, plan, config_path=str(path), notifier=Recorder(self.notes),
                              environ={"TMPDIR": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}, ops=self.ops, host=RecordingHost(), fsroot=str(fsroot))
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.sup.run())
        await self.until(lambda: len(self.sup.instances) == 4 and self.sup.status()["vsup"]["ready"] == 4, "every instance ready")

    async def until(self, predicate, what: str) -> None:
        await until(lambda: predicate() or (self.task is not None and self.task.done()), self.ops.clock, what)
        assert self.task is None or not self.task.done(), f"vsup ended while waiting for {what}"

    async def run(self, coroutine):
        job = asyncio.ensure_future(coroutine)
        await self.until(job.done, "the request to finish")
        return job.result()

    async def stop(self) -> None:
        self.sup._on_stop_signal(signal.SIGTERM)
        await until(self.task.done, self.ops.clock, "vsup stopped")


class Recorder(Notifier):
    """The STATUS= lines vsup sends systemd."""

    def __init__(self, notes: list[str]) -> None:
        super().__init__(None)
        self.notes = notes

    def ready(self, status: str | None = None) -> None:
        self.notes.append(f"READY {status}")

    def status(self, text: str) -> None:
        self.notes.append(text)


@pytest.fixture
async def running(tmp_path):
    made: list[TwoModelVsup] = []

    async def start(**kwargs) -> TwoModelVsup:
        vsup = TwoModelVsup(tmp_path, **kwargs)
        made.append(vsup)
        await vsup.start()
        return vsup

    yield start
    for vsup in made:
        if vsup.task is not None and not vsup.task.done():
            await vsup.stop()


def cli_status(path, *args: str) -> str:
    result = CliRunner().invoke(status_command, ["--socket", str(path), *args])
    assert result.exit_code == 0, result.output
    return result.output


async def test_a_running_vsup_shows_both_models_in_every_view(running):
    vsup = await running()
    sup = vsup.sup
    data = await vsup.run(request(sup.control.path, "GET", "/status", timeout=10))
    assert [e["model"] for e in data["instances"]] == ["chat", "chat", "embed", "embed"]
    assert data["models"] == [
        {"name": "chat", "instances": [0, 1], "ready": 2, "states": {"ready": 2}, "in_flight": 0},
        {"name": "embed", "instances": [2, 3], "ready": 2, "states": {"ready": 2}, "in_flight": 0},
    ]
    assert status_line(sup) == "chat 2/2 ready, embed 2/2 ready, 0 in flight"
    assert any(note.startswith("READY chat ") or note.startswith("chat 2/2 ready, embed 2/2 ready") for note in vsup.notes)
    text = await vsup.run(asyncio.to_thread(cli_status, sup.control.path))  # `vsup status` over the control socket
    lines = text.splitlines()
    assert lines[1:3] == ["model chat: 2/2 ready, 0 in flight, 0.0 tok/s, instances 0-1",
                          "model embed: 2/2 ready, 0 in flight, 0.0 tok/s, instances 2-3"]
    assert lines[3].split()[:3] == ["IDX", "MODEL", "STATE"] and lines[6].split()[:3] == ["2", "embed", "ready"]
    assert [(t.name, t.model) for t in sup.metrics.targets()] == [("0", "chat"), ("1", "chat"), ("2", "embed"), ("3", "embed")]

    async def page() -> str:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{sup.proxy.port}/status") as response:
            assert response.status == 200
            return await response.text()

    body = await vsup.run(page())
    assert '<table id="models">' in body and body.count("<td>embed</td>") == 3  # its Models row and its two instances

    # one model down, the other serving: the views and STATUS= say which
    for process in vsup.ops.processes[2:4]:
        process.exit(1)
    await vsup.until(lambda: sup.status()["models"][1]["ready"] == 0, "embed's instances down")
    assert status_line(sup).startswith("chat 2/2 ready, embed 0/2 ready, 0 in flight")
    assert vsup.notes[-1].startswith("chat 2/2 ready, embed 0/2 ready")
    assert "model embed: 0/2 ready (" in await vsup.run(asyncio.to_thread(cli_status, sup.control.path))


async def test_a_running_single_model_vsup_says_what_it_said_before(running):
    vsup = await running(models=False)
    sup = vsup.sup
    data = sup.status()
    assert {e["model"] for e in data["instances"]} == {"m"}  # the config's one model, named
    assert data["models"] == [{"name": "m", "instances": [0, 1, 2, 3], "ready": 4, "states": {"ready": 4}, "in_flight": 0}]
    assert status_line(sup) == "4/4 instances ready, 0 in flight"
    text = await vsup.run(asyncio.to_thread(cli_status, sup.control.path))
    assert "MODEL" not in text and "model m" not in text and text.splitlines()[1].split()[:2] == ["IDX", "STATE"]


async def test_a_hostile_model_name_in_status_line_and_cli_is_one_line_of_plain_text(running):
    vsup = await running(second=HOSTILE)
    line = status_line(vsup.sup)
    assert line == f"chat 2/2 ready, {HOSTILE_SHOWN} 2/2 ready, 0 in flight"
    assert "\n" not in line and "\x1b" not in line
    text = await vsup.run(asyncio.to_thread(cli_status, vsup.sup.control.path))
    assert "\x1b" not in text and "\u202e" not in text and f"model {HOSTILE_SHOWN}: 2/2 ready" in text


# ---- the collector: a model label beside instance ---------------------------------------------------------

def sample_labels(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


async def test_the_collector_labels_each_instances_series_with_its_model(fake_vllm):
    chat = fake_vllm(env={"FAKE_VLLM_TOKEN_DELAY": "0.001"}).wait_ready()
    other = fake_vllm(name="other", env={"FAKE_VLLM_TOKEN_DELAY": "0.001"}).wait_ready()
    targets = [Target("0", chat.url, (0,), leader=chat.pid, model="chat"),
               Target("1", other.url, (0,), leader=other.pid, model=HOSTILE)]
    async with aiohttp.ClientSession() as session:
        collector = Collector(lambda: targets, session, interval=1.0, timeout=2.0, pids=tree_pids)
        for target in (chat, other):
            async with session.post(f"{target.url}/v1/completions", json={"model": "fake-model", "prompt": "a", "max_tokens": 3}) as r:
                assert r.status == 200
        snapshot = await collector.collect()
    text = snapshot.text.decode()
    tokens = sample_labels(text, "vllm:generation_tokens_total")
    assert sorted((labels["instance"], labels["model"]) for labels in tokens) == [("0", "chat"), ("1", HOSTILE)]  # exactly, parsed back
    assert all(labels["model_name"] == "fake-model" for labels in tokens)  # vLLM's own label stays
    for family in ("vsup_instance_rss_bytes", "vsup_instance_metrics_up", "vsup_instance_cpu_seconds_total"):
        assert sorted((labels["instance"], labels["model"]) for labels in sample_labels(text, family)) == [("0", "chat"), ("1", HOSTILE)]
    assert {labels["model"] for labels in sample_labels(text, "vsup_instance_numa_memory_bytes")} == {"chat", HOSTILE}
    promtool_parses(text)  # Prometheus itself reads the quoted name back


def test_an_instances_own_model_label_is_kept_as_exported_model():
    families = scrape.parse('# TYPE x gauge\nx{model="theirs",instance="i"} 1\n')
    sample = scrape.relabel(families, "3", "chat")[0].samples[0]
    assert sample.labels == {"instance": "3", "model": "chat", "exported_model": "theirs", "exported_instance": "i"}
    assert scrape.relabel(families, "3")[0].samples[0].labels == {"instance": "3", "model": "theirs", "exported_instance": "i"}
