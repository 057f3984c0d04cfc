"""The batch runner: one asyncio task that turns the store's pending lines into requests.

Each round (`step`, on `wake()` or every `poll` seconds):
  validate   the batches still `validating` (the store parses their input; models() says which
             model names are served)
  cancel     a `cancelling` batch's pending lines fail (batch_cancelled)
  feed       for each model with pending lines: `room(model)` more lines, the held ones first
             (below), then the oldest batches' pending lines, each sent by `send` in a task of
             its own; a model no longer served (a reload removed it) fails its lines
  record     an answer is the line's one result; 429/502/503/504 and a transport failure are
             requeued (the store fails the line at batch.max_attempts); `Busy` (the proxy had no
             slot for it after all: interactive traffic took it between room() and send) is no
             attempt: the line is held here and sent again first when room comes
  finish     every batch whose lines are all done is finalized (output and error files)
  expire     every EXPIRE_EVERY s the batches past their 24 h window; every PURGE_EVERY s what
             is past batch.retention

The store is durable, the runner holds nothing the store does not: a line claimed (sent, or
held) is `running` there, so a stop or a kill -9 leaves it `running` and the next start's
recover() puts it back to pending with its attempt counted (a result of the forgotten attempt is
refused by record()). I/O is behind seams: `send`, `room`, `models` and the clock, so the tests
drive it over a real Store with a fake sender.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vsup.batch.store import Claimed, Store

log = logging.getLogger("vsup.batch")

# Answers that say "not now" or "broken off": the line is tried again (up to batch.max_attempts).
RETRIED = frozenset({429, 502, 503, 504})
# Seconds between two looks for batches past their completion window, and two purges.
EXPIRE_EVERY = 10.0
PURGE_EVERY = 600.0
# The shortest time between two rounds: every request's end wakes the runner (a slot freed), and a
# round reads the store; under heavy interactive traffic rounds stay this far apart.
MIN_ROUND = 0.02
# Lines claimed ahead per model beyond the room (held in memory, `running` in the store, so the
# views count them running): a freed slot takes the next one at once instead of at the next round,
# so the engine's slot does not idle for a round and a read of the store (the client loop's
# advantage on short lines). A wave of slots' worth, not a few: each claim is a transaction on the
# event loop, which waits for the writer thread's while that one commits (py-spy, a fake engine
# answering at once: at 8, 15 % of the loop's time went to that wait and batches ran ~4,100
# lines/s; at 64, ~4,900, where a client loop runs ~6,000).
# A kill -9 counts an attempt against the held lines too (recover() cannot tell them from sent ones).
PREFETCH = 64
# The most of a refusal's message a requeue keeps (the error file shows it when attempts run out).
WHY_CHARS = 300


class Busy(Exception):
    """Raised by a Sender when nothing could take the line now (the proxy's own 503 `x-vsup-batch:
    busy`): the line was not tried, and is sent again when room comes."""


class Sender(Protocol):
    async def __call__(self, endpoint: str, body: bytes, owner: str) -> tuple[int, bytes, str]:
        """(status, body, request id) of the answer; raises Busy, or any other exception for a
        transport failure."""
        ...


class Room(Protocol):
    def __call__(self, model: str) -> int:
        """How many more batch lines the instances of `model` take now."""
        ...


def refusal(status: int, body: bytes) -> str:
    """Why an answer is retried, for the error file when the attempts run out."""
    message = ""
    try:
        document = json.loads(body)
        error = document.get("error") if isinstance(document, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(document, dict) and isinstance(document.get("message"), str):
            message = document["message"]
    except (ValueError, UnicodeDecodeError):
        message = body[:WHY_CHARS].decode("utf-8", "replace")
    message = message[:WHY_CHARS]
    return f"answered {status}" + (f": {message}" if message else "")


class Runner:
    def __init__(self, store: Store, send: Sender, room: Room, models: Callable[[str], bool], *,
                 poll: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.send = send
        self.room = room
        self.models = models
        self.poll = poll
        self.clock = clock
        self._wake = asyncio.Event()
        self._lines: dict[asyncio.Task[None], Claimed] = {}
        # model -> lines answered Busy: (claimed, endpoint, owner), sent again before any other
        self._held: dict[str, deque[tuple[Claimed, str, str]]] = {}
        # model -> the in-progress batches the last round found lines pending in for it, until a claim
        # finds none left (slot_freed claims from them between rounds)
        self._feeding: dict[str, list[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._expire_at = 0.0
        self._purge_at = 0.0
        # the lines' results are written by one thread, in order: the event loop, which also serves
        # the interactive requests, does not wait for the disk; what arrives while it writes goes in
        # its next transaction together (Store.together: one fsync for many lines, not one each)
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._writes_lock = threading.Lock()
        self._flushing = False
        self._starved = False  # the last round left lines waiting for room: a freed slot is worth a round

    # -- the contract
    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="batch runner")
        return self._task

    async def run(self) -> None:
        """Rounds until cancelled."""
        while True:
            self._wake.clear()
            try:
                self.step()
            except Exception as exc:  # a full disk, a bug: logged, and the next round tries again
                log.error("batch runner: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(min(MIN_ROUND, self.poll))
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll)
            except TimeoutError:
                pass

    def wake(self) -> None:
        """A new batch, a cancel, a reload: a round now, not at the next poll."""
        self._wake.set()

    def slot_freed(self) -> None:
        """A request ended somewhere (the forwarder calls it for every one): where there is room, a
        held line goes out now, and when none is held more are claimed now from the batches the
        last round fed that model (`_feeding`) rather than at the next round: rounds are at least
        MIN_ROUND apart, and an engine that answers a step's lines together (embeddings) idled
        until then (a fake engine that answers at once: ~1,000 lines/s through a batch against
        ~5,500 through a client loop). A round follows only when lines wait for room, so
        interactive traffic alone costs the store nothing."""
        for model in list(self._held.keys() | self._feeding.keys()):
            # a line at most per model: one slot freed (the room counts a line once its request
            # starts, so the lines launched by an earlier call in the same tick are not in it yet)
            if not self.models(model) or self.room(model) <= 0:
                continue
            if not self._send_held(model, 1) and model in self._feeding:
                self._feed(model, self._feeding[model], most=1)
        if self._starved:
            self._wake.set()

    async def stop(self) -> None:
        """The loop and the lines in flight end; those lines stay `running` in the store (the next
        start's recover() requeues them); the held ones, never sent, are pending again at once."""
        tasks = [t for t in (self._task, *self._lines) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._lines.clear()
        held = [claimed for lines in self._held.values() for claimed, _endpoint, _owner in lines]
        self._held.clear()
        if held:  # never sent: pending again, no attempt spent
            await self._write(self.store.unclaim, held)
        writer, self._writer = self._writer, None
        if writer is not None:  # every result handed to it is in the store before the store closes
            await asyncio.to_thread(writer.shutdown, True)

    @property
    def in_flight(self) -> int:
        return len(self._lines)

    # -- one round
    def step(self) -> None:
        store = self.store
        self._starved = False
        for batch_id in store.validating():
            try:
                if store.validate(batch_id, self.models)["status"] == "validating":
                    self._wake.set()  # read in steps (the loop goes on serving between them): the next at once
            except Exception as exc:  # that batch's trouble is not the others'
                log.error("batch %s: validation failed: %s: %s", batch_id, type(exc).__name__, exc)
        batches = {b["id"]: b for b in store.feedable()}  # (counts nothing: a round costs the same at any size)
        wanted: dict[str, list[dict[str, Any]]] = {}  # model -> the in-progress batches with lines pending for it
        for batch in batches.values():
            if batch["status"] == "cancelling" and batch["pending"]:
                store.fail_pending(batch["id"], None, "batch_cancelled", "the batch was cancelled before this line ran")
            elif batch["status"] == "in_progress":
                for model in batch["models"]:
                    wanted.setdefault(model, []).append(batch)
        self._settle_held(batches)
        self._feeding = wanted
        for model in sorted(wanted.keys() | self._held.keys()):
            if not self.models(model):
                self._removed(model)
                continue
            self._feed(model, wanted.get(model, []))
        for batch_id in store.finish_ready():
            if store.finalize(batch_id)["status"] == "finalizing":
                self._wake.set()  # written in steps too
        now = self.clock()
        if now >= self._expire_at:
            self._expire_at = now + EXPIRE_EVERY
            for batch_id in store.expire():
                log.info("batch %s expired: its completion window passed", batch_id)
        if now >= self._purge_at:
            self._purge_at = now + PURGE_EVERY
            freed = store.purge()
            if freed:
                log.info("batch store: %d bytes past batch.retention deleted", freed)

    def _feed(self, model: str, batches: list[dict[str, Any]], most: int | None = None) -> None:
        """Lines of `batches` for `model`: as many sent as its room takes (`most` at most), and
        PREFETCH more claimed and held."""
        room = self.room(model) if most is None else min(most, self.room(model))
        if room <= 0:
            self._starved = True
        room -= self._send_held(model, room)
        # what the room takes now, and the held lines topped up to PREFETCH for the slots that free
        # before the next round — once half of them went (a claim for every few lines that ended
        # since the last round was a transaction each round for nothing)
        held = len(self._held.get(model, ()))
        want = room + (PREFETCH - held if held <= PREFETCH // 2 else 0)
        asked = want
        for batch in sorted(batches, key=lambda b: b["created_at"]):
            if want <= 0:
                break
            for claimed in self.store.claim(batch["id"], want, model):
                want -= 1
                if room > 0:
                    self._launch(claimed, batch["endpoint"], batch["owner"])
                    room -= 1
                else:
                    self._held.setdefault(model, deque()).append((claimed, batch["endpoint"], batch["owner"]))
        if asked > 0 and want > 0:  # its batches have no line pending left for it: nothing to claim until a round finds more
            self._feeding.pop(model, None)
        if room <= 0 and (self._held.get(model) or any(b["pending"] for b in batches)):
            self._starved = True

    def _send_held(self, model: str, room: int) -> int:
        """Up to `room` held lines of `model` sent, oldest first; how many."""
        held = self._held.get(model)
        sent = 0
        while sent < room and held:
            claimed, endpoint, owner = held.popleft()
            self._launch(claimed, endpoint, owner)
            sent += 1
        if held is not None and not held:
            del self._held[model]
        return sent

    def _settle_held(self, batches: dict[str, dict[str, Any]]) -> None:
        """Held lines of a batch that stopped running (cancelled, expired) get their result now."""
        for model, held in list(self._held.items()):
            kept: deque[tuple[Claimed, str, str]] = deque()
            for entry in held:
                batch = batches.get(entry[0].batch_id)
                status = batch["status"] if batch is not None else None
                if status == "in_progress":
                    kept.append(entry)
                elif status == "cancelling":
                    self.store.record(entry[0], None, None, "", {"code": "batch_cancelled",
                                                                 "message": "the batch was cancelled before this line ran"})
                else:  # expired or gone
                    self.store.record(entry[0], None, None, "", {"code": "batch_expired",
                                                                 "message": "the batch's completion window passed before this line ran"})
            if kept:
                self._held[model] = kept
            else:
                del self._held[model]

    def _removed(self, model: str) -> None:
        """`model` is served no more (a reload removed it): its lines fail with a clear error."""
        message = f"the model {model!r} is not served here any more (a reload removed it)"
        for claimed, _endpoint, _owner in self._held.pop(model, ()):
            self.store.record(claimed, None, None, "", {"code": "model_not_found", "message": message})
        failed = self.store.fail_pending(None, model, "model_not_found", message)
        if failed:
            log.warning("batch lines of the model %r: %d failed: it is not served any more", model, failed)

    def _launch(self, claimed: Claimed, endpoint: str, owner: str) -> None:
        task = asyncio.get_running_loop().create_task(self._line(claimed, endpoint, owner))
        self._lines[task] = claimed
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._lines.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("batch runner: a line's result could not be stored: %s: %s", type(error).__name__, error)
        self._wake.set()

    async def _line(self, claimed: Claimed, endpoint: str, owner: str) -> None:
        """One line: sent, and its answer recorded (or the line requeued, or held)."""
        try:
            status, body, request_id = await self.send(endpoint, claimed.body, owner)
        except Busy:
            self._held.setdefault(claimed.model, deque()).append((claimed, endpoint, owner))
            return
        except asyncio.CancelledError:
            raise  # stopping: the line stays `running` (recover() at the next start)
        except Exception as exc:  # the proxy could not send it (a transport failure): an attempt
            await self._write(self.store.requeue, claimed, f"not sent: {type(exc).__name__}: {exc}"[:WHY_CHARS])
            return
        if status in RETRIED:
            await self._write(self.store.requeue, claimed, refusal(status, body))
        else:
            await self._write(self.store.record, claimed, status, body, request_id)

    async def _write(self, function: Callable[..., Any], *args: Any) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        with self._writes_lock:
            self._writes.append((function, args, done))
            start, self._flushing = not self._flushing, True
        if start:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="vsup-batch-store")
            self._writer.submit(self._flush, loop)
        # shielded: a stop while it is being written still waits for it (stop() joins the thread)
        await asyncio.shield(done)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """The writer thread: every write queued so far in one transaction, until none is left."""
        while True:
            with self._writes_lock:
                writes, self._writes = self._writes, []
                if not writes:
                    self._flushing = False
                    return
            results: list[tuple[bool, Any]] = []
            try:
                with self.store.together():
                    for function, args, _ in writes:
                        try:
                            results.append((True, function(*args)))
                        except Exception as exc:  # this write alone is undone (its savepoint)
                            results.append((False, exc))
            except Exception as exc:  # the commit failed (a full disk): none of them is stored
                results = [(False, exc)] * len(writes)
            # one wake of the loop for the whole transaction (call_soon_threadsafe writes to its self-pipe)
            loop.call_soon_threadsafe(_settle, [(future, ok, value) for (_, _, future), (ok, value)
                                                in zip(writes, results, strict=True)])


def _settle(settled: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for future, ok, value in settled:
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
            future.exception()  # (retrieved: a line cancelled meanwhile leaves no "never retrieved" warning)
