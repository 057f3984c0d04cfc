"""The OpenAI Batch API's routes: /v1/files and /v1/batches in OpenAI's shapes, over the batch store
(vsup/batch/store.py), so the openai SDK's `client.files` and `client.batches` work unchanged.

    POST   /v1/files                     multipart (`purpose`=batch, `file`) -> the file object
    GET    /v1/files                     ?purpose=&after=&limit=&order= -> a list page
    GET    /v1/files/{file_id}           the file object
    GET    /v1/files/{file_id}/content   its bytes (streamed: memory stays bounded for big files)
    DELETE /v1/files/{file_id}           {"id", "object": "file", "deleted": true}
    POST   /v1/batches                   {input_file_id, endpoint, completion_window: "24h", metadata}
    GET    /v1/batches                   ?after=&limit= -> a list page
    GET    /v1/batches/{batch_id}        the batch object
    POST   /v1/batches/{batch_id}/cancel the batch, cancelling

`owner` is the client key's name ("" without keys) and None for an admin key, which sees every
owner's objects (what it creates belongs to "", which no named key is). Another owner's object is
answered exactly as a missing one (the store words both the same): no existence oracle.

An upload is never held in memory: python-multipart parses the body as it arrives, the file's
bytes go to a spool file in the batch folder (0600, created with O_EXCL|O_NOFOLLOW and unlinked at
once, so nothing is left behind even by a kill -9), counted as they come; past
batch.max_file_bytes the reading stops and the answer is 413 naming the key (the connection then
ends). A declared Content-Length over it is refused before a byte is read, and before the
`100 Continue` a client sending `Expect: 100-continue` waits for.

Every refusal is OpenAI's error JSON naming the param; an unexpected failure of the store is
logged once and answered 500 with no internals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from multidict import MultiDictProxy
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from vsup.batch.errors import BadInput, BatchError, TooLarge
from vsup.proxy import errors
from vsup.proxy.messages import HTTP_11, Answer, BadRequest, Request, Response, StreamAnswer

if TYPE_CHECKING:
    from vsup.batch.store import Store

log = logging.getLogger("vsup.proxy")

# The paths answered here: these and those below them (server.py's dispatch asks is_batch_path).
BATCH_PREFIXES = ("/v1/files", "/v1/batches")
ROUTES_TEXT = ("/v1/files, /v1/files/{file_id}, /v1/files/{file_id}/content, /v1/batches, /v1/batches/{batch_id} and"
               " /v1/batches/{batch_id}/cancel")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# An upload's body beyond its file's bytes: the multipart framing, the part headers and text fields.
FORM_SLACK = 1024 * 1024
PART_HEAD_BYTES = 16 * 1024   # one part's headers
FIELD_BYTES = 16 * 1024       # the text fields' values, together
MAX_PARTS = 32
# A POST /v1/batches body: 16 metadata pairs of 64 + 512 characters are ~10 KiB of JSON.
JSON_BYTES = 1024 * 1024
# File content up to this is answered in one write; bigger is streamed piece by piece.
WHOLE_BYTES = 1024 * 1024
# An upload or body that sends nothing for this long is dropped (408).
READ_TIMEOUT = 60.0
_JSON = "application/json"
_CREATE_KEYS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})

Handler = Callable[..., Awaitable[Answer]]


def is_batch_path(path: str) -> bool:
    """Whether `path` (percent-decoded) is the Batch API's: /v1/files, /v1/batches or below them."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in BATCH_PREFIXES)


def error(exc: BatchError) -> Response:
    return Response(status=exc.status, body=json.dumps(exc.body()).encode(), content_type=_JSON)


def _json(document: Any, status: int = 200) -> Response:
    return Response(status=status, body=json.dumps(document).encode(), content_type=_JSON)


def _page(data: list[dict], has_more: bool) -> Response:
    """A cursor page as OpenAI lists it (the SDK's next page asks `after` = the last id)."""
    return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None, "has_more": has_more})


def _internal() -> Response:
    return errors.error_response(500, "the batch store failed on this request; the proxy's log says why",
                                 "server_error", "internal_error")


def _no_route() -> Response:
    return errors.error_response(404, f"no Batch API route at this path: {ROUTES_TEXT} are", "invalid_request_error",
                                 "not_found")


