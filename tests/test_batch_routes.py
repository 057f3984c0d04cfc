"""The Batch API's routes (vsup/proxy/batch_routes.py) over real sockets: the proxy's own front door
(client_conn.FrontServer) dispatching to BatchRoutes over a real Store in tmp_path, driven by the
real `openai` SDK (client.files, client.batches) and, for what the SDK cannot send, raw HTTP.
There is no runner here: batches stay `validating`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from vsup.batch.store import Limits, Store
from vsup.config.schema import ProxyConfig
from vsup.proxy import errors
from vsup.proxy.batch_routes import WHOLE_BYTES, BatchRoutes, is_batch_path
from vsup.proxy.client_conn import FrontServer
from vsup.proxy.clients import ClientPolicy
from vsup.proxy.messages import Request
from vsup.proxy.metrics import ProxyMetrics

# The test's keys -> owners: two tenants and an admin (None sees everything).
OWNERS: dict[str, str | None] = {"key-alice": "alice", "key-bob": "bob", "key-admin": None}
LINE = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
INPUT = (json.dumps(LINE) + "\n").encode()


@dataclass
class Served:
    port: int
    store: Store
    folder: Path
    wakes: list[int] = field(default_factory=list)
    clients: dict[str, openai.AsyncOpenAI] = field(default_factory=dict)

    def client(self, key: str = "key-alice") -> openai.AsyncOpenAI:
        """The SDK as a tenant uses it, with the key `key` (one client per key, closed at the end)."""
        if key not in self.clients:
            self.clients[key] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                                                   max_retries=0, timeout=20)
        return self.clients[key]


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, read_timeout: float = 60.0, **limits):
    folder = tmp_path / "batches"
    store = Store.open(folder, Limits(**limits))
    served = Served(0, store, folder)
    routes = BatchRoutes(store, lambda: served.wakes.append(1), lambda model: True, folder, read_timeout=read_timeout)

    async def dispatch(request: Request):
        key = request.authorization.removeprefix("Bearer ")
        if key not in OWNERS:
            return errors.unauthorized()
        if not is_batch_path(request.path):
            return errors.not_found(request.path)
        return await routes.handle(request, OWNERS[key])

    server = FrontServer(dispatch, ClientPolicy(ProxyMetrics(dict, list, lambda name: True, dict), ProxyConfig(port=0)))
    served.port = await server.listen("127.0.0.1", 0)
    try:
        yield served
    finally:
        for client in served.clients.values():
            await client.close()
        await server.close(0.2)
        store.close()


# -- raw HTTP ----------------------------------------------------------------------------------------

def multipart(fields: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> tuple[bytes, str]:
    """(body, content type) of a form: (name, filename or None, value) per part."""
    out = b""
    for name, filename, value in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename is not None:
            out += b"Content-Type: application/jsonl\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def request_bytes(method: str, path: str, key: str = "key-alice", body: bytes | None = None,
                  headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {key}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None and not any(name.lower() == "transfer-encoding" for name in headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


@dataclass
class Answer:
    status: int
    head: bytes
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def parse(data: bytes) -> Answer:
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
    elif "content-length" in headers:
        body = rest[: int(headers["content-length"])]
    else:
        body = rest
    return Answer(int(lines[0].split()[1]), head, headers, body)


async def raw(port: int, data: bytes) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return parse(await asyncio.wait_for(reader.read(), 10))
    finally:
        writer.close()


async def call(served: Served, method: str, path: str, key: str = "key-alice", body: bytes | None = None,
               headers: dict[str, str] | None = None) -> Answer:
    return await raw(served.port, request_bytes(method, path, key, body, headers))


def spooled(folder: Path) -> list[str]:
    """Anything but the store's own files in the batch folder (a spool file left behind, a planted name)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("batches.sqlite3") and p.name != "store.lock")


