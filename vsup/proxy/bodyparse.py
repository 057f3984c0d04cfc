"""A request body's JSON without stalling the event loop.

json.loads holds the GIL for as long as it runs (so does msgspec), and a body of many tiny values
costs it ~2 µs each: 1.2 s for a 5.6 MB object of 700k `{"a":1}`, during which no other request,
probe or stream moves. So:

  small    a body of at most `inline_bytes` (INLINE_BYTES) is parsed on the loop, by
           codec.parse_json, as before: the worst such body costs a few ms (measured below).
  not {    a larger body whose first non-blank byte is not `{` is refused at once (NotAnObject):
           the proxy only forwards JSON objects, and an array is the cheapest flood to send.
  large    any other is parsed by a worker process (bodyparse_worker.py), which sends back only
           the body's routing view: every top-level value kept except the large ones, cut to
           what routing reads (bodyparse_worker's docstring says exactly what). A 7 MiB body
           costs the loop 3-6 ms of CPU in all, in pieces: pipe writes of 1 MiB, a small read,
           a view of ~1.5 ms to decode at worst.

What the consumers then see for a large body (a RoutingView: a dict, plus the keys cut short in
`trimmed` and the count of keys left out in `dropped`): forward.py's `model` and `stream`, the
gate's max_tokens family and every other small value exactly. affinity.routing_key: exactly the
body's for every prefix_chars up to `prefix_limit` (the messages, prompt, instructions and input
are kept to that many characters of text as affinity counts it), unless the view's budget runs out
first: ~400 empty leading messages at the default prefix_chars. kv_aware.tokenize_body: the same
fields, but the messages (or prompt, or token ids) only up to `prefix_limit` characters:
/tokenize then returns the first ~prefix_limit / 4 tokens, and the instance is picked by the
cached blocks among those (a 64 KiB default: ~16k tokens, 128 of the CPU backend's blocks), not by
the whole prompt's; an image after the cut is not seen (its leading blocks are asked for). A body
of at most INLINE_BYTES is never cut. The forwarded body is always the one the client sent, whole.

Errors are the inline path's: ValueError (json.JSONDecodeError, with json's message),
UnicodeDecodeError, RecursionError (nested too deeply); plus NotAnObject for a large body that is
not an object (400 "must be a JSON object"), and ParserUnavailable when the worker cannot answer
(it died, timed out or could not start; the proxy is stopping): 503, the body itself may be fine.

The worker: one process per concurrent parse (`concurrency`, 1 by default: a core's worth at
most), started with the first large body (~100-200 ms on a busy box), reused, started again
after it dies (one that died idle, or before it had the whole body, is replaced and the body goes
to the new one), a round trip bounded by `timeout` (then killed). Waiters take turns by client.
It exits when its stdin closes: aclose(), or the proxy's death. Its stderr goes to /dev/null; a
death is logged here, one line. Its memory: 12 MiB idle; while it parses a pathological body up
to ~30x the body's size (8 MiB of `[]`: 230 MiB), returned after.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import pickle
import re
import sys
from collections import OrderedDict, deque
from typing import Any

from vsup.proxy import bodyparse_worker as worker_protocol
from vsup.proxy.codec import parse_json

logger = logging.getLogger(__name__)

# The largest body parsed on the loop. parse_json's worst body of a size is one of short floats
# (`1.5,` repeated: ~70 ns a byte); measured in CPU time on this 2-core box: 32 KiB 1.9 ms (2.4
# median), 64 KiB 4.3 ms (4.9); a 32 KiB chat body of text ~0.1 ms. 32 KiB keeps the worst inline
# parse under a small request's own unloaded latency (~2 ms), so a flood of them does not double
# another client's; a larger body pays a worker round trip (~0.4 ms idle, 40 KiB).
INLINE_BYTES = 32 * 1024
PREFIX_LIMIT = 64 * 1024  # characters of prompt text kept in a large body's view
TIMEOUT = 30.0  # s, one worker round trip; an 8 MiB pathological body parses in ~2 s here
_CHUNK = 1024 * 1024  # the body goes down the pipe in pieces of this (a copy of one at a time)
_WORKER = os.path.abspath(worker_protocol.__file__)

_NON_BLANK = re.compile(rb"[^ \t\n\r]")
# What a JSON text that starts with each character is (json.loads's type name), for NotAnObject.
_STARTS = {"[": "list", '"': "str", "t": "bool", "f": "bool", "n": "NoneType", "N": "float", "I": "float", "-": "number"}
_STARTS.update(dict.fromkeys("0123456789", "number"))


class NotAnObject(ValueError):
    """A body that is not a JSON object: `kind` is its type as json.loads would make it (list, str,
    number, ...; "" when it is not JSON at all), `start` its first characters."""

    def __init__(self, kind: str, start: str) -> None:
        self.kind, self.start = kind, start
        got = f"got {kind}" if kind else f"it starts with {start!r}"
        super().__init__(f"the request body must be a JSON object, {got}")


class ParserUnavailable(Exception):
    """The worker could not parse the body (it died, timed out or could not start, or the parser
    is closed): nothing is known about the body; answer 503."""


class RoutingView(dict):
    """A large body's routing view (bodyparse_worker.routing_view): the body's top-level object
    with its large values cut short (`trimmed`: their keys) and, past the view's budget, keys
    left out (`dropped`: how many)."""

    __slots__ = ("trimmed", "dropped")

    def __init__(self, view: dict, trimmed: frozenset[str], dropped: int) -> None:
        super().__init__(view)
        self.trimmed = trimmed
        self.dropped = dropped


class _Plain(pickle.Unpickler):
    # The worker sends plain data only: no class may be named (nothing to import, nothing to run).
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the parse worker sent {module}.{name}")


def _load(payload: bytes) -> Any:
    return _Plain(io.BytesIO(payload)).load()


def refuse_non_object(body: bytes) -> None:
    """NotAnObject unless the body may be a JSON object: its first non-blank character is `{`, or
    cannot be told without decoding (UTF-16/32, only blanks): the worker decides those."""
    if body[:1] == b"{":
        return
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        return
    start = 3 if encoding == "utf-8-sig" else 0
    found = _NON_BLANK.search(body, start)
    if found is None or body[found.start()] == 0x7B:  # "{"
        return
    head = body[found.start():found.start() + 16].decode("utf-8", "replace")
    if head[0] == "[" and _nesting_at(body, found.start()) > _DEEPEST:
        # what json.loads would end with (and the proxy says so): no worker for it either
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
    raise NotAnObject(_STARTS.get(head[0], ""), head)


# json.loads gives up (RecursionError) near the interpreter's recursion limit; a body that opens
# more arrays than this before anything else is refused the same way, without parsing it.
_DEEPEST = sys.getrecursionlimit()


def _nesting_at(body: bytes, start: int) -> int:
    """How many `[` open in a row from `start` (blanks between them allowed), counted up to _DEEPEST + 1."""
    depth, at, end = 0, start, min(len(body), start + 4 * (_DEEPEST + 1))
    while at < end and depth <= _DEEPEST:
        byte = body[at]
        if byte == 0x5B:  # [
            depth += 1
        elif byte not in b" \t\r\n":
            break
        at += 1
    return depth


def _json_error(msg: str, pos: int, lineno: int, colno: int) -> json.JSONDecodeError:
    # json.JSONDecodeError(msg, doc, pos) computes the line and column from the document, which
    # stayed in the worker: the same exception, its fields set from the worker's.
    error = json.JSONDecodeError.__new__(json.JSONDecodeError)
    ValueError.__init__(error, f"{msg}: line {lineno} column {colno} (char {pos})")
    error.msg, error.doc, error.pos, error.lineno, error.colno = msg, "", pos, lineno, colno
    return error


_NOBODY = object()  # no client's parse ended: a slot handed back unused


class _DiedIdle(Exception):
    """A reused worker died before it had all of the body: not the body's doing (it had died
    while idle, or as it read), so the body goes to a new one."""


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.asked = 0  # bodies sent to it, this one included
        self.received = False  # it said it has all of the current body
        assert process.stdin is not None and process.stdout is not None
        self.stdin, self.stdout = process.stdin, process.stdout

    async def ask(self, body: bytes, limit: int) -> tuple[int, bytes]:
        self.asked += 1
        self.received = False
        self.stdin.write(worker_protocol.REQUEST.pack(len(body), limit))
        view = memoryview(body)
        for at in range(0, len(body), _CHUNK):
            self.stdin.write(view[at:at + _CHUNK])
            await self.stdin.drain()
        if await self.stdout.readexactly(len(worker_protocol.RECEIVED)) != worker_protocol.RECEIVED:
            raise EOFError("the body parse worker answered out of turn")
        self.received = True
        kind, size = worker_protocol.REPLY.unpack(await self.stdout.readexactly(worker_protocol.REPLY.size))
        return kind, await self.stdout.readexactly(size)

    def exited(self) -> str:
        code = self.process.returncode
        if code is None:
            return "it stopped answering"
        return f"it was killed by signal {-code}" if code < 0 else f"it exited with code {code}"

    async def kill(self) -> None:
        try:
            self.process.kill()
        except ProcessLookupError:
            pass
        await self.process.wait()

    async def close(self, grace: float = 2.0) -> None:
        """Its stdin closed, it exits by itself; killed if it has not within `grace`."""
        self.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), grace)
        except asyncio.TimeoutError:
            await self.kill()


class BodyParser:
    """Parses request bodies: small ones on the loop, large ones in worker processes (at most
    `concurrency` at once), each round trip bounded by `timeout` seconds. Waiters take turns by
    client (`parse(body, client=...)`: round robin between clients, in order within one), so a
    client with many large bodies in flight delays another's by one parse, not by its queue.
    `prefix_limit` (characters) may be changed at any time: it applies from the next parse."""

    def __init__(self, *, inline_bytes: int = INLINE_BYTES, prefix_limit: int = PREFIX_LIMIT,
                 concurrency: int = 1, timeout: float = TIMEOUT) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be 1 or more")
        self.inline_bytes = inline_bytes
        self.prefix_limit = prefix_limit
        self.timeout = timeout
        self.concurrency = concurrency
        self._running = 0  # parses holding a slot
        self._waiting: OrderedDict[object, deque[asyncio.Future[None]]] = OrderedDict()  # client -> its waiters
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        # counts for /metrics: bodies parsed on the loop, by a worker, refused as not objects;
        # workers started; round trips that failed (death, timeout)
        self.inline = self.offloaded = self.refused = self.started = self.failed = 0

    @property
    def workers(self) -> int:
        """Worker processes alive now."""
        return len(self._idle) + len(self._busy)

    @property
    def waiting(self) -> int:
        """Large bodies waiting for a worker."""
        return sum(1 for queue in self._waiting.values() for future in queue if not future.done())

    async def parse(self, body: bytes, client: object = None) -> Any:
        """The body's JSON (a large one: its RoutingView); `client` (any hashable, e.g. the
        client's address) takes turns with the others for a worker. See the module's docstring
        for what it raises."""
        if len(body) <= self.inline_bytes:
            self.inline += 1
            return parse_json(body)
        try:
            refuse_non_object(body)
        except NotAnObject:
            self.refused += 1
            raise
        await self._acquire(client)
        if self._closed:
            self._release()
            raise ParserUnavailable("the body parser is closed")
        # A task of its own, so that a caller who goes away (a client that disconnected) does not
        # cut the exchange short: the worker finishes this body and stays usable, and the slot is
        # taken until it has, so `concurrency` bounds the parses really running.
        task = asyncio.ensure_future(self._exchange(body, self.prefix_limit))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._reap(done, client))
        kind, payload = await asyncio.shield(task)
        return self._answer(kind, payload, body)

    async def _acquire(self, client: object) -> None:
        if self._closed:
            raise ParserUnavailable("the body parser is closed")
        if self._running < self.concurrency and not self._waiting:
            self._running += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.get(client)
        if queue is None:
            queue = self._waiting[client] = deque()
        queue.append(future)
        try:
            await future  # _release hands its slot over: _running stays as it is
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # handed a slot as it was cancelled: the next waiter's
            raise

    def _release(self, served: object = _NOBODY) -> None:
        """The slot to the next client's first waiter, `served` (the client whose parse ended)
        after the others: round robin; else free."""
        waiting = self._waiting
        if served in waiting:
            waiting.move_to_end(served)
        while waiting:
            client, queue = waiting.popitem(last=False)
            while queue:
                future = queue.popleft()
                if not future.done():  # cancelled ones are left here, skipped
                    if queue:
                        waiting[client] = queue  # its turn again after the others'
                    future.set_result(None)
                    return
        self._running -= 1

    def _reap(self, task: asyncio.Task, client: object) -> None:
        self._tasks.discard(task)
        self._release(client)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that went away leaves no "never retrieved" log

    async def _exchange(self, body: bytes, limit: int) -> tuple[int, bytes]:
        worker: _Worker | None = None
        while self._idle and worker is None:
            worker = self._idle.pop()
            if worker.process.returncode is not None:  # died while idle (the OOM killer, a kill)
                await worker.kill()
                logger.warning("the body parse worker had died (%s); another starts", worker.exited())
                worker = None
        try:
            return await self._ask(worker or await self._start(), body, limit)
        except _DiedIdle as died:
            # It died before this body reached it: nothing to do with the body, one more try.
            logger.warning("the body parse worker had died (%s); another starts", died)
            return await self._ask(await self._start(), body, limit)

    async def _ask(self, worker: _Worker, body: bytes, limit: int) -> tuple[int, bytes]:
        self._busy.add(worker)
        try:
            if self._closed:  # aclose() came while it started
                raise EOFError
            self.offloaded += 1
            reply = await asyncio.wait_for(worker.ask(body, limit), self.timeout)
        except BaseException as exc:
            # Whatever happened, its pipe may be mid-message: this worker is done.
            self._busy.discard(worker)
            await worker.kill()
            if isinstance(exc, asyncio.TimeoutError):
                why = f"it took more than {self.timeout:g} s"
            elif isinstance(exc, (OSError, EOFError)):  # asyncio.IncompleteReadError is an EOFError
                if worker.asked > 1 and not worker.received and not self._closed:
                    self.offloaded -= 1
                    raise _DiedIdle(worker.exited()) from None
                why = "the body parser closed" if self._closed else worker.exited()
            else:  # cancelled: the loop is shutting down
                raise
            self.failed += 1
            if not self._closed:
                logger.warning("the body parse worker failed (%s); the next large body starts another", why)
            raise ParserUnavailable(f"the body parse worker failed: {why}") from None
        self._busy.discard(worker)
        self._idle.append(worker)
        return reply

    async def _start(self) -> _Worker:
        try:
            return await self._spawn()
        except OSError as exc:
            self.failed += 1
            logger.warning("could not start the body parse worker: %s", exc)
            raise ParserUnavailable(f"could not start the body parse worker: {exc}") from None

    async def _spawn(self) -> _Worker:
        # -I -S: no site-packages (a vLLM venv's .pth files), nothing of the script's directory on
        # the path; json.loads refuses the same long integers and nests as deep as here
        command = [sys.executable, "-I", "-S", "-X", f"int_max_str_digits={sys.get_int_max_str_digits()}",
                   _WORKER, str(sys.getrecursionlimit())]
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        self.started += 1
        return _Worker(process)

    def _answer(self, kind: int, payload: bytes, body: bytes) -> Any:
        try:
            answer = _load(payload)
        except Exception as exc:
            raise ParserUnavailable(f"the body parse worker sent an unreadable answer: {exc}") from None
        if kind == worker_protocol.OK:
            view, trimmed, dropped = answer
            return RoutingView(view, frozenset(trimmed), dropped)
        if kind == worker_protocol.JSON_ERROR:
            raise _json_error(*answer)
        if kind == worker_protocol.UNICODE_ERROR:
            encoding, start, end, reason = answer
            raise UnicodeDecodeError(encoding, body, start, end, reason)
        if kind == worker_protocol.RECURSION_ERROR:
            raise RecursionError(answer)
        if kind == worker_protocol.VALUE_ERROR:
            raise ValueError(answer)
        if kind == worker_protocol.NOT_AN_OBJECT:
            self.refused += 1
            raise NotAnObject(answer, "")
        logger.warning("the body parse worker could not parse a body: %s", answer)
        raise ParserUnavailable(f"the body parse worker failed: {answer}")

    async def aclose(self) -> None:
        """Parses in progress end with ParserUnavailable, waiters too; the workers exit."""
        self._closed = True
        for worker in list(self._busy):
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()  # its exchange sees the pipe close and answers ParserUnavailable
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        idle, self._idle = self._idle, []
        await asyncio.gather(*(worker.close() for worker in idle))
