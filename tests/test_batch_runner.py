"""The batch runner over the real Store (SQLite in tmp_path) with a fake `send`: every line gets
one result, "not now" answers and transport failures are tried again up to batch.max_attempts,
a busy proxy costs no attempt, room() bounds the lines in flight, a removed model fails its lines,
a stop mid-batch resumes after the store is opened again (exactly one result per custom_id), and
a batch past its window expires."""

from __future__ import annotations

import asyncio
import io
import json
from collections import Counter
from pathlib import Path

import pytest

from vsup.batch.runner import Busy, Runner, refusal
from vsup.batch.store import Limits, Store

ENDPOINT = "/v1/chat/completions"
DONE = ("completed", "failed", "expired", "cancelled")


def jsonl(ids: list[str], model: str = "m", models: dict[str, str] | None = None) -> bytes:
    lines = []
    for cid in ids:
        body = {"model": (models or {}).get(cid, model), "messages": [{"role": "user", "content": cid}]}
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": ENDPOINT, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def submit(store: Store, data: bytes) -> str:
    file = store.add_file("alice", "in.jsonl", "batch", io.BytesIO(data), len(data))
    return store.create("alice", file["id"], ENDPOINT, "24h", None)["id"]


def cid_of(body: bytes) -> str:
    return json.loads(body)["messages"][0]["content"]


def answer(cid: str) -> tuple[int, bytes, str]:
    return 200, json.dumps({"id": f"chatcmpl-{cid}", "object": "chat.completion", "echo": cid}).encode(), f"req-{cid}"


def output(store: Store, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in b"".join(store.content(file_id, None)).splitlines()]