def _wrong_method(template: str, allowed: list[str]) -> Response:
    allow = ", ".join(sorted(allowed))
    return errors.error_response(405, f"{template} answers {allow} only", "invalid_request_error", "method_not_allowed",
                                 headers={"Allow": allow})


def _number(query: MultiDictProxy[str], name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter in [low, high]; BadInput naming it otherwise."""
    text = query.get(name)
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise BadInput(f"{name} {text[:100]!r} is not a whole number; {low} to {high} works", name) from None
    if not low <= value <= high:
        raise BadInput(f"{name} {value} is out of range; {low} to {high} works", name)
    return value


def _text(query: MultiDictProxy[str], name: str) -> str | None:
    value = query.get(name)
    return value if value else None  # `after=` sent empty: as not sent


def _expect_continue(request: Request) -> None:
    """Tell a client that sent `Expect: 100-continue` to send its body (the checks on its head passed)."""
    expect = request.expect
    if expect is None or expect.lower() != "100-continue" or request.version != HTTP_11 or not request.body_exists:
        return
    transport = request.transport
    if transport is not None and not transport.is_closing():
        transport.write(CONTINUE)


async def _piece(request: Request, timeout: float) -> bytes:
    """The body's next piece (b"" at its end); BadInput for a body the parser refused, 408 for a
    client silent past `timeout`."""
    try:
        return await asyncio.wait_for(request.content.readany(), timeout)
    except TimeoutError:
        raise BatchError(408, f"the request body sent nothing for {timeout:g} s", "request_timeout") from None
    except BadRequest as exc:
        raise BadInput(exc.message) from None


class _Form:
    """A multipart/form-data upload parsed as it arrives: the `file` part's bytes into `spool`
    (at most `limit` of them), the text fields kept (small, few). Refusals are BatchErrors raised
    from `feed` / `finish`."""

    def __init__(self, boundary: bytes, spool: BinaryIO, limit: int) -> None:
        self.spool = spool
        self.limit = limit
        self.size = 0            # the file's bytes so far
        self.filename: str | None = None  # None: no file part (yet)
        self.fields: dict[str, str] = {}
        self.field_bytes = 0
        self.parts = 0
        self.done = False
        # the part being parsed
        self.head_bytes = 0
        self.header = b""
        self.value = b""
        self.disposition = b""
        self.into: str | None = None   # "file", a field's name, or None (a part skipped)
        self.data: list[bytes] = []
        callbacks = {"on_part_begin": self._begin, "on_header_field": self._header_field,
                     "on_header_value": self._header_value, "on_header_end": self._header_end,
                     "on_headers_finished": self._headers_done, "on_part_data": self._data,
                     "on_part_end": self._end, "on_end": self._finished}
        self.parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]

    def feed(self, data: bytes) -> None:
        try:
            self.parser.write(data)
        except (MultipartParseError, ValueError) as exc:
            raise BadInput(f"the upload is not a multipart/form-data body that can be read ({exc})", "file") from None

    def finish(self) -> None:
        try:
            self.parser.finalize()
        except (MultipartParseError, ValueError) as exc:
            raise BadInput(f"the upload is not a multipart/form-data body that can be read ({exc})", "file") from None
        if not self.done:
            raise BadInput("the upload ended before the form's closing boundary", "file")

    # -- python-multipart's callbacks

    def _begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise BadInput(f"the form has more than {MAX_PARTS} parts; send `purpose` and `file`", "file")
        self.head_bytes = 0
        self.header = self.value = self.disposition = b""
        self.into = None
        self.data = []

    def _count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > PART_HEAD_BYTES:
            raise BadInput(f"a part of the form has more than {PART_HEAD_BYTES} bytes of headers", "file")

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_head(end - start)
        self.header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_head(end - start)
        self.value += data[start:end]

    def _header_end(self) -> None:
        if self.header.strip().lower() == b"content-disposition":
            self.disposition = self.value
        self.header = self.value = b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self.disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name == "file":
            if self.filename is not None:
                raise BadInput("the form has more than one `file`; upload one file per request", "file")
            # the client's name for it, kept as data (shown and returned, never used as a path)
            self.filename = options.get(b"filename", b"").decode("utf-8", "replace") or "upload"
            self.into = "file"
        elif b"filename" in options:
            raise BadInput(f"the form has a file in {name[:64]!r}; the file goes in the field `file`", name[:64] or "file")
        else:
            self.into = name

    def _data(self, data: bytes, start: int, end: int) -> None:
        size = end - start
        if self.into == "file":
            self.size += size
            if self.size > self.limit:
                raise TooLarge("batch.max_file_bytes", self.limit, f"the file (more than {self.limit} bytes)")
            self.spool.write(data[start:end])
        elif self.into is not None:
            self.field_bytes += size
            if self.field_bytes > FIELD_BYTES:
                raise BadInput(f"the form's text fields have more than {FIELD_BYTES} bytes; send `purpose` and `file`",
                               self.into[:64] or "purpose")
            self.data.append(data[start:end])

    def _end(self) -> None:
        if self.into is not None and self.into != "file":
            value = self.fields[self.into] = b"".join(self.data).decode("utf-8", "replace")  # the last of a repeated one
            if self.into == "purpose" and value != "batch":  # refused now, not after the whole file (the store's words)
                raise BadInput(f"purpose {value[:64]!r} cannot be uploaded here; \"batch\" works", "purpose")

    def _finished(self) -> None:
        self.done = True


class BatchRoutes:
    """The Batch API's routes over `store` (see the module's docstring). `wake()` tells the runner
    a batch was created or cancelled; `served(model)` says whether a model is served here (not
    consulted by the routes today: a batch's lines are checked by the runner's validation, which
    takes the same callable); `spool_dir`: the folder uploads are spooled in (the batch store's
    own, 0700). Uploads being received count against batch.max_total_bytes with what the store
    holds, so concurrent uploads cannot fill the disk past it before the store sees them."""

    def __init__(self, store: Store, wake: Callable[[], None], served: Callable[[str], bool], spool_dir: Path,
                 *, read_timeout: float = READ_TIMEOUT) -> None:
        self.store = store
        self.wake = wake
        self.served = served
        self.spool_dir = Path(spool_dir)
        self.read_timeout = read_timeout
        self.spooling = 0  # the file bytes of uploads being received (on disk, not in the store yet)
        # (collection, has an id, sub-resource) -> {method: handler}
        self._table: dict[tuple[str, bool, str | None], dict[str, Handler]] = {
            ("files", False, None): {"GET": self._list_files, "POST": self._upload},
            ("files", True, None): {"GET": self._file, "DELETE": self._delete_file},
            ("files", True, "content"): {"GET": self._content},
            ("batches", False, None): {"GET": self._list_batches, "POST": self._create},
            ("batches", True, None): {"GET": self._batch},
            ("batches", True, "cancel"): {"POST": self._cancel},
        }

    async def handle(self, request: Request, owner: str | None) -> Answer:
        """Answer one request under /v1/files or /v1/batches for `owner` (None: an admin)."""
        found = self._route(request.path)
        if found is None:
            return _no_route()
        key, ident = found
        methods = self._table[key]
        handler = methods.get(request.method)
        if handler is None:
            return _wrong_method(_template(key), list(methods))
        try:
            return await (handler(request, owner, ident) if key[1] else handler(request, owner))
        except BatchError as exc:
            return error(exc)
        except ConnectionError:  # the client left mid-body: nothing to tell it, nothing to log
            return _closing(errors.bad_request("the client closed the connection"))
        except Exception:  # a bug or the store's disk: logged once, the client gets no internals
            log.exception("batch API: %s %s failed", request.method, _template(key))
            return _internal()

    def _route(self, path: str) -> tuple[tuple[str, bool, str | None], str] | None:
        words = path.split("/")  # "", "v1", collection[, id[, sub]]
        if len(words) < 3 or words[1] != "v1" or words[2] not in ("files", "batches") or len(words) > 5:
            return None
        ident = words[3] if len(words) > 3 else ""
        if len(words) > 3 and not ident:
            return None  # "/v1/files/" or "/v1/files//content"
        sub = words[4] if len(words) > 4 else None
        key = (words[2], len(words) > 3, sub)
        return (key, ident) if key in self._table else None

    def _creator(self, owner: str | None) -> str:
        """Whom what `owner` creates belongs to: an admin's to "" (no named key's; admins see it)."""
        return "" if owner is None else owner

    # -- files

    async def _upload(self, request: Request, owner: str | None) -> Response:
        limit = self.store.limits.max_file_bytes
        kind, params = parse_options_header(request.content_type)
        if kind != b"multipart/form-data" or not params.get(b"boundary"):
            return error(BadInput("upload the file as multipart/form-data with the fields `purpose` (batch) and `file`",
                                  "file"))
        declared = request.content_length
        if declared is not None and declared > limit + FORM_SLACK:
            return _closing(error(TooLarge("batch.max_file_bytes", limit, f"the upload ({declared} bytes)")))
        if not request.body_exists:
            return error(BadInput("the upload is empty: send the fields `purpose` (batch) and `file`", "file"))
        total = self.store.limits.max_total_bytes
        held = self.store.usage()
        spool = self._spool()
        handed = False
        spooled = 0  # this upload's part of self.spooling
        try:
            form = _Form(params[b"boundary"], spool, limit)
            _expect_continue(request)
            received = 0
            try:
                while piece := await _piece(request, self.read_timeout):
                    received += len(piece)
                    if received > limit + FORM_SLACK:
                        raise TooLarge("batch.max_file_bytes", limit, f"the upload (more than {received} bytes)")
                    form.feed(piece)
                    if form.size > spooled:
                        self.spooling += form.size - spooled
                        spooled = form.size
                        if held + self.spooling > total:
                            raise TooLarge("batch.max_total_bytes", total,
                                           f"the uploads in progress ({self.spooling} bytes, {held} held)")
                form.finish()
            except BatchError as exc:
                return _closing(error(exc))  # the rest of the body is not read: the connection ends
            if form.filename is None:
                return error(BadInput("the form has no `file`: send the JSONL file in the field `file`", "file"))
            purpose = form.fields.get("purpose")
            if purpose is None:
                return error(BadInput("the form has no `purpose`: send purpose=batch", "purpose"))
            spool.flush()
            spool.seek(0)
            self.spooling -= spooled  # from here the store counts it (add_file checks the total as it writes)
            spooled = 0
            handed = True  # the thread closes it, even if this request is cancelled meanwhile
            created = await asyncio.to_thread(_add_file, self.store, self._creator(owner), form.filename, purpose,
                                              spool, form.size)
            return _json(created)
        finally:
            self.spooling -= spooled
            if not handed:
                spool.close()

    def _spool(self) -> BinaryIO:
        """A new private file in the spool folder, already unlinked: only this descriptor reaches it."""
        folder = os.open(self.spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            name = f".upload-{secrets.token_hex(8)}"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
            try:
                os.unlink(name, dir_fd=folder)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(folder)
        return os.fdopen(fd, "w+b")

    async def _list_files(self, request: Request, owner: str | None) -> Response:
        query = request.query
        limit = _number(query, "limit", 10000, 1, 10000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadInput(f"order {order[:100]!r} is not one of \"asc\", \"desc\"", "order")
        page, more = self.store.files(owner, purpose=_text(query, "purpose"), after=_text(query, "after"),
                                      limit=limit, order=order)
        return _page(page, more)

    async def _file(self, request: Request, owner: str | None, file_id: str) -> Response:
        return _json(self.store.file(file_id, owner))

    async def _delete_file(self, request: Request, owner: str | None, file_id: str) -> Response:
        return _json(self.store.delete_file(file_id, owner))

    async def _content(self, request: Request, owner: str | None, file_id: str) -> Answer:
        size = self.store.file(file_id, owner)["bytes"]
        pieces = self.store.content(file_id, owner)
        if size <= WHOLE_BYTES:
            body = b"".join(pieces)
            if len(body) != size:
                raise RuntimeError(f"{file_id} has {len(body)} bytes where its object says {size}")
            return Response(body=body, content_type="application/octet-stream")
        return await self._stream(request, pieces, size, file_id)

    async def _stream(self, request: Request, pieces: Iterator[bytes], size: int, file_id: str) -> Answer:
        """A big file's bytes a piece (≤ 1 MiB) at a time, waiting for the client to take each:
        memory stays bounded however big the file is. A file that ends short (deleted meanwhile)
        is not ended: the connection is cut, so the client cannot take it for the whole file."""
        answer = StreamAnswer(request, 200)
        sink = answer.start(b"Content-Type: application/octet-stream\r\n")
        if sink is None:
            return answer
        sent = 0
        try:
            for piece in pieces:
                sent += len(piece)
                if sink.write(piece):
                    await sink.drain()
                if sink.gone():
                    return answer
        except Exception:
            log.exception("batch API: reading %s failed after %d bytes", file_id, sent)
            return answer  # not complete: the connection is cut
        if sent != size:
            log.warning("batch API: %s ended at %d of its %d bytes (deleted while it was read?)", file_id, sent, size)
            return answer
        sink.end(b"")
        return answer

    # -- batches

    async def _create(self, request: Request, owner: str | None) -> Response:
        document = await self._read_json(request)
        for name in document:
            if name not in _CREATE_KEYS:
                raise BadInput(f"unrecognized request argument supplied: {name[:64]}; a batch takes input_file_id, "
                               "endpoint, completion_window and metadata", name[:64])
        args: dict[str, str] = {}
        for name, what in (("input_file_id", "the id of a file uploaded with purpose batch"),
                           ("endpoint", "/v1/chat/completions, /v1/completions, /v1/embeddings, ..."),
                           ("completion_window", '"24h"')):
            value = document.get(name)
            if not isinstance(value, str):
                missing = "is missing" if value is None else f"must be a string, not {type(value).__name__}"
                raise BadInput(f"{name} {missing}: {what} works", name)
            args[name] = value
        metadata = document.get("metadata")
        created = self.store.create(self._creator(owner), args["input_file_id"], args["endpoint"],
                                    args["completion_window"], metadata)
        self.wake()
        return _json(created)

    async def _read_json(self, request: Request) -> dict:
        """The request body as a JSON object (at most JSON_BYTES)."""
        declared = request.content_length
        if declared is not None and declared > JSON_BYTES:
            raise BatchError(413, f"the request body ({declared} bytes) is over {JSON_BYTES} bytes", "request_too_large")
        _expect_continue(request)
        parts: list[bytes] = []
        size = 0
        while piece := await _piece(request, self.read_timeout):
            size += len(piece)
            if size > JSON_BYTES:
                raise BatchError(413, f"the request body is over {JSON_BYTES} bytes", "request_too_large")
            parts.append(piece)
        try:
            document = json.loads(b"".join(parts))
        except (ValueError, UnicodeDecodeError):
            raise BadInput("the request body is not JSON: send a JSON object") from None
        if not isinstance(document, dict):
            raise BadInput("the request body must be a JSON object")
        return document

    async def _list_batches(self, request: Request, owner: str | None) -> Response:
        query = request.query
        limit = _number(query, "limit", 20, 1, 100)
        page, more = self.store.batches(owner, after=_text(query, "after"), limit=limit)
        return _page(page, more)

    async def _batch(self, request: Request, owner: str | None, batch_id: str) -> Response:
        return _json(self.store.batch(batch_id, owner))

    async def _cancel(self, request: Request, owner: str | None, batch_id: str) -> Response:
        cancelled = self.store.cancel(batch_id, owner)
        self.wake()
        return _json(cancelled)


def _add_file(store: Store, owner: str, filename: str, purpose: str, spool: BinaryIO, size: int) -> dict:
    """store.add_file off the event loop (copying a big upload into SQLite takes a while); owns `spool`."""
    try:
        return store.add_file(owner, filename, purpose, spool, size)
    finally:
        spool.close()


def _closing(response: Response) -> Response:
    """An answer sent before the body was read whole: the connection ends after it."""
    response.force_close()
    return response


def _template(key: tuple[str, bool, str | None]) -> str:
    collection, has_id, sub = key
    path = f"/v1/{collection}"
    if has_id:
        path += "/{file_id}" if collection == "files" else "/{batch_id}"
    return path + (f"/{sub}" if sub else "")
