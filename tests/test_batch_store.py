"""The batch store (vsup/batch/store.py) on real SQLite files: files and batches in OpenAI's shapes,
lines claimed, recorded and requeued with their attempts, a vsup killed with -9 mid-work resumes
with exactly one result per custom_id, the output files' format, the disk bounds (413 naming the
key), another owner's objects answering as missing ones, pagination, expiry, purge, and the file
itself private (0700 folder, 0600 file, a planted link refused)."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vsup.batch import store as store_module
from vsup.batch.errors import BadInput, Conflict, NotFound, TooLarge
from vsup.batch.store import PIECE, Claimed, Limits, Store
from vsup.errors import VsupError

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
REPO = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def jsonl(n: int, model: str = "m", prefix: str = "req") -> bytes:
    return b"".join(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": CHAT,
                                "body": {"model": model, "messages": [{"role": "user", "content": str(i)}]}}).encode() + b"\n"
                    for i in range(n))


def upload(store: Store, data: bytes, owner: str = "alice", purpose: str = "batch") -> dict:
    return store.add_file(owner, "in.jsonl", purpose, io.BytesIO(data), len(data))


def started(store: Store, data: bytes, owner: str = "alice", models=None) -> str:
    """A batch over `data`, validated: its id (in_progress)."""
    batch = store.create(owner, upload(store, data, owner)["id"], CHAT, "24h", None)
    assert store.validate(batch["id"], models)["status"] == "in_progress"
    return batch["id"]


def answer(claimed: Claimed) -> bytes:
    return json.dumps({"object": "chat.completion", "echo": claimed.custom_id}).encode()


def read(store: Store, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in b"".join(store.content(file_id, None)).splitlines()]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    s = Store.open(tmp_path / "batches", Limits(), clock)
    yield s
    s.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- the file itself

def test_the_folder_is_0700_and_the_database_0600_with_wal(tmp_path, store):
    started(store, jsonl(3))
    folder = tmp_path / "batches"
    assert mode(folder) == 0o700
    assert mode(folder / "batches.sqlite3") == 0o600
    assert mode(folder / "batches.sqlite3-wal") == 0o600  # (the store is open: its WAL is there)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_an_older_readable_database_is_made_private(tmp_path):
    folder = tmp_path / "batches"
    Store.open(folder, Limits()).close()
    os.chmod(folder / "batches.sqlite3", 0o644)
    Store.open(folder, Limits()).close()
    assert mode(folder / "batches.sqlite3") == 0o600


@pytest.mark.parametrize("name", ["batches.sqlite3", "batches.sqlite3-wal", "batches.sqlite3-shm"])
def test_a_link_planted_at_the_database_is_refused_and_its_target_untouched(tmp_path, name):
    folder = tmp_path / "batches"
    folder.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    os.symlink(target, folder / name)
    with pytest.raises(VsupError, match="batch.dir") as caught:
        Store.open(folder, Limits())
    assert "link" in str(caught.value)
    assert target.read_bytes() == b"keep me"
    assert os.path.islink(folder / name)


def test_a_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(VsupError, match="batch.dir"):
        Store.open(folder, Limits())


def test_a_file_that_is_not_a_database_is_one_line(tmp_path):
    folder = tmp_path / "batches"
    folder.mkdir(mode=0o700)
    (folder / "batches.sqlite3").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(VsupError, match="cannot be used as the batch store"):
        Store.open(folder, Limits())


# -- files

def test_a_file_in_openais_shape_and_its_content_in_pieces(store, clock):
    data = os.urandom(2 * PIECE + 1000)
    made = store.add_file("alice", "big.bin", "batch", io.BytesIO(data), len(data))
    assert set(made) == {"id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status", "status_details"}
    assert made["id"].startswith("file-") and len(made["id"]) == 5 + 32
    assert made["object"] == "file" and made["bytes"] == len(data) and made["created_at"] == int(clock.now)
    assert made["purpose"] == "batch" and made["filename"] == "big.bin" and made["status"] == "processed"
    pieces = list(store.content(made["id"], "alice"))
    assert [len(p) for p in pieces] == [PIECE, PIECE, 1000]
    assert b"".join(pieces) == data
    assert store.file(made["id"], "alice") == made
    assert store.usage() == len(data)


def test_only_purpose_batch_may_be_uploaded(store):
    with pytest.raises(BadInput, match='"batch" works') as caught:
        upload(store, b"x", purpose="fine-tune")
    assert caught.value.status == 400 and caught.value.param == "purpose"


def test_an_upload_shorter_or_longer_than_announced_is_refused_and_leaves_nothing(store):
    for told in (10, 2):
        with pytest.raises(BadInput, match="announced"):
            store.add_file("alice", "x", "batch", io.BytesIO(b"12345"), told)
    assert store.files(None) == ([], False) and store.usage() == 0


def test_delete_a_file(store):
    made = upload(store, b"abc")
    assert store.delete_file(made["id"], "alice") == {"id": made["id"], "object": "file", "deleted": True}
    with pytest.raises(NotFound):
        store.file(made["id"], "alice")
    assert store._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0


def test_a_file_a_running_batch_reads_cannot_be_deleted(store):
    batch_id = started(store, jsonl(2))
    input_id = store.batch(batch_id, None)["input_file_id"]
    with pytest.raises(Conflict, match=batch_id) as caught:
        store.delete_file(input_id, "alice")
    assert caught.value.status == 409
    for c in store.claim(batch_id, 10):
        store.record(c, 200, answer(c), "r")
    store.finalize(batch_id)
    assert store.delete_file(input_id, "alice")["deleted"] is True


# -- limits

def test_a_file_over_max_file_bytes_is_413_naming_the_key(tmp_path):
    store = Store.open(tmp_path / "b", Limits(max_file_bytes=100))
    with pytest.raises(TooLarge) as caught:
        upload(store, b"x" * 101)
    assert caught.value.status == 413 and "batch.max_file_bytes" in caught.value.message
    assert caught.value.body()["error"]["code"] == "file_too_large"
    upload(store, b"x" * 100)
    store.close()


def test_the_store_over_max_total_bytes_is_413_naming_the_key(tmp_path):
    store = Store.open(tmp_path / "b", Limits(max_total_bytes=250))
    upload(store, b"x" * 100)
    upload(store, b"x" * 100)
    with pytest.raises(TooLarge, match="batch.max_total_bytes") as caught:
        upload(store, b"x" * 51)
    assert caught.value.status == 413
    assert len(store.files(None)[0]) == 2
    store.close()


def test_a_result_over_max_total_bytes_is_kept_as_an_error(tmp_path):
    data = jsonl(2)
    store = Store.open(tmp_path / "b", Limits(max_total_bytes=len(data) * 2 + 300))
    batch_id = started(store, data)
    first, second = store.claim(batch_id, 2)
    assert store.record(first, 200, b'{"ok": true}', "r1")
    assert store.record(second, 200, b"x" * 10_000, "r2")
    done = store.finalize(batch_id)
    assert [r["custom_id"] for r in read(store, done["output_file_id"])] == ["req-0"]
    (failed,) = read(store, done["error_file_id"])
    assert failed["response"] is None and failed["error"]["code"] == "storage_limit_exceeded"
    assert "batch.max_total_bytes" in failed["error"]["message"]
    store.close()


def test_results_written_together_count_each_other_against_max_total_bytes(tmp_path):
    # the runner's writer records many results in one transaction (together()), where the store's
    # usage is read once: the results kept before a line in it still count against the limit
    data = jsonl(3)
    store = Store.open(tmp_path / "b", Limits(max_total_bytes=len(data) * 2 + 2500))
    batch_id = started(store, data)
    claimed = store.claim(batch_id, 3)
    with store.together():
        for c in claimed:
            assert store.record(c, 200, b'"' + b"x" * 1000 + b'"', f"r{c.number}")
    done = store.finalize(batch_id)
    assert [r["custom_id"] for r in read(store, done["output_file_id"])] == ["req-0", "req-1"]
    (failed,) = read(store, done["error_file_id"])
    assert failed["custom_id"] == "req-2" and failed["error"]["code"] == "storage_limit_exceeded"
    store.close()


def test_a_batch_whose_lines_would_pass_max_total_bytes_fails_validation(tmp_path):
    data = jsonl(5)
    store = Store.open(tmp_path / "b", Limits(max_total_bytes=len(data) + 10))
    batch = store.create("alice", upload(store, data)["id"], CHAT, "24h", None)
    failed = store.validate(batch["id"], None)
    assert failed["status"] == "failed" and "batch.max_total_bytes" in failed["errors"]["data"][0]["message"]
    store.close()


# -- batches

def test_create_gives_openais_batch_object(store, clock):
    made = store.create("alice", upload(store, jsonl(2))["id"], CHAT, "24h", {"project": "docs"})
    assert made["id"].startswith("batch_") and len(made["id"]) == 6 + 32
    assert made["object"] == "batch" and made["status"] == "validating" and made["endpoint"] == CHAT
    assert made["created_at"] == int(clock.now) and made["expires_at"] == int(clock.now) + 24 * 3600
    assert made["errors"] is None and made["output_file_id"] is None and made["metadata"] == {"project": "docs"}
    assert made["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert {"in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
            "cancelled_at", "completion_window", "input_file_id", "error_file_id"} <= set(made)
    assert store.validating() == [made["id"]]


@pytest.mark.parametrize("endpoint,window,metadata,param", [
    ("/v1/models", "24h", None, "endpoint"),
    (CHAT, "1h", None, "completion_window"),
    (CHAT, "24h", {"k": 1}, "metadata"),
    (CHAT, "24h", {f"k{i}": "v" for i in range(17)}, "metadata"),
    (CHAT, "24h", ["a"], "metadata"),
])
def test_create_refuses_bad_input(store, endpoint, window, metadata, param):
    file_id = upload(store, jsonl(1))["id"]
    with pytest.raises(BadInput) as caught:
        store.create("alice", file_id, endpoint, window, metadata)
    assert caught.value.param == param and caught.value.status == 400


def test_create_over_an_output_file_is_refused(store):
    batch_id = started(store, jsonl(1))
    (c,) = store.claim(batch_id, 1)
    store.record(c, 200, answer(c), "r")
    output = store.finalize(batch_id)["output_file_id"]
    with pytest.raises(BadInput, match="purpose"):
        store.create("alice", output, CHAT, "24h", None)


def test_validation_errors_fail_the_batch_with_line_numbers(store, clock):
    data = jsonl(2) + b"not json\n" + jsonl(1)  # line 3 bad, line 4 repeats req-0
    batch = store.create("alice", upload(store, data)["id"], CHAT, "24h", None)
    clock.now += 5
    failed = store.validate(batch["id"], lambda name: name == "m")
    assert failed["status"] == "failed" and failed["failed_at"] == int(clock.now)
    assert failed["errors"]["object"] == "list"
    assert [(e["line"], e["code"]) for e in failed["errors"]["data"]] == [(3, "invalid_json_line"), (4, "duplicate_custom_id")]
    assert store._db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] == 0
    assert store.validating() == [] and store.claim(batch["id"], 10) == []


def test_validate_with_an_unserved_model(store):
    batch = store.create("alice", upload(store, jsonl(1, model="gone"))["id"], CHAT, "24h", None)
    (error,) = store.validate(batch["id"], lambda name: name == "m")["errors"]["data"]
    assert error["code"] == "model_not_found" and error["line"] == 1


def test_claim_record_and_counts(store, clock):
    batch_id = started(store, jsonl(3, model="a") + jsonl(2, model="b", prefix="other"))
    assert store.batch(batch_id, None)["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    claimed = store.claim(batch_id, 2, model="b")
    assert [(c.custom_id, c.model, c.attempt, c.number) for c in claimed] == [("other-0", "b", 1, 4), ("other-1", "b", 1, 5)]
    assert json.loads(claimed[0].body)["model"] == "b"
    assert store.claim(batch_id, 5, model="b") == []
    (view,) = store.running()
    assert view["pending"] == 3 and view["running"] == 2 and view["models"] == {"a": 3}
    assert store.record(claimed[0], 200, answer(claimed[0]), "req-x")
    assert not store.record(claimed[0], 200, answer(claimed[0]), "req-y")  # one result per line
    assert store.record(claimed[1], 400, b'{"error": "bad"}', "req-z")
    assert store.batch(batch_id, None)["request_counts"] == {"total": 5, "completed": 1, "failed": 1}


def test_requeue_counts_attempts_and_the_last_fails_the_line(tmp_path):
    store = Store.open(tmp_path / "b", Limits(max_attempts=2))
    batch_id = started(store, jsonl(1))
    (first,) = store.claim(batch_id, 1)
    assert store.requeue(first, "busy")
    assert not store.record(first, 200, b"{}", "late")  # that attempt is forgotten
    (second,) = store.claim(batch_id, 1)
    assert second.attempt == 2
    assert not store.record(first, 200, b"{}", "late")  # not even while the line runs again
    assert store.requeue(second, "instance gone (503)")
    assert store.claim(batch_id, 1) == []
    done = store.finalize(batch_id)
    assert done["status"] == "completed" and done["request_counts"]["failed"] == 1
    (line,) = read(store, done["error_file_id"])
    assert line["error"] == {"code": "attempts_exhausted", "message": "instance gone (503)"}
    store.close()


def test_fail_pending_of_a_model_across_batches(store):
    one = started(store, jsonl(2, model="a") + jsonl(1, model="b", prefix="x"))
    two = started(store, jsonl(3, model="a"))
    store.claim(one, 1, model="a")
    assert store.fail_pending(None, "a", "model_removed", "model a is no longer served") == 4
    assert store.batch(one, None)["request_counts"]["failed"] == 1
    assert store.batch(two, None)["request_counts"]["failed"] == 3
    assert [v["models"] for v in store.running()] == [{"b": 1}, {}]
    assert store.finish_ready() == [two]


def test_finalize_writes_openais_output_and_error_files_in_line_order(store, clock):
    batch_id = started(store, jsonl(5))
    claimed = store.claim(batch_id, 5)
    for c in reversed(claimed[:3]):
        store.record(c, 200, answer(c), f"rid-{c.number}")
    store.record(claimed[3], 502, b"upstream gone", "rid-4")
    store.record(claimed[4], None, None, "rid-5", {"code": "timeout", "message": "no answer in 600 s"})
    assert store.finish_ready() == [batch_id]
    clock.now += 60
    done = store.finalize(batch_id)
    assert done["status"] == "completed" and done["completed_at"] == int(clock.now)
    assert done["finalizing_at"] == int(clock.now)
    assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    output = read(store, done["output_file_id"])
    assert [o["custom_id"] for o in output] == ["req-0", "req-1", "req-2"]
    for o in output:
        assert list(o) == ["id", "custom_id", "response", "error"] and o["id"].startswith("batch_req_")
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"] == {"object": "chat.completion", "echo": o["custom_id"]}
    assert output[0]["response"]["request_id"] == "rid-1"
    errors = read(store, done["error_file_id"])
    assert errors[0]["response"] == {"status_code": 502, "request_id": "rid-4", "body": "upstream gone"}
    assert errors[1]["response"] is None and errors[1]["error"] == {"code": "timeout", "message": "no answer in 600 s"}
    for file_id, kind in ((done["output_file_id"], "output"), (done["error_file_id"], "error")):
        made = store.file(file_id, "alice")
        assert made["purpose"] == "batch_output" and made["filename"] == f"{batch_id}_{kind}.jsonl"
    assert store.finalize(batch_id) == done  # idempotent
    assert store._db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] == 0  # results now live in the files
    assert store.running() == [] and store.finish_ready() == []


def test_output_follows_the_input_files_order_not_the_answers_or_the_ids(store):
    data = b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": {"model": "m"}}).encode() + b"\n"
                    for cid in ("zeta", "alpha", "mid"))
    batch_id = started(store, data)
    for c in reversed(store.claim(batch_id, 3)):
        store.record(c, 200, answer(c), "r")
    done = store.finalize(batch_id)
    assert [o["custom_id"] for o in read(store, done["output_file_id"])] == ["zeta", "alpha", "mid"]


def test_no_error_file_when_nothing_failed(store):
    batch_id = started(store, jsonl(2))
    for c in store.claim(batch_id, 2):
        store.record(c, 200, answer(c), "r")
    done = store.finalize(batch_id)
    assert done["error_file_id"] is None and len(read(store, done["output_file_id"])) == 2


def test_finalize_refuses_a_batch_still_validating(store):
    from vsup.batch.status import BatchStateError
    batch = store.create("alice", upload(store, jsonl(1))["id"], CHAT, "24h", None)
    with pytest.raises(BatchStateError):
        store.finalize(batch["id"])


# -- cancel and expiry

def test_cancel_fails_pending_lines_and_waits_for_running_ones(store, clock):
    batch_id = started(store, jsonl(4))
    running = store.claim(batch_id, 1)
    clock.now += 10
    cancelling = store.cancel(batch_id, "alice")
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] == int(clock.now)
    assert cancelling["request_counts"]["failed"] == 3
    assert store.claim(batch_id, 5) == []
    assert store.finish_ready() == []  # one line still runs
    assert store.cancel(batch_id, "alice")["status"] == "cancelling"  # a retried cancel is answered
    assert store.record(running[0], 200, answer(running[0]), "r")
    assert store.finish_ready() == [batch_id]
    done = store.finalize(batch_id)
    assert done["status"] == "cancelled" and done["cancelled_at"] == int(clock.now) and done["finalizing_at"] is None
    assert [o["custom_id"] for o in read(store, done["output_file_id"])] == ["req-0"]
    assert {e["error"]["code"] for e in read(store, done["error_file_id"])} == {"batch_cancelled"}


def test_cancel_while_validating_ends_cancelled(store):
    batch = store.create("alice", upload(store, jsonl(2))["id"], CHAT, "24h", None)
    assert store.cancel(batch["id"], None)["status"] == "cancelling"
    assert store.validate(batch["id"], None)["status"] == "cancelling"  # not validated any more
    assert store.finish_ready() == [batch["id"]]
    done = store.finalize(batch["id"])
    assert done["status"] == "cancelled" and done["output_file_id"] is None and done["error_file_id"] is None


def test_cancel_in_the_middle_of_validation_keeps_no_lines(store):
    batch = store.create("alice", upload(store, jsonl(300))["id"], CHAT, "24h", None)
    assert store.validate(batch["id"], None, step=2000)["status"] == "validating"
    assert store._db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] > 0
    store.cancel(batch["id"], "alice")
    done = store.finalize(batch["id"])
    assert done["status"] == "cancelled" and done["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert done["error_file_id"] is None and store._db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] == 0


def test_cancel_a_finished_batch_is_a_conflict(store):
    batch_id = started(store, jsonl(1))
    (c,) = store.claim(batch_id, 1)
    store.record(c, 200, answer(c), "r")
    store.finalize(batch_id)
    with pytest.raises(Conflict, match="completed") as caught:
        store.cancel(batch_id, "alice")
    assert caught.value.status == 409


def test_expiry_after_24_hours(store, clock):
    batch_id = started(store, jsonl(3))
    first, second = store.claim(batch_id, 2)
    store.record(first, 200, answer(first), "r")
    clock.now += 24 * 3600 - 1
    assert store.expire() == []
    clock.now += 1
    assert store.expire() == [batch_id]
    done = store.batch(batch_id, "alice")
    assert done["status"] == "expired" and done["expired_at"] == int(clock.now) and done["finalizing_at"] == int(clock.now)
    assert not store.record(second, 200, answer(second), "late")  # the line in flight is over
    assert [o["custom_id"] for o in read(store, done["output_file_id"])] == ["req-0"]
    errors = read(store, done["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("req-1", "batch_expired"), ("req-2", "batch_expired")]
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}


# -- the counts for /metrics: each line's outcome and the lines running, by model

def running_by_model(store: Store) -> dict[str, int]:
    return dict(store._db.execute("SELECT model, COUNT(*) FROM lines WHERE state = 'running' GROUP BY model").fetchall())


def test_outcomes_are_counted_by_model_as_they_land(tmp_path):
    store = Store.open(tmp_path / "b", Limits(max_attempts=2))
    first = started(store, jsonl(3, model="chat") + jsonl(1, model="embed", prefix="e"))
    lines = store.claim(first, 3, "chat")
    assert store.in_flight == {"chat": 3}
    assert store.record(lines[0], 200, b'{"ok": 1}', "req-1")
    assert store.record(lines[1], 400, b'{"error": {}}', "req-2")
    assert store.requeue(lines[2], "answered 503")  # attempt 1 of 2: back to pending
    assert store.in_flight == {}
    again = store.claim(first, 1, "chat")
    assert store.requeue(again[0], "answered 503")  # attempt 2 of 2: it fails
    assert not store.record(again[0], 200, b"{}", "late")  # a forgotten attempt counts nothing
    assert not store.requeue(again[0], "late")
    second = started(store, jsonl(2, model="embed", prefix="b"), owner="bob")
    store.cancel(second, None)  # its pending lines fail, by model
    assert store.outcomes == {("chat", "completed"): 1, ("chat", "failed"): 2, ("chat", "requeued"): 1, ("embed", "failed"): 2}
    assert store.fail_pending(None, "embed", "model_not_found", "gone") == 1  # a removed model: e-0
    assert store.outcomes[("embed", "failed")] == 3
    store.close()


def test_a_line_running_when_its_batch_expires_counts_failed(store, clock):
    batch_id = started(store, jsonl(3))
    first, second = store.claim(batch_id, 2)
    store.record(first, 200, answer(first), "r")
    clock.now += 24 * 3600
    assert store.expire() == [batch_id]  # req-2 pending (expire), req-1 running (finalize's leftover)
    assert store.outcomes == {("m", "completed"): 1, ("m", "failed"): 2}
    assert store.in_flight == {} == running_by_model(store)  # its batch is over: not running any more
    assert not store.record(second, 200, answer(second), "late")  # its late answer counts nothing
    assert store.outcomes == {("m", "completed"): 1, ("m", "failed"): 2} and store.in_flight == {}
    assert store.batch(batch_id, None)["request_counts"] == {"total": 3, "completed": 1, "failed": 2}


def test_a_result_over_max_total_bytes_counts_failed(tmp_path):
    data = jsonl(2)
    store = Store.open(tmp_path / "b", Limits(max_total_bytes=len(data) * 2 + 300))
    batch_id = started(store, data)
    first, second = store.claim(batch_id, 2)
    assert store.record(first, 200, b'{"ok": true}', "r1")
    assert store.record(second, 200, b"x" * 10_000, "r2")  # a 200, kept as storage_limit_exceeded
    assert store.outcomes == {("m", "completed"): 1, ("m", "failed"): 1}
    assert store.batch(batch_id, None)["request_counts"]["failed"] == 1
    store.close()


def test_a_cancel_counts_its_pending_lines_failed_and_its_running_ones_as_they_land(store):
    batch_id = started(store, jsonl(3, model="a") + jsonl(2, model="b", prefix="x"))
    (running,) = store.claim(batch_id, 1, "b")
    store.cancel(batch_id, "alice")
    assert store.outcomes == {("a", "failed"): 3, ("b", "failed"): 1}
    assert store.in_flight == {"b": 1}  # it finishes
    assert store.record(running, 200, answer(running), "r")
    store.finalize(batch_id)
    assert store.outcomes == {("a", "failed"): 3, ("b", "failed"): 1, ("b", "completed"): 1}
    assert store.in_flight == {}


def test_counts_start_at_zero_with_each_open(tmp_path):
    folder = tmp_path / "b"
    store = Store.open(folder, Limits())
    assert (store.outcomes, store.in_flight) == ({}, {})
    batch_id = started(store, jsonl(4))
    first, *stopped = store.claim(batch_id, 3)
    store.record(first, 500, b"{}", "r")
    assert (store.outcomes, store.in_flight) == ({("m", "failed"): 1}, {"m": 2})
    store.close()  # two lines left running: the next open's recover() puts them back
    again = Store.open(folder, Limits())
    assert (again.outcomes, again.in_flight) == ({}, {})
    assert not again.record(stopped[0], 200, answer(stopped[0]), "late")  # an earlier open's attempt
    assert len(again.claim(batch_id, 5)) == 3
    assert (again.outcomes, again.in_flight) == ({}, {"m": 3})
    again.close()


def test_a_transaction_that_rolls_back_counts_nothing(store, monkeypatch):
    batch_id = started(store, jsonl(2))
    (running,) = store.claim(batch_id, 1)

    def broken(line):
        raise OSError("disk gone")

    monkeypatch.setattr(store_module, "_result_line", broken)
    with pytest.raises(OSError):
        store.finalize(batch_id)  # its first step fails both lines, then cannot write them
    monkeypatch.undo()
    assert (store.outcomes, store.in_flight) == ({}, {"m": 1})
    store.finalize(batch_id)
    assert (store.outcomes, store.in_flight) == ({("m", "failed"): 2}, {})


@pytest.mark.parametrize("seed", range(6))
def test_the_counts_agree_with_the_rows_whatever_happens(tmp_path, clock, seed):
    """Random work over three models and a few batches: the lines running by model are the rows
    running, and the outcomes add up to the batches' own counts (and to the lines' attempts)."""
    rng = random.Random(seed)
    store = Store.open(tmp_path / "b", Limits(max_attempts=2, max_total_bytes=200_000), clock)
    batches = [started(store, b"".join(jsonl(rng.randint(1, 6), model=m, prefix=f"{m}{i}") for m in "xyz"))
               for i in range(4)]
    claimed: list[Claimed] = []
    requeues = 0
    for _ in range(200):
        action = rng.choice(["claim", "claim", "record", "record", "requeue", "cancel", "remove", "finish", "expire"])
        if action == "claim":
            claimed += store.claim(rng.choice(batches), rng.randint(1, 4), rng.choice([None, "x", "y", "z"]))
        elif action in ("record", "requeue") and claimed:
            line = claimed.pop(rng.randrange(len(claimed)))
            if action == "requeue":
                requeues += store.requeue(line, "busy") and line.attempt < 2
            else:
                body = rng.choice([b"{}", b'{"error": 1}', b"x" * 150_000])  # the last over max_total_bytes
                store.record(line, rng.choice([200, 200, 400]), body, "r")
        elif action == "cancel":
            batch_id = rng.choice(batches)
            if store.batch(batch_id, None)["status"] == "in_progress":
                store.cancel(batch_id, None)
        elif action == "remove":
            store.fail_pending(None, rng.choice("xyz"), "model_not_found", "gone")
        elif action == "finish":
            for batch_id in store.finish_ready():
                store.finalize(batch_id, step=rng.choice([None, 2]))
        elif action == "expire" and rng.random() < 0.2:
            clock.now += 24 * 3600
            store.expire()
        assert store.in_flight == running_by_model(store)
        views = [store.batch(b, None)["request_counts"] for b in batches]
        for outcome in ("completed", "failed"):
            assert sum(n for (_, o), n in store.outcomes.items() if o == outcome) == sum(v[outcome] for v in views)
        assert sum(n for (_, o), n in store.outcomes.items() if o == "requeued") == requeues
    store.close()


# -- ownership and pagination

def test_another_owners_objects_answer_as_missing_ones(store):
    file_id = upload(store, jsonl(2), owner="alice")["id"]
    batch_id = store.create("alice", file_id, CHAT, "24h", None)["id"]
    missing_file, missing_batch = "file-" + "0" * 32, "batch_" + "0" * 32

    def refusal(call, object_id):
        with pytest.raises(NotFound) as caught:
            call(object_id)
        return caught.value.status, caught.value.body()["error"]["message"].replace(object_id, "ID"), caught.value.param

    for call in (lambda i: store.file(i, "bob"), lambda i: store.content(i, "bob"), lambda i: store.delete_file(i, "bob"),
                 lambda i: store.create("bob", i, CHAT, "24h", None), lambda i: store.files("bob", after=i)):
        assert refusal(call, file_id) == refusal(call, missing_file)
    for call in (lambda i: store.batch(i, "bob"), lambda i: store.cancel(i, "bob"), lambda i: store.batches("bob", after=i)):
        assert refusal(call, batch_id) == refusal(call, missing_batch)
    assert refusal(lambda i: store.file(i, "bob"), file_id) == (404, "No such File object: ID", "file_id")
    assert store.files("bob") == ([], False) and store.batches("bob") == ([], False)
    # the owner and an admin (None) see them
    assert store.file(file_id, "alice")["id"] == file_id and store.file(file_id, None)["id"] == file_id
    assert store.batch(batch_id, None)["id"] == batch_id
    assert [f["id"] for f in store.files(None)[0]] == [file_id]
    assert store.batch(batch_id, "alice")["status"] == "validating"  # bob's cancel changed nothing


def test_output_files_belong_to_the_batchs_owner(store):
    batch_id = started(store, jsonl(1), owner="alice")
    (c,) = store.claim(batch_id, 1)
    store.record(c, 200, answer(c), "r")
    output = store.finalize(batch_id)["output_file_id"]
    assert store.file(output, "alice")["id"] == output
    with pytest.raises(NotFound):
        store.content(output, "bob")


def test_file_pages(store, clock):
    ids = []
    for _ in range(5):
        clock.now += 1
        ids.append(upload(store, b"x", owner="alice")["id"])
    upload(store, b"y", owner="bob")
    page, more = store.files("alice", limit=2)
    assert [f["id"] for f in page] == ids[:2:-1][:2] == [ids[4], ids[3]] and more
    page, more = store.files("alice", after=ids[3], limit=2)
    assert [f["id"] for f in page] == [ids[2], ids[1]] and more
    page, more = store.files("alice", after=ids[1], limit=2)
    assert [f["id"] for f in page] == [ids[0]] and not more
    page, more = store.files("alice", order="asc", limit=3)
    assert [f["id"] for f in page] == ids[:3] and more
    assert len(store.files(None)[0]) == 6
    assert store.files(None, purpose="batch_output") == ([], False)
    with pytest.raises(BadInput):
        store.files("alice", order="sideways")
    with pytest.raises(BadInput):
        store.files("alice", limit=0)


def test_batch_pages(store):
    file_id = upload(store, jsonl(1))["id"]
    ids = [store.create("alice", file_id, CHAT, "24h", None)["id"] for _ in range(5)]
    page, more = store.batches("alice", limit=3)
    assert [b["id"] for b in page] == ids[::-1][:3] and more
    page, more = store.batches("alice", after=page[-1]["id"], limit=3)
    assert [b["id"] for b in page] == [ids[1], ids[0]] and not more
    with pytest.raises(BadInput):
        store.batches("alice", limit=101)


# -- retention and usage

def test_purge_after_retention(tmp_path, clock):
    store = Store.open(tmp_path / "b", Limits(retention=3600), clock)
    done_id = started(store, jsonl(2))
    for c in store.claim(done_id, 2):
        store.record(c, 200, answer(c), "r")
    store.finalize(done_id)
    busy_id = started(store, jsonl(2, prefix="busy"))
    loose = upload(store, b"x" * 100)
    before = store.usage()
    clock.now += 3599
    assert store.purge() == 0
    clock.now += 2
    freed = store.purge()
    assert freed > 0 and store.usage() == before - freed
    with pytest.raises(NotFound):
        store.batch(done_id, None)
    with pytest.raises(NotFound):
        store.file(loose["id"], None)
    busy = store.batch(busy_id, None)
    assert store.file(busy["input_file_id"], None)["id"] == busy["input_file_id"]  # read by a running batch: kept
    assert [f["id"] for f in store.files(None)[0]] == [busy["input_file_id"]]
    store.close()


def test_retention_zero_keeps_everything(tmp_path, clock):
    store = Store.open(tmp_path / "b", Limits(retention=0), clock)
    upload(store, b"x")
    clock.now += 10 ** 9
    assert store.purge() == 0 and len(store.files(None)[0]) == 1
    store.close()


def test_usage_counts_lines_and_results_until_finalize(store):
    data = jsonl(2)
    batch_id = started(store, data)
    with_lines = store.usage()
    assert with_lines > len(data)
    (c, _) = store.claim(batch_id, 2)
    store.record(c, 200, b"z" * 1000, "r")
    assert store.usage() == with_lines + 1000


def test_limits_can_be_changed_on_a_running_store(store):
    store.limits = Limits(max_file_bytes=10)
    with pytest.raises(TooLarge):
        upload(store, b"x" * 11)


# -- durability

def test_a_crash_in_the_middle_of_finalize_is_finished_at_the_next_open(tmp_path, monkeypatch):
    folder = tmp_path / "b"
    store = Store.open(folder, Limits())
    batch_id = started(store, jsonl(5))
    for c in store.claim(batch_id, 4):
        store.record(c, 200 if c.number % 2 else 500, answer(c), "r")
    assert store.finalize(batch_id, step=2)["status"] == "finalizing"  # two lines written, committed

    def crash(line):
        raise KeyboardInterrupt  # the process dies while the next step is written

    monkeypatch.setattr(store_module, "_result_line", crash)
    with pytest.raises(KeyboardInterrupt):
        store.finalize(batch_id, step=2)
    monkeypatch.undo()
    assert store.batch(batch_id, None)["status"] == "finalizing"
    assert store.finish_ready() == [batch_id]  # a runner that lived on would finish it
    assert store.files(None, purpose="batch_output") == ([], False)  # a half-written file is never shown
    crashed = store  # never closed before the next open, as a killed process leaves it
    os.close(crashed._folder_lock)  # (the kernel releases a dead process's lock on the folder)
    crashed._folder_lock = None
    again = Store.open(folder, Limits())
    done = again.batch(batch_id, "alice")
    assert done["status"] == "completed" and done["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    output, errors = read(again, done["output_file_id"]), read(again, done["error_file_id"])
    assert [o["custom_id"] for o in output] == ["req-0", "req-2"]
    assert [e["custom_id"] for e in errors] == ["req-1", "req-3", "req-4"]
    assert errors[-1]["error"]["code"] == "batch_failed"  # never claimed: the batch ended without it
    pieces = again._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0]
    assert pieces == 3 + 2  # the input's one piece, and each file's pieces: one per step, nothing left over
    again.close()
    crashed.close()


def test_feedable_names_the_models_with_lines_pending_and_counts_nothing(store):
    data = b"".join(jsonl(3, model, prefix=model) for model in ("b-model", "a-model", "c-model"))
    batch_id = started(store, data)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    (batch,) = store.feedable()
    store._db.set_trace_callback(None)
    assert batch["id"] == batch_id and batch["status"] == "in_progress" and batch["pending"]
    assert batch["models"] == ["a-model", "b-model", "c-model"]
    # no statement visits every line (a round runs whenever a line ends; a batch may hold millions)
    assert not [sql for sql in statements if "COUNT(" in sql.upper() or "GROUP BY" in sql.upper()], statements
    store.claim(batch_id, 3, "b-model")  # every b-model line running: none pending there
    assert store.feedable()[0]["models"] == ["a-model", "c-model"]
    store.claim(batch_id, 6)
    (batch,) = store.feedable()
    assert batch["models"] == [] and not batch["pending"]
    assert store.finalize(batch_id, step=None)["status"] == "completed"
    assert store.feedable() == []  # an ended batch is not the runner's any more


def test_running_counts_agree_with_the_lines_through_every_move(store):
    # running() derives a batch's pending lines from its row (total - done - running) instead of
    # counting them: checked against a count of the lines after each kind of move
    import random

    def counted(batch_id: str) -> tuple[dict[str, int], int, list[str]]:
        rows = store._db.execute("SELECT state, model, COUNT(*) FROM lines WHERE batch_id = ? AND state != 'done' "
                                 "GROUP BY state, model", (batch_id,)).fetchall()
        return ({m: n for st, m, n in rows if st == "pending"}, sum(n for st, _, n in rows if st == "running"),
                sorted({m for _, m, _ in rows}))

    one = started(store, jsonl(12, "m1", "one"))
    mixed = started(store, jsonl(5, "m1", "x") + jsonl(7, "m2", "y"))
    rng = random.Random(7)
    held: list[Claimed] = []
    for step in range(60):
        for row in store.running():
            pending, running, open_models = counted(row["id"])
            assert (row["models"], row["running"], row["open_models"]) == (pending, running, open_models), (step, row)
            assert row["pending"] == sum(pending.values())
        move = rng.choice(["claim", "claim", "record", "fail", "requeue", "unclaim"])
        if move == "claim":
            held += store.claim(rng.choice([one, mixed]), rng.randint(1, 3), rng.choice([None, "m1", "m2"]))
        elif held:
            line = held.pop(rng.randrange(len(held)))
            if move == "record":
                store.record(line, 200, answer(line), "r")
            elif move == "fail":
                store.record(line, 500, b'{"error": "x"}', "r")
            elif move == "requeue":
                store.requeue(line, "answered 503")
            else:
                store.unclaim([line])
    store.fail_pending(mixed, "m2", "model_not_found", "gone")
    (row,) = [r for r in store.running() if r["id"] == mixed]
    assert (row["models"], row["running"]) == counted(mixed)[:2]


def test_finalize_in_steps_writes_the_same_files_as_at_once(tmp_path):
    outputs = []
    for step in (None, 1, 3, 1000):
        store = Store.open(tmp_path / f"s{step}", Limits())
        batch_id = started(store, jsonl(10))
        for c in store.claim(batch_id, 10):
            store.record(c, 200 if c.number != 7 else 404, answer(c), f"r{c.number}")
        calls = 0
        while (done := store.finalize(batch_id, step=step))["status"] == "finalizing":
            calls += 1
            assert store.finish_ready() == [batch_id]
        # steps of 1: the tenth writes the last line and ends the batch (no empty step after it)
        assert calls == {None: 0, 1: 9, 3: 3, 1000: 0}[step]
        strip = [{**o, "id": "-"} for o in read(store, done["output_file_id"]) + read(store, done["error_file_id"])]
        outputs.append(strip)
        store.close()
    assert all(o == outputs[0] for o in outputs) and len(outputs[0]) == 10


def test_a_finalize_step_ends_after_its_bytes_too(store, monkeypatch):
    monkeypatch.setattr(store_module, "FINAL_BYTES", 3000)
    batch_id = started(store, jsonl(6))
    big = json.dumps({"data": "e" * 1000}).encode()
    for c in store.claim(batch_id, 6):
        store.record(c, 200, big, "r")
    calls = 1
    while store.finalize(batch_id, step=1000)["status"] == "finalizing":
        calls += 1
    assert calls == 2  # about 1 KiB a line: three lines a step, and the second step's last line ends the batch
    output = read(store, store.batch(batch_id, None)["output_file_id"])
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(6)]


def test_validation_in_steps_survives_a_reopen_and_finds_duplicates_far_apart(tmp_path):
    folder = tmp_path / "b"
    data = jsonl(300) + json.dumps({"custom_id": "req-5", "method": "POST", "url": CHAT, "body": {"model": "m"}}).encode()
    store = Store.open(folder, Limits())
    batch = store.create("alice", upload(store, data)["id"], CHAT, "24h", None)
    assert store.validate(batch["id"], None, step=1000)["status"] == "validating"
    store.close()
    store = Store.open(folder, Limits())
    steps = 1
    while (now := store.validate(batch["id"], None, step=1000))["status"] == "validating":
        steps += 1
        assert store.validating() == [batch["id"]]
    assert steps > 10
    assert now["status"] == "failed"
    assert now["errors"]["data"] == [{"code": "duplicate_custom_id", "param": "custom_id", "line": 301,
                                      "message": now["errors"]["data"][0]["message"]}]
    store.close()


def test_validation_in_steps_keeps_every_line(tmp_path):
    store = Store.open(tmp_path / "b", Limits())
    data = jsonl(200) + b"\n\n"  # (blank lines at the end)
    batch = store.create("alice", upload(store, data)["id"], CHAT, "24h", None)
    while store.validate(batch["id"], None, step=333)["status"] == "validating":
        pass
    assert store.batch(batch["id"], None)["request_counts"]["total"] == 200
    claimed = store.claim(batch["id"], 500)
    assert [c.number for c in claimed] == list(range(1, 201))
    for c in claimed:
        store.record(c, 200, answer(c), "r")
    while (done := store.finalize(batch["id"], step=7))["status"] == "finalizing":
        pass
    assert [o["custom_id"] for o in read(store, done["output_file_id"])] == [f"req-{i}" for i in range(200)]
    store.close()


def test_lines_across_pieces_of_a_large_input(store):
    body = {"model": "m", "prompt": "x" * 3000}
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body}).encode() + b"\n"
                    for i in range(1000))  # ~3 MiB: lines cross the 1 MiB pieces
    batch = store.create("alice", upload(store, data)["id"], CHAT, "24h", None)
    while store.validate(batch["id"], None)["status"] == "validating":
        pass
    claimed = store.claim(batch["id"], 1000)
    assert [c.custom_id for c in claimed] == [f"c{i}" for i in range(1000)]
    assert all(json.loads(c.body) == body for c in claimed)


def test_an_upload_cut_short_by_a_crash_leaves_nothing(tmp_path):
    folder = tmp_path / "b"
    store = Store.open(folder, Limits())

    class Dies(io.BytesIO):
        def read(self, n=-1):
            if self.tell() >= PIECE:
                raise KeyboardInterrupt
            return super().read(n)

    data = b"x" * (3 * PIECE)
    with pytest.raises(KeyboardInterrupt):
        store.add_file("alice", "big", "batch", Dies(data), len(data))
    assert store.usage() == 0 and store._db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0
    # the same, killed: its pieces are there, counted, and gone at the next open
    store._db.execute("INSERT INTO uploads (file_id) VALUES ('file-x')")
    store._db.execute("INSERT INTO blobs (file_id, piece, data) VALUES ('file-x', 0, ?)", (b"y" * 100,))
    assert store.usage() == 100
    store.close()
    again = Store.open(folder, Limits())
    assert again.usage() == 0 and again.files(None) == ([], False)
    again.close()


CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from vsup.batch.store import Limits, Store

    store = Store.open(Path(sys.argv[1]), Limits())
    batch_id = sys.argv[2]
    held = store.claim(batch_id, 5)   # in flight when the kill comes: never answered
    print(json.dumps([[c.number, c.attempt] for c in held]), flush=True)
    n = 0
    while True:
        for c in store.claim(batch_id, 3):
            assert store.record(c, 200, json.dumps({"n": c.number}).encode(), f"child-{c.number}")
            n += 1
            print(n, flush=True)
""")