def open_files() -> list[tuple[Path, str]]:
    """This process's open descriptors and what each names (the one listing /proc/self/fd is gone by then)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found.append((fd, os.readlink(fd)))
    return found


# -- the SDK, unchanged ---------------------------------------------------------------------------------

async def test_the_openai_sdk_uploads_lists_reads_creates_and_cancels(tmp_path):
    async with serving(tmp_path) as served:
        client = served.client()
        uploaded = await client.files.create(file=("input.jsonl", INPUT), purpose="batch")
        assert uploaded.id.startswith("file-") and uploaded.object == "file"
        assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(INPUT), "input.jsonl", "batch")
        assert (await client.files.retrieve(uploaded.id)).model_dump() == uploaded.model_dump()
        assert [f.id async for f in client.files.list()] == [uploaded.id]
        assert [f.id async for f in client.files.list(purpose="batch_output")] == []
        assert (await client.files.content(uploaded.id)).read() == INPUT
        assert spooled(served.folder) == []  # the spool file went with the upload

        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"team": "search"})
        assert batch.id.startswith("batch_") and batch.status == "validating"
        assert (batch.input_file_id, batch.endpoint, batch.metadata) == (uploaded.id, "/v1/chat/completions", {"team": "search"})
        assert served.wakes == [1]  # the runner is told at once
        assert (await client.batches.retrieve(batch.id)).status == "validating"
        assert [b.id async for b in client.batches.list()] == [batch.id]

        # the input of a batch that has not ended cannot be deleted: 409, as the SDK's ConflictError
        with pytest.raises(openai.ConflictError):
            await client.files.delete(uploaded.id)
        cancelled = await client.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
        assert served.wakes == [1, 1]

        other = await client.files.create(file=("other.jsonl", INPUT), purpose="batch")
        deleted = await client.files.delete(other.id)
        assert (deleted.id, deleted.deleted) == (other.id, True)
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(other.id)


async def test_a_big_file_is_streamed_back_whole_in_chunks(tmp_path):
    data = b"".join(b'{"custom_id": "%d", "pad": "%s"}\n' % (i, secrets.token_hex(40).encode()) for i in range(40000))
    assert len(data) > 3 * WHOLE_BYTES
    async with serving(tmp_path) as served:
        uploaded = await served.client().files.create(file=("big.jsonl", data), purpose="batch")
        assert uploaded.bytes == len(data)
        assert (await served.client().files.content(uploaded.id)).read() == data
        answer = await call(served, "GET", f"/v1/files/{uploaded.id}/content")
        assert answer.status == 200 and answer.headers["transfer-encoding"] == "chunked"
        assert answer.headers["content-type"] == "application/octet-stream" and answer.body == data
        small = await call(served, "GET", f"/v1/files/{(await served.client().files.create(file=('s.jsonl', INPUT), purpose='batch')).id}/content")
        assert small.headers["content-length"] == str(len(INPUT)) and small.body == INPUT


# -- uploads: limits, 100-continue, hostile names -----------------------------------------------------

async def test_an_upload_declared_over_the_limit_is_refused_before_any_byte_is_read(tmp_path):
    async with serving(tmp_path, max_file_bytes=1000) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", "big.jsonl", b"x" * 5_000_000)])
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        head = request_bytes("POST", "/v1/files", body=form, headers={"Content-Type": kind, "Expect": "100-continue"})
        writer.write(head[: head.index(b"\r\n\r\n") + 4])  # the head alone: the client waits for 100 Continue
        answer = parse(await asyncio.wait_for(reader.read(), 10))  # the answer, then the close
        writer.close()
        assert answer.status == 413 and b"100 Continue" not in answer.head
        body = answer.json()["error"]
        assert "batch.max_file_bytes" in body["message"] and "1000" in body["message"], body
        assert answer.headers.get("connection") == "close"
        assert served.store.files(None) == ([], False) and spooled(served.folder) == []


FORM_HEAD = (b'--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n%b\r\n'
             b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n')


async def stream_upload(served: Served, purpose: bytes = b"batch", total: int = 64 * 1024 * 1024) -> tuple[Answer, int]:
    """A chunked upload of a `total`-byte file, sent until the proxy answers: (its answer, the file
    bytes sent). `total` is far more than the sockets' buffers hold, so an answer before the body's
    end shows the proxy stopped reading."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    kind = "multipart/form-data; boundary=b0undary"
    writer.write(request_bytes("POST", "/v1/files", headers={"Content-Type": kind, "Transfer-Encoding": "chunked"}))
    answered = asyncio.create_task(reader.read())
    piece = b"y" * 65536
    sent = 0
    with contextlib.suppress(ConnectionError, TimeoutError):
        head = FORM_HEAD % purpose
        writer.write(b"%x\r\n%b\r\n" % (len(head), head))
        while sent < total and not answered.done():
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await asyncio.wait_for(writer.drain(), 3)
            sent += len(piece)
    answer = parse(await asyncio.wait_for(answered, 10))
    writer.close()
    return answer, sent


