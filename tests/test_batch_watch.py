"""vsup/batch/watch.py over a real SQLite store: the status JSON's `batches` (running with rate and
ETA, validating, recently ended), the figures /metrics renders (proxy/metrics.py's vsup_batch_*
families, read by promtool), and nothing of a tenant's (batch ids, owners, custom_ids) as a label.
(The store's own counts of the line outcomes are tested in test_batch_store.py.)"""

from __future__ import annotations

import io
import json
import subprocess

import pytest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.tools import need_tool
from vsup.batch.store import Limits, Store
from vsup.batch.watch import RECENT, Watch
from vsup.proxy.metrics import ProxyMetrics, batch_families

HOSTILE = "\x1b]0;owned\x07\u202egnp.exe <script>alert(1)</script>"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def jsonl(model_lines: list[tuple[str, str]]) -> bytes:
    return b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"
                    for cid, model in model_lines)


def new_batch(store: Store, owner: str, lines: list[tuple[str, str]], metadata: dict | None = None) -> str:
    data = jsonl(lines)
    file = store.add_file(owner, "in.jsonl", "batch", io.BytesIO(data), len(data))
    batch = store.create(owner, file["id"], "/v1/chat/completions", "24h", metadata)
    store.validate(batch["id"], None)
    return batch["id"]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    opened = Store.open(tmp_path / "batches", Limits(max_attempts=2), clock)
    yield opened
    opened.close()


def test_the_status_shows_running_batches_with_rate_and_eta(store, clock):
    batch_id = new_batch(store, "team-a", [(f"c{i}", "chat") for i in range(100)], {"note": HOSTILE})
    watch = Watch(store, clock)
    for _ in range(4):  # 2 lines/s for 30 s, looked at every 10 s
        clock.now += 10
        for line in store.claim(batch_id, 20, "chat"):
            store.record(line, 200, b"{}", "r")
        [entry] = watch.status()
    assert entry["id"] == batch_id and entry["status"] == "in_progress"
    assert (entry["total"], entry["completed"], entry["failed"], entry["pending"], entry["running"]) == (100, 80, 0, 20, 0)
    assert entry["rate"] == pytest.approx(2.0)
    assert entry["eta"] == pytest.approx(10.0)
    assert entry["owner"] == "team-a" and entry["models"] == ["chat"] and entry["endpoint"] == "/v1/chat/completions"
    assert entry["metadata"] == {"note": HOSTILE}  # as the client sent it: the views escape it
    assert "key" not in json.dumps(entry)


def test_validating_and_lately_ended_batches_are_listed_then_dropped(store, clock):
    watch = Watch(store, clock)
    done = new_batch(store, "team-a", [("x", "chat")])
    watch.status()  # seen running: its models are remembered for after its end
    [line] = store.claim(done, 1)
    store.record(line, 200, b"{}", "r")
    store.finalize(done)
    data = jsonl([("y", "chat")])
    file = store.add_file("team-b", "in.jsonl", "batch", io.BytesIO(data), len(data))
    waiting = store.create("team-b", file["id"], "/v1/chat/completions", "24h", None)["id"]
    by_id = {e["id"]: e for e in watch.status()}
    assert by_id[done]["status"] == "completed" and by_id[done]["ended_at"] == int(clock.now)
    assert (by_id[done]["completed"], by_id[done]["rate"], by_id[done]["owner"], by_id[done]["models"]) == (1, None, "team-a", ["chat"])
    assert by_id[waiting]["status"] == "validating" and by_id[waiting]["owner"] == "team-b"
    clock.now += RECENT + 1
    assert [e["id"] for e in watch.status()] == [waiting]


def watched_metrics(watch: Watch) -> ProxyMetrics:
    metrics = ProxyMetrics(dict, dict, lambda name: False)
    figures = watch.figures()
    assert figures is not None
    metrics.families.append(lambda: batch_families(figures))
    return metrics


def metrics_text(watch: Watch) -> str:
    return watched_metrics(watch).render().decode()


def test_the_metrics_name_models_and_states_never_a_tenants_ids(store, clock):
    owner = "tenant-secret-name"
    batch_id = new_batch(store, owner, [("custom-xyz", "chat"), ("c2", "chat"), ("c3", "chat")], {"note": HOSTILE})
    lines = store.claim(batch_id, 2)
    store.record(lines[0], 200, b"{}", "r")
    text = metrics_text(Watch(store, clock))
    assert 'vsup_batch_lines_total{model="chat",outcome="completed"} 1.0' in text
    assert 'vsup_batch_lines_open{model="chat",state="pending"} 1.0' in text
    assert 'vsup_batch_lines_open{model="chat",state="running"} 1.0' in text
    assert 'vsup_batch_batches{status="in_progress"} 1.0' in text
    assert 'vsup_batch_batches{status="completed"} 0.0' in text
    store_bytes = next(line for line in text.splitlines() if line.startswith("vsup_batch_store_bytes "))
    assert float(store_bytes.split()[1]) == store.usage() > 0
    for secret in (batch_id, owner, "custom-xyz", "owned", "script"):
        assert secret not in text
    promtool = need_tool("promtool", package="prometheus")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr  # parses, and vsup's own families lint clean


def test_the_batch_families_parse_as_openmetrics(store, clock):
    """No family's name is another's base: a gauge vsup_batch_lines beside the counter of that name
    (served as vsup_batch_lines_total) is refused by an OpenMetrics parser."""
    batch_id = new_batch(store, "team-a", [("c1", "chat"), ("c2", "chat")])
    [line] = store.claim(batch_id, 1)
    store.record(line, 200, b"{}", "r")
    text = openmetrics.generate_latest(watched_metrics(Watch(store, clock)).registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vsup_batch_lines"].type == "counter"
    assert families["vsup_batch_lines_open"].type == "gauge"
    assert {(s.labels["state"], s.value) for s in families["vsup_batch_lines_open"].samples} == {("pending", 1), ("running", 0)}


def test_a_store_that_cannot_be_read_leaves_the_status_and_metrics_answering(store, clock, caplog):
    watch = Watch(store, clock)
    new_batch(store, "team-a", [("x", "chat")])
    store.close()  # (a closed connection: every read raises sqlite3.ProgrammingError)
    assert watch.status() == [] and watch.figures() is None
    assert "batch store: the status could not read it" in caplog.text