def test_killed_with_sigkill_mid_batch_resumes_with_one_result_per_custom_id(tmp_path):
    folder = tmp_path / "b"
    lines = 400
    store = Store.open(folder, Limits())
    batch_id = started(store, jsonl(lines))
    store.close()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), batch_id], stdout=subprocess.PIPE,
                             cwd=REPO, text=True)
    try:
        assert child.stdout is not None
        held = json.loads(child.stdout.readline())
        deadline = time.monotonic() + 60
        while int(child.stdout.readline() or 0) < 100:  # killed in the middle of its stream of results
            assert time.monotonic() < deadline and child.poll() is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    again = Store.open(folder, Limits())
    counts = again.batch(batch_id, "alice")["request_counts"]
    assert counts["total"] == lines and 100 <= counts["completed"] < lines - 5
    rest = again.claim(batch_id, lines)
    # the attempts the crash interrupted are forgotten: their late answers are refused, even now
    # that the same lines run again
    for number, attempt in held:
        stale = Claimed(batch_id, number, f"req-{number - 1}", "m", b"", attempt)
        assert not again.record(stale, 200, b'{"stale": true}', "stale")
        assert not again.requeue(stale, "stale")
    for c in rest:
        assert again.record(c, 200, json.dumps({"n": c.number}).encode(), "parent")
    assert again.claim(batch_id, lines) == []
    assert {c.number for c in rest} >= {n for n, _ in held}
    assert all(c.attempt == 2 for c in rest if c.number in {n for n, _ in held})
    assert again.finish_ready() == [batch_id]
    done = again.finalize(batch_id)
    assert done["status"] == "completed" and done["request_counts"] == {"total": lines, "completed": lines, "failed": 0}
    output = read(again, done["output_file_id"])
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(lines))
    assert all(o["response"]["body"] == {"n": int(o["custom_id"][4:]) + 1} for o in output)
    assert not any(o["response"]["body"].get("stale") for o in output)
    assert done["error_file_id"] is None
    again.close()