async def test_a_chunked_upload_over_the_limit_stops_at_the_limit_and_the_connection_ends(tmp_path):
    async with serving(tmp_path, max_file_bytes=100_000) as served:
        answer, sent = await stream_upload(served)
        assert answer.status == 413, answer
        error = answer.json()["error"]
        assert "batch.max_file_bytes" in error["message"] and error["code"] == "file_too_large"
        assert sent < 64 * 1024 * 1024  # answered (and the connection ended) long before the body's end
        assert served.store.files(None) == ([], False) and spooled(served.folder) == []


async def test_a_wrong_purpose_sent_first_is_refused_before_the_file_is_read(tmp_path):
    async with serving(tmp_path) as served:
        answer, sent = await stream_upload(served, purpose=b"fine-tune")
        assert answer.status == 400 and answer.json()["error"]["param"] == "purpose"
        assert sent < 64 * 1024 * 1024
        assert spooled(served.folder) == []


async def test_uploads_in_progress_count_against_the_stores_total(tmp_path):
    # one upload alone fits; two at once would take the store past max_total_bytes before either
    # reached it: the second is refused while the first is still arriving, and the first completes
    async with serving(tmp_path, max_total_bytes=3_000_000) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", "a.jsonl", INPUT * 16000)])
        assert 2_000_000 < len(form) < 3_000_000
        data = request_bytes("POST", "/v1/files", body=form, headers={"Content-Type": kind})
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(data[:-1000])  # all but its end: its bytes are spooled, not stored
        await writer.drain()
        for _ in range(500):
            if any(target.startswith(str(served.folder)) and os.stat(fd).st_size > 1_500_000 for fd, target in open_files()):
                break
            await asyncio.sleep(0.01)
        second, sent = await stream_upload(served, total=2_000_000)
        assert second.status == 413, second
        assert "batch.max_total_bytes" in second.json()["error"]["message"]
        assert sent < 2_000_000
        writer.write(data[-1000:])
        first = parse(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        assert first.status == 200 and first.json()["bytes"] == len(INPUT) * 16000


async def test_an_upload_that_stalls_is_408(tmp_path):
    async with serving(tmp_path, read_timeout=0.3) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", "in.jsonl", INPUT)])
        data = request_bytes("POST", "/v1/files", body=form, headers={"Content-Type": kind})
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(data[:-20])  # and then nothing
        answer = parse(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        assert answer.status == 408 and answer.json()["error"]["code"] == "request_timeout"
        assert served.store.files(None) == ([], False) and spooled(served.folder) == []


async def test_an_upload_over_the_stores_total_names_max_total_bytes(tmp_path):
    async with serving(tmp_path, max_total_bytes=len(INPUT) + 10) as served:
        client = served.client()
        await client.files.create(file=("a.jsonl", INPUT), purpose="batch")
        with pytest.raises(openai.APIStatusError) as refused:
            await client.files.create(file=("b.jsonl", INPUT), purpose="batch")
        assert refused.value.status_code == 413 and "batch.max_total_bytes" in refused.value.message


async def test_expect_100_continue_gets_continue_before_the_body_is_sent(tmp_path):
    async with serving(tmp_path) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", "in.jsonl", INPUT)])
        data = request_bytes("POST", "/v1/files", body=form, headers={"Content-Type": kind, "Expect": "100-continue"})
        head, body = data[: data.index(b"\r\n\r\n") + 4], data[data.index(b"\r\n\r\n") + 4:]
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(head)
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        answer = parse(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        assert answer.status == 200 and answer.json()["bytes"] == len(INPUT)


async def test_a_hostile_filename_is_stored_and_returned_as_data_never_used_as_a_path(tmp_path):
    hostile = '../../../escape\x1b[2J\u202e.jsonl'
    async with serving(tmp_path) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", hostile, INPUT)])
        answer = await call(served, "POST", "/v1/files", body=form, headers={"Content-Type": kind})
        assert answer.status == 200, answer
        created = answer.json()
        assert created["filename"] == hostile
        assert (await served.client().files.retrieve(created["id"])).filename == hostile
        assert spooled(served.folder) == [] and not (tmp_path / "escape\x1b[2J\u202e.jsonl").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["batches"]


@pytest.mark.parametrize(("fields", "content_type", "param"), [
    ([("file", "in.jsonl", INPUT)], None, "purpose"),
    ([("purpose", None, b"batch")], None, "file"),
    ([("purpose", None, b"fine-tune"), ("file", "in.jsonl", INPUT)], None, "purpose"),
    ([("purpose", None, b"batch"), ("file", "a.jsonl", INPUT), ("file", "b.jsonl", INPUT)], None, "file"),
    ([("purpose", None, b"batch"), ("file", "in.jsonl", INPUT)], "application/json", "file"),
])
async def test_a_bad_upload_is_400_naming_the_field(tmp_path, fields, content_type, param):
    async with serving(tmp_path) as served:
        form, kind = multipart(fields)
        answer = await call(served, "POST", "/v1/files", body=form, headers={"Content-Type": content_type or kind})
        assert answer.status == 400, answer
        assert answer.json()["error"]["param"] == param
        assert served.store.files(None) == ([], False) and spooled(served.folder) == []


async def test_a_form_cut_short_is_400_and_leaves_nothing(tmp_path):
    async with serving(tmp_path) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", "in.jsonl", INPUT)])
        answer = await call(served, "POST", "/v1/files", body=form[:-12], headers={"Content-Type": kind})
        assert answer.status == 400 and answer.json()["error"]["param"] == "file"
        assert served.store.files(None) == ([], False) and spooled(served.folder) == []


# -- ownership ------------------------------------------------------------------------------------

async def test_another_owners_file_and_batch_answer_exactly_as_missing_ones(tmp_path):
    async with serving(tmp_path) as served:
        alice = served.client("key-alice")
        mine = await alice.files.create(file=("in.jsonl", INPUT), purpose="batch")
        batch = await alice.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
        missing_file = "file-" + secrets.token_hex(16)
        missing_batch = "batch_" + secrets.token_hex(16)

        for method, template, real, fake in [
            ("GET", "/v1/files/{}", mine.id, missing_file),
            ("GET", "/v1/files/{}/content", mine.id, missing_file),
            ("DELETE", "/v1/files/{}", mine.id, missing_file),
            ("GET", "/v1/batches/{}", batch.id, missing_batch),
            ("POST", "/v1/batches/{}/cancel", batch.id, missing_batch),
            ("GET", "/v1/files?after={}", mine.id, missing_file),
            ("GET", "/v1/batches?after={}", batch.id, missing_batch),
        ]:
            theirs = await call(served, method, template.format(real), "key-bob")
            absent = await call(served, method, template.format(fake), "key-bob")
            assert theirs.status == 404, (template, theirs)
            assert theirs.head == absent.head and theirs.body == absent.body.replace(fake.encode(), real.encode()), template
        # bob cannot build a batch on alice's file either
        with pytest.raises(openai.NotFoundError) as refused:
            await served.client("key-bob").batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                                           completion_window="24h")
        assert refused.value.body["param"] == "input_file_id"  # type: ignore[index]

        bob = served.client("key-bob")
        assert [f.id async for f in bob.files.list()] == [] and [b.id async for b in bob.batches.list()] == []
        theirs_file = await bob.files.create(file=("bob.jsonl", INPUT), purpose="batch")
        # alice's objects are untouched by bob's tries
        assert (await alice.batches.retrieve(batch.id)).status == "validating"
        assert (await alice.files.content(mine.id)).read() == INPUT

        admin = served.client("key-admin")
        assert {f.id async for f in admin.files.list()} == {mine.id, theirs_file.id}
        assert [b.id async for b in admin.batches.list()] == [batch.id]
        assert (await admin.files.content(mine.id)).read() == INPUT
        assert (await admin.batches.retrieve(batch.id)).id == batch.id
        assert (await admin.batches.cancel(batch.id)).status == "cancelling"


# -- lists -----------------------------------------------------------------------------------------

async def test_pagination_of_files_and_batches(tmp_path):
    async with serving(tmp_path) as served:
        client = served.client()
        ids = [(await client.files.create(file=(f"{i}.jsonl", INPUT), purpose="batch")).id for i in range(5)]
        first = await client.files.list(limit=2)
        assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
        assert [f.id async for f in await client.files.list(limit=2)] == ids[::-1]  # the SDK pages on by `after`
        assert [f.id async for f in await client.files.list(limit=2, order="asc")] == ids
        page = (await call(served, "GET", f"/v1/files?limit=2&order=asc&after={ids[2]}")).json()
        assert ([f["id"] for f in page["data"]], page["has_more"], page["first_id"], page["last_id"]) == (
            ids[3:], False, ids[3], ids[4])

        batches = [(await client.batches.create(input_file_id=i, endpoint="/v1/embeddings", completion_window="24h")).id
                   for i in ids[:3]]
        one = await client.batches.list(limit=1)
        assert [b.id for b in one.data] == [batches[-1]] and one.has_more
        assert [b.id async for b in await client.batches.list(limit=1)] == batches[::-1]
        empty = (await call(served, "GET", "/v1/batches?limit=5", "key-bob")).json()
        assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/files?limit=abc", "limit"),
    ("/v1/files?limit=0", "limit"),
    ("/v1/files?limit=10001", "limit"),
    ("/v1/files?order=sideways", "order"),
    ("/v1/batches?limit=ten", "limit"),
    ("/v1/batches?limit=101", "limit"),
])
async def test_a_bad_query_value_is_400_naming_the_param(tmp_path, path, param):
    async with serving(tmp_path) as served:
        answer = await call(served, "GET", path)
        assert answer.status == 400 and answer.json()["error"]["param"] == param, answer


