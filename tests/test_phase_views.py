"""A starting instance's phase in every view: `vsup status` (text), `vsup top`, the /status page and
the start families of /metrics; vLLM's waiting line explained next to its phase, shown as data
(escaped) wherever it appears."""

from __future__ import annotations

import copy
import io
import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from tests.test_observe import SAMPLE_STATUS
from tests.test_untrusted_text import HOSTILE, SGR, SHOWN
from vsup.cli.status import render_instances
from vsup.cli.top import view
from vsup.observe import fmt
from vsup.observe.families import start_families
from vsup.observe.page import render_page

GIB = 1024**3
SHM_WAIT = ("(EngineCore pid=4180) INFO 12-01 10:02:11 [shm_broadcast.py:466] No available shared memory broadcast block "
            "found in 60 seconds. This typically happens when some processes are hanging or doing some time-consuming work")


def starting_status(line: str = SHM_WAIT) -> dict:
    """SAMPLE_STATUS with a third instance compiling (vLLM said it waits, twice) and a fourth loading."""
    status = copy.deepcopy(SAMPLE_STATUS)
    base = {"pid": 300, "cpus": [4], "nodes": [0], "uptime": 190, "restarts": 0, "in_flight": 0, "placement_ok": None,
            "last_exit": None, "metrics": None, "transitions": [], "name": ""}
    status["instances"] += [
        {**base, "index": 2, "name": "2", "port": 8102, "state": "starting",
         "phase": {"name": "compiling", "text": "torch.compile's warm-up", "for": 132.4, "idle": 1.0, "judged": True,
                   "shards": None, "percent": None, "read_bytes": None, "weights_bytes": None,
                   "waiting": {"line": line, "count": 2, "note": "normal while compiling: vLLM's engine waits for its worker"},
                   "took": {"booting": 40.0, "loading": 30.0, "compiling": 132.4}}},
        {**base, "index": 3, "name": "3", "port": 8103, "state": "starting",
         "phase": {"name": "loading", "text": "reading the weights", "for": 31.0, "idle": 45.0, "judged": True,
                   "shards": [1, 2], "percent": 50, "read_bytes": 2 * GIB, "weights_bytes": 5 * GIB, "waiting": None,
                   "took": {"booting": 40.0, "loading": 31.0}}},
    ]
    return status


def test_the_phase_cell_says_where_a_start_is_and_for_how_long():
    _, _, compiling, loading = starting_status()["instances"]
    assert fmt.phase(compiling) == "compiling 2m12s"
    assert fmt.phase(loading) == "loading 31s · 1/2 shards · 2.0G/5.0G read · idle 45s"
    assert fmt.phase(SAMPLE_STATUS["instances"][0]) == "-"
    note = fmt.phase_note(compiling)
    assert note.startswith('vLLM (2×): "No available shared memory broadcast block found in 60 seconds. ')
    assert note.endswith("…\" — normal while compiling: vLLM's engine waits for its worker")
    assert fmt.phase_note(loading) is None


def test_vsup_status_shows_the_phase_column_and_the_explained_waiting_line():
    lines = render_instances(starting_status()["instances"])
    assert lines[0].split()[:3] == ["IDX", "STATE", "PHASE"]
    cells = {line.split()[0]: [c for c in re.split(r"\s{2,}", line) if c] for line in lines[1:5]}
    assert cells["2"][1:4] == ["starting", "compiling 2m12s", "300"]
    assert cells["3"][1:4] == ["starting", "loading 31s · 1/2 shards · 2.0G/5.0G read · idle 45s", "300"]
    (note,) = [line for line in lines if line.startswith("  instance 2 compiling: vLLM (2×)")]
    assert "normal while compiling" in note


def test_top_shows_the_phase_and_the_note_below_the_table():
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(view(starting_status(), None, 2.0))
    out = console.file.getvalue()
    row = next(line for line in out.splitlines() if line.lstrip().startswith("2 "))
    assert row.split()[:4] == ["2", "starting", "compiling", "2m12s"]
    assert "2 compiling: vLLM (2×): \"No available shared memory" in out and "normal while compiling" in out


def test_the_status_page_has_a_phase_column_with_the_note_under_it():
    page = render_page(starting_status(), 5)
    assert "<th>Phase</th>" in page
    assert '<td class="wrap">compiling 2m12s<br><span class="note">vLLM (2×): &quot;No available shared memory' in page
    assert "loading 31s · 1/2 shards · 2.0G/5.0G read · idle 45s" in page


def test_an_instances_waiting_line_is_data_in_every_view():
    status = starting_status(f"INFO [shm_broadcast.py:466] {HOSTILE}")  # (what a note shows of it: its first 100 characters)
    text = "\n".join(render_instances(status["instances"]))
    console = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=400)
    console.print(view(status, None, 2.0))
    top = console.file.getvalue()
    page = render_page(status, 5)
    for shown in (text, SGR.sub("", top)):
        assert "\x1b" not in shown and "\u202e" not in shown and "\x9b" not in shown, repr(shown)
        for piece in SHOWN[:3] + SHOWN[5:]:  # the markup-looking ones as written, the controls as escapes
            assert piece in shown, (piece, shown)
    assert "\u202e" not in page and "\x1b" not in page and "[link=http://evil]y[/link]" in page and "\\u202eevil" in page
    assert not re.search(r"<(?!/?(?:td|span|br|tr|th|table|tbody|thead|h[12]|div|code|footer|meta|title|style|head|body|html|!DOCTYPE)\b)",
                         page.split("<body>", 1)[1])


def test_the_start_families_carry_each_starting_instances_phase_and_parse():
    registry = CollectorRegistry(auto_describe=False)

    class Collect:
        def collect(self):
            return start_families(starting_status()["instances"])

    registry.register(Collect())  # type: ignore[arg-type]
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    phases = {(s.labels["instance"], s.labels["phase"]): s.value for s in families["vsup_instance_start_phase"].samples}
    assert phases == {("2", "compiling"): 1.0, ("3", "loading"): 1.0}  # the ready and backoff instances have none
    assert {s.labels["instance"]: s.value for s in families["vsup_instance_start_phase_seconds"].samples} == {"2": 132.4, "3": 31.0}
    assert {s.labels["instance"]: s.value for s in families["vsup_instance_start_idle_seconds"].samples} == {"2": 1.0, "3": 45.0}
    assert [(s.labels["instance"], s.value) for s in families["vsup_instance_start_read_bytes"].samples] == [("3", 2 * GIB)]
    assert [(s.labels["instance"], s.value) for s in families["vsup_instance_start_weights_bytes"].samples] == [("3", 5 * GIB)]
    assert all(s.labels["model"] == "" for f in families.values() for s in f.samples)  # (these have none)