FINALIZER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from vsup.batch.store import Limits, Store

    store = Store.open(Path(sys.argv[1]), Limits())
    n = 0
    while store.finalize(sys.argv[2], step=3)["status"] == "finalizing":
        n += 1
        print(n, flush=True)
""")


def test_killed_with_sigkill_while_finalizing_ends_with_every_line_once(tmp_path):
    folder = tmp_path / "b"
    lines = 1000
    store = Store.open(folder, Limits())
    batch_id = started(store, jsonl(lines))
    for c in store.claim(batch_id, lines):
        store.record(c, 200 if c.number % 3 else 500, json.dumps({"n": c.number}).encode(), "r")
    store.close()
    child = subprocess.Popen([sys.executable, "-c", FINALIZER, str(folder), batch_id], stdout=subprocess.PIPE,
                             cwd=REPO, text=True)
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while int(child.stdout.readline() or 0) < 50:  # in the middle of its steps
            assert time.monotonic() < deadline and child.poll() is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    again = Store.open(folder, Limits())  # recover() finishes it
    done = again.batch(batch_id, None)
    assert done["status"] == "completed" and done["request_counts"] == {"total": lines, "completed": 667, "failed": 333}
    written = read(again, done["output_file_id"]) + read(again, done["error_file_id"])
    assert sorted(o["custom_id"] for o in written) == sorted(f"req-{i}" for i in range(lines))
    assert all(o["response"]["body"] == {"n": int(o["custom_id"][4:]) + 1} for o in written)
    again.close()


def test_a_second_process_on_the_same_folder_is_refused_until_the_first_closes(tmp_path):
    folder = tmp_path / "b"
    first = Store.open(folder, Limits())
    with pytest.raises(VsupError, match=r"batch\.dir: another vsup uses the batch store in .*give this one a batch\.dir of its own"):
        Store.open(folder, Limits())
    first.close()
    Store.open(folder, Limits()).close()  # the lock went with the first
    (folder / "store.lock").unlink()
    (folder / "store.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(VsupError, match=r"batch\.dir: cannot open .*store\.lock"):
        Store.open(folder, Limits())
    assert not (tmp_path / "elsewhere").exists()


def test_an_answer_goes_into_the_output_as_it_came_and_text_stays_text(tmp_path):
    store = Store.open(tmp_path / "b", Limits())
    batch_id = started(store, jsonl(3))
    lines = store.claim(batch_id, 3)
    exact = b'{"object": "list", "data": [{"embedding": [0.10000000000000001, 1e-07, -0.0]}], "note": "caf\\u00e9 \xe2\x9c\x93"}'
    store.record(lines[0], 200, exact, "r0")
    store.record(lines[1], 502, b"upstream says <no>\n", "r1")  # not JSON: kept as a string
    store.record(lines[2], 200, b'{"deep": ' * 3 + b'1' + b'}' * 3, "r2")
    done = store.finalize(batch_id)
    raw_output = b"".join(store.content(done["output_file_id"], None))
    assert exact in raw_output  # spliced byte for byte: no float or escape rewritten
    output, errors = read(store, done["output_file_id"]), read(store, done["error_file_id"])
    assert output[0]["response"]["body"]["data"][0]["embedding"] == [0.1, 1e-07, -0.0]
    assert output[1]["response"]["body"] == {"deep": {"deep": {"deep": 1}}}
    assert errors[0]["response"]["body"] == "upstream says <no>\n" and errors[0]["error"] is None
    store.close()