# -- creating a batch: bad input -------------------------------------------------------------------

@pytest.mark.parametrize(("change", "param"), [
    ({"completion_window": "48h"}, "completion_window"),
    ({"endpoint": "/v1/audio/speech"}, "endpoint"),
    ({"endpoint": 7}, "endpoint"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"input_file_id": None}, "input_file_id"),
    ({"surprise": True}, "surprise"),
])
async def test_a_bad_batch_is_400_naming_the_param(tmp_path, change, param):
    async with serving(tmp_path) as served:
        uploaded = await served.client().files.create(file=("in.jsonl", INPUT), purpose="batch")
        document = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        document.update(change)
        document = {k: v for k, v in document.items() if v is not None}
        answer = await call(served, "POST", "/v1/batches", body=json.dumps(document).encode(),
                            headers={"Content-Type": "application/json"})
        assert answer.status == 400, answer
        assert answer.json()["error"]["param"] == param
        assert served.store.batches(None) == ([], False) and served.wakes == []


async def test_metadata_at_openais_limits_is_taken(tmp_path):
    async with serving(tmp_path) as served:
        client = served.client()
        uploaded = await client.files.create(file=("in.jsonl", INPUT), purpose="batch")
        metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                            completion_window="24h", metadata=metadata)
        assert batch.metadata == metadata


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"text"'])
async def test_a_batch_body_that_is_no_json_object_is_400(tmp_path, body):
    async with serving(tmp_path) as served:
        answer = await call(served, "POST", "/v1/batches", body=body, headers={"Content-Type": "application/json"})
        assert answer.status == 400 and answer.json()["error"]["type"] == "invalid_request_error"