async def finished(store: Store, batch_id: str, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        batch = store.batch(batch_id, None)
        if batch["status"] in DONE:
            return batch
        assert asyncio.get_running_loop().time() < deadline, f"batch still {batch['status']}: {batch['request_counts']}"
        await asyncio.sleep(0.01)


@pytest.fixture
def store(tmp_path: Path):
    opened = Store.open(tmp_path / "batches", Limits())
    yield opened
    opened.close()


class Send:
    """A fake sender: a script per custom_id of what each call does (an answer, an exception), then 200."""

    def __init__(self, script: dict[str, list] | None = None, delay: float = 0.0) -> None:
        self.script = script or {}
        self.calls: Counter[str] = Counter()
        self.delay = delay
        self.in_flight = 0
        self.most = 0

    async def __call__(self, endpoint: str, body: bytes, owner: str) -> tuple[int, bytes, str]:
        assert endpoint == ENDPOINT and owner == "alice"
        cid = cid_of(body)
        self.calls[cid] += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            steps = self.script.get(cid)
            step = steps.pop(0) if steps else None
            if isinstance(step, BaseException) or (isinstance(step, type) and issubclass(step, BaseException)):
                raise step
            if isinstance(step, int):
                return step, json.dumps({"error": {"message": f"status {step} for {cid}"}}).encode(), ""
            return answer(cid)
        finally:
            self.in_flight -= 1


async def run_until_done(store: Store, send, batch_id: str, room=lambda model: 8, models=lambda model: True) -> dict:
    runner = Runner(store, send, room, models, poll=0.01)
    runner.start()
    try:
        return await finished(store, batch_id)
    finally:
        await runner.stop()


async def test_every_line_gets_one_result_in_line_order(store):
    ids = [f"q{i}" for i in range(12)]
    batch_id = submit(store, jsonl(ids))
    send = Send()
    batch = await run_until_done(store, send, batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    lines = output(store, batch["output_file_id"])
    assert [line["custom_id"] for line in lines] == ids
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    assert lines[3]["response"]["body"]["echo"] == "q3" and lines[3]["response"]["request_id"] == "req-q3"
    assert batch["error_file_id"] is None
    assert send.calls == Counter(ids)


async def test_not_now_answers_are_tried_again_up_to_max_attempts(store):
    batch_id = submit(store, jsonl(["once", "always", "broken", "refused"]))
    send = Send({"once": [503], "always": [429, 502, 504], "broken": [ConnectionResetError("gone")] * 3, "refused": [400]})
    batch = await run_until_done(store, send, batch_id)
    assert batch["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert send.calls == Counter({"once": 2, "always": 3, "broken": 3, "refused": 1})
    errors = {line["custom_id"]: line for line in output(store, batch["error_file_id"])}
    assert errors["always"]["error"]["code"] == "attempts_exhausted"
    assert "504" in errors["always"]["error"]["message"]
    assert errors["broken"]["error"]["code"] == "attempts_exhausted" and "gone" in errors["broken"]["error"]["message"]
    # a client error is the line's answer, not a retry: it goes to the error file as it came
    assert errors["refused"]["response"]["status_code"] == 400 and errors["refused"]["error"] is None
    assert [line["custom_id"] for line in output(store, batch["output_file_id"])] == ["once"]


async def test_a_busy_proxy_costs_no_attempt(store):
    batch_id = submit(store, jsonl(["a", "b"]))
    send = Send({"a": [Busy] * 7})  # more refusals than max_attempts: none is an attempt
    batch = await run_until_done(store, send, batch_id)
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert send.calls["a"] == 8


async def test_room_bounds_the_lines_in_flight(store):
    batch_id = submit(store, jsonl([f"q{i}" for i in range(20)]))
    send = Send(delay=0.02)
    batch = await run_until_done(store, send, batch_id, room=lambda model: max(0, 3 - send.in_flight))
    assert batch["request_counts"]["completed"] == 20
    assert send.most == 3


async def test_a_removed_model_fails_its_lines_and_the_rest_runs(store):
    ids = [f"q{i}" for i in range(6)]
    batch_id = submit(store, jsonl(ids, models={cid: "gone" for cid in ids[::2]}))
    store.validate(batch_id, lambda model: True)  # both served when the batch was made
    send = Send()
    batch = await run_until_done(store, send, batch_id, models=lambda model: model != "gone")
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    errors = output(store, batch["error_file_id"])
    assert [line["custom_id"] for line in errors] == ids[::2]
    assert all(line["error"]["code"] == "model_not_found" and "'gone'" in line["error"]["message"] for line in errors)
    assert set(send.calls) == set(ids[1::2])


async def test_validation_refuses_a_model_nobody_serves(store):
    batch_id = submit(store, jsonl(["a"], model="nobody"))
    batch = await run_until_done(store, Send(), batch_id, models=lambda model: model == "m")
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["line"] == 1


async def test_a_stop_mid_batch_resumes_with_one_result_per_custom_id(tmp_path):
    folder = tmp_path / "batches"
    ids = [f"q{i}" for i in range(10)]
    store = Store.open(folder, Limits())
    batch_id = submit(store, jsonl(ids))
    started = asyncio.Event()

    class Hang(Send):
        async def __call__(self, endpoint, body, owner):
            if cid_of(body) in ("q4", "q5"):
                self.calls[cid_of(body)] += 1
                started.set()
                await asyncio.Event().wait()  # in flight at the stop
            return await super().__call__(endpoint, body, owner)

    first = Hang()
    runner_claims: list = []
    original = Store.claim

    def claim(self, *args, **kw):  # what the runner claimed: the Claimed of the attempt the stop forgets
        got = original(self, *args, **kw)
        runner_claims.extend(c for c in got if c.custom_id in ("q4", "q5"))
        return got

    store.claim = claim.__get__(store)  # type: ignore[method-assign]
    runner = Runner(store, first, lambda model: 2, lambda model: True, poll=0.01)
    runner.start()
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.05)
    await runner.stop()
    running = {line.custom_id: line for line in runner_claims}
    assert set(running) == {"q4", "q5"}
    store.close()

    store = Store.open(folder, Limits())  # recover(): the running lines pending again, attempt + 1
    try:
        assert store.batch(batch_id, None)["status"] == "in_progress"
        assert store.record(running["q4"], 200, b"{}", "late") is False  # the forgotten attempt's answer
        second = Send()
        batch = await run_until_done(store, second, batch_id)
        lines = output(store, batch["output_file_id"])
        assert sorted(line["custom_id"] for line in lines) == sorted(ids)  # each exactly once
        assert batch["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
        assert second.calls["q4"] == 1 and second.calls["q5"] == 1
        assert not set(second.calls) & {cid for cid in first.calls if cid not in ("q4", "q5")}
    finally:
        store.close()


async def test_a_batch_past_its_window_expires(tmp_path):
    now = [1_000_000.0]
    store = Store.open(tmp_path / "batches", Limits(), clock=lambda: now[0])
    try:
        batch_id = submit(store, jsonl(["a", "b", "c"]))
        send = Send()
        runner = Runner(store, send, lambda model: 1 if not send.calls else 0, lambda model: True, poll=0.01)
        runner.start()
        try:
            while store.batch(batch_id, None)["request_counts"]["completed"] < 1:
                await asyncio.sleep(0.01)
            now[0] += 25 * 3600  # past the 24 h window
            runner._expire_at = 0.0  # (the next round looks at once)
            batch = await finished(store, batch_id)
        finally:
            await runner.stop()
        assert batch["status"] == "expired"
        assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
        assert {line["error"]["code"] for line in output(store, batch["error_file_id"])} == {"batch_expired"}
    finally:
        store.close()


async def test_a_cancelled_batch_ends_with_its_held_lines(store):
    batch_id = submit(store, jsonl(["a", "b"]))
    send = Send({"a": [Busy] * 1000, "b": [Busy] * 1000})
    runner = Runner(store, send, lambda model: 2, lambda model: True, poll=0.01)
    runner.start()
    try:
        while sum(send.calls.values()) < 4:
            await asyncio.sleep(0.01)
        store.cancel(batch_id, "alice")
        runner.wake()
        batch = await finished(store, batch_id)
    finally:
        await runner.stop()
    assert batch["status"] == "cancelled"
    assert {line["error"]["code"] for line in output(store, batch["error_file_id"])} == {"batch_cancelled"}


def test_refusal_names_the_status_and_the_message():
    assert refusal(503, b'{"error": {"message": "busy"}}') == "answered 503: busy"
    assert refusal(502, b"<html>bad gateway</html>") == "answered 502: <html>bad gateway</html>"


async def test_work_done_in_steps_goes_on_without_waiting_for_the_poll(store):
    ids = [f"q{i}" for i in range(4500)]  # finalize writes 2000 lines a step: three steps
    batch_id = submit(store, jsonl(ids))
    runner = Runner(store, Send(), lambda model: 500, lambda model: True, poll=300.0)
    runner.start()
    try:
        batch = await finished(store, batch_id, timeout=60.0)  # far less than the poll (300 s) a step
    finally:
        await runner.stop()
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4500
    assert len(output(store, batch["output_file_id"])) == 4500


async def test_a_freed_slot_wakes_the_runner_only_while_lines_wait_for_room(store):
    runner = Runner(store, Send(), lambda model: 0, lambda model: True, poll=60.0)
    runner.step()
    runner.slot_freed()
    assert not runner._wake.is_set()  # no batch: interactive traffic costs the store nothing
    submit(store, jsonl(["a"]))
    runner.step()  # validated; its line waits: no room
    runner.slot_freed()
    assert runner._wake.is_set()


async def test_results_that_land_together_are_written_in_one_transaction(store):
    # 64 lines answered at once: their results go to the writer thread while it writes, and each
    # of its transactions takes every one queued by then (one fsync for many lines, not one each)
    ids = [f"g{i}" for i in range(64)]
    batch_id = submit(store, jsonl(ids))
    commits: list[str] = []
    store._db.set_trace_callback(lambda sql: commits.append(sql) if sql.strip().upper() == "COMMIT" else None)
    released = asyncio.Event()

    class Gate(Send):
        async def __call__(self, endpoint: str, body: bytes, owner: str) -> tuple[int, bytes, str]:
            await released.wait()
            return await super().__call__(endpoint, body, owner)

    send = Gate()
    runner = Runner(store, send, lambda model: 64, lambda model: True, poll=0.01)
    runner.start()
    try:
        while runner.in_flight < 64:
            await asyncio.sleep(0.01)
        before = len(commits)
        released.set()
        batch = await finished(store, batch_id)
    finally:
        await runner.stop()
    assert batch["request_counts"] == {"total": 64, "completed": 64, "failed": 0}
    assert [line["custom_id"] for line in output(store, batch["output_file_id"])] == ids
    # the results' commits (and the finalize's few) are far fewer than the 64 lines
    assert len(commits) - before < 16, len(commits) - before


def test_a_failing_write_inside_together_is_undone_alone(store):
    ids = ["a", "b", "c"]
    batch_id = submit(store, jsonl(ids))
    store.validate(batch_id, None)
    claimed = store.claim(batch_id, 3)
    with store.together():
        assert store.record(claimed[0], *answer("a"))
        with pytest.raises(RuntimeError):
            with store._tx(full=False) as db:  # a write that fails half-way: its savepoint is rolled back
                db.execute("UPDATE lines SET state = 'done' WHERE batch_id = ? AND number = ?", (batch_id, claimed[1].number))
                raise RuntimeError("boom")
        assert store.record(claimed[2], *answer("c"))
    assert store.in_flight == {"m": 1}  # b is still running, a and c counted
    assert store.outcomes[("m", "completed")] == 2
    assert store.record(claimed[1], *answer("b"))  # b was not marked done by the undone write
    assert store.batch(batch_id, None)["request_counts"]["completed"] == 3


class Freeing(Send):
    """A sender that tells the runner a slot freed at each request's end, as the forwarder does."""

    runner: Runner | None = None

    async def __call__(self, endpoint: str, body: bytes, owner: str) -> tuple[int, bytes, str]:
        try:
            return await super().__call__(endpoint, body, owner)
        finally:
            assert self.runner is not None
            asyncio.get_running_loop().call_soon(self.runner.slot_freed)


async def sent_through_freed_slots(store: Store, count: int, delay: float, within: float) -> tuple[Runner, Freeing]:
    """A runner with a room of 2 (rounds as far apart as the caller set MIN_ROUND), started: waits
    until `count` lines went out (fails after `within` s) and returns it running, and its sender."""
    send = Freeing(delay=delay)
    runner = send.runner = Runner(store, send, lambda model: 2 - send.in_flight, lambda model: True, poll=10.0)
    runner.start()
    try:
        deadline = asyncio.get_running_loop().time() + within
        while sum(send.calls.values()) < count:
            assert asyncio.get_running_loop().time() < deadline, f"only {sum(send.calls.values())} sent: a round was awaited"
            await asyncio.sleep(0.01)
    except BaseException:
        await runner.stop()
        raise
    return runner, send


async def test_a_freed_slot_sends_a_held_line_at_once_not_at_the_next_round(store, monkeypatch):
    # rounds 5 s apart: every line after the first round's two must go out through slot_freed(),
    # which the forwarder calls as each request ends, from the lines claimed ahead (PREFETCH)
    monkeypatch.setattr("vsup.batch.runner.MIN_ROUND", 5.0)
    batch_id = submit(store, jsonl([f"h{i}" for i in range(10)]))
    store.validate(batch_id, None)
    runner, send = await sent_through_freed_slots(store, 10, delay=0.01, within=2.0)
    try:
        assert send.most <= 2  # the room was never exceeded
    finally:
        await runner.stop()


async def test_a_freed_slot_claims_more_lines_when_none_is_held(store, monkeypatch):
    # rounds 5 s apart and 40 lines through a room of 2: more than the first round claims (2 sent,
    # PREFETCH held), so a freed slot that finds no held line claims the next ones itself
    monkeypatch.setattr("vsup.batch.runner.MIN_ROUND", 5.0)
    monkeypatch.setattr("vsup.batch.runner.PREFETCH", 4)
    ids = [f"k{i}" for i in range(40)]
    batch_id = submit(store, jsonl(ids))
    store.validate(batch_id, None)
    runner, send = await sent_through_freed_slots(store, 40, delay=0.005, within=3.0)
    try:
        assert send.most <= 2 and sorted(send.calls) == sorted(ids) and set(send.calls.values()) == {1}
        while store.running()[0]["running"]:  # the last results land
            await asyncio.sleep(0.01)
        # no line pending any more: a freed slot (interactive traffic) reads nothing from the store
        reads: list[str] = []
        store._db.set_trace_callback(reads.append)
        for _ in range(5):
            runner.slot_freed()
        store._db.set_trace_callback(None)
        assert reads == []
    finally:
        await runner.stop()


async def test_held_lines_go_back_to_pending_at_a_stop_without_spending_an_attempt(store, monkeypatch):
    ids = [f"s{i}" for i in range(6)]
    batch_id = submit(store, jsonl(ids))
    store.validate(batch_id, None)
    blocked = asyncio.Event()

    class Stuck(Send):
        async def __call__(self, endpoint: str, body: bytes, owner: str) -> tuple[int, bytes, str]:
            await blocked.wait()
            return await super().__call__(endpoint, body, owner)

    runner = Runner(store, Stuck(), lambda model: 1, lambda model: True, poll=10.0)
    runner.start()
    while runner.in_flight < 1:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await runner.stop()
    counts = store.running()[0]
    assert counts["running"] == 1 and counts["pending"] == 5  # the one in flight stays running (recover() at the next start)
    again = store.claim(batch_id, 10)
    assert sorted(c.custom_id for c in again) == ids[1:] and {c.attempt for c in again} == {claimed_attempt(store)}


def claimed_attempt(store: Store) -> int:
    """The attempt a line that was never claimed before carries."""
    data = jsonl(["fresh"])
    batch_id = submit(store, data)
    store.validate(batch_id, None)
    return store.claim(batch_id, 1)[0].attempt