# -- routes and failures ---------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PUT", "/v1/files", "GET, POST"),
    ("POST", "/v1/files/file-x", "DELETE, GET"),
    ("DELETE", "/v1/files/file-x/content", "GET"),
    ("DELETE", "/v1/batches", "GET, POST"),
    ("DELETE", "/v1/batches/batch_x", "GET"),
    ("GET", "/v1/batches/batch_x/cancel", "POST"),
])
async def test_a_wrong_method_is_405_with_allow(tmp_path, method, path, allow):
    async with serving(tmp_path) as served:
        answer = await call(served, method, path)
        assert answer.status == 405 and answer.headers["allow"] == allow
        assert answer.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", ["/v1/files/", "/v1/files/x/y", "/v1/files/x/content/more", "/v1/batches/x/pause",
                                  "/v1/files//content", "/v1/filesystem"])
async def test_an_unknown_path_is_404(tmp_path, path):
    async with serving(tmp_path) as served:
        answer = await call(served, "GET", path)
        assert answer.status == 404 and answer.json()["error"]["code"] == "not_found"


def test_batch_paths():
    assert is_batch_path("/v1/files") and is_batch_path("/v1/batches/batch_1/cancel")
    assert not is_batch_path("/v1/filesystem") and not is_batch_path("/v1/chat/completions")


async def test_a_store_failure_is_500_without_internals_and_logged_once(tmp_path, caplog):
    async with serving(tmp_path) as served:
        uploaded = await served.client().files.create(file=("in.jsonl", INPUT), purpose="batch")
        served.store._db.close()  # the database gone from under the routes  # noqa: SLF001
        with caplog.at_level(logging.ERROR, logger="vsup.proxy"):
            answer = await call(served, "GET", f"/v1/files/{uploaded.id}")
        assert answer.status == 500
        error = answer.json()["error"]
        assert error["code"] == "internal_error" and "sqlite" not in answer.body.decode().lower()
        assert "Traceback" not in answer.body.decode()
        assert len([r for r in caplog.records if r.name == "vsup.proxy"]) == 1


async def test_an_upload_in_progress_is_spooled_in_a_private_file_already_unlinked(tmp_path):
    async with serving(tmp_path) as served:
        form, kind = multipart([("purpose", None, b"batch"), ("file", "in.jsonl", INPUT * 2000)])
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        data = request_bytes("POST", "/v1/files", body=form, headers={"Content-Type": kind})
        half = len(data) // 2
        writer.write(data[:half])
        await writer.drain()
        prefix = str(served.folder / ".upload-")
        spools: list[Path] = []
        for _ in range(200):  # until the routes have opened the spool and written to it
            spools = [fd for fd, target in open_files() if target.startswith(prefix) and os.stat(fd).st_size > 0]
            if spools:
                break
            await asyncio.sleep(0.01)
        assert len(spools) == 1, "the upload's spool file was never seen open"
        assert os.readlink(spools[0]).endswith(" (deleted)") and spooled(served.folder) == []
        assert os.stat(spools[0]).st_mode & 0o777 == 0o600
        writer.write(data[half:])
        answer = parse(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        assert answer.status == 200 and answer.json()["bytes"] == len(INPUT) * 2000
        assert not [target for _, target in open_files() if target.startswith(prefix)]
