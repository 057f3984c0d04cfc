"""The subscriber to every instance's KV-cache events (vLLM's `--kv-events-config`, a ZMQ PUB
socket and a ROUTER socket for replay; docs/kv-events.md), feeding one `InstanceIndex` each.

One thread polls every SUB socket, so decoding never runs on the proxy's event loop; requests
read the indexes under a lock. Each message is (topic, 8-byte big-endian sequence number,
msgpack EventBatch [ts, events, dp_rank]). A sequence that does not follow on (a gap, a first
message after ours was lost, a publisher that started again) is first filled from the replay
socket (`<endpoint>r`: the last `buffer_steps` batches); what replay cannot fill clears the
instance's entries (kv_index.py). `reset(name)` (the instance left the rotation: it may be
restarting) clears them and reopens its socket, so nothing queued from the old process is
applied afterwards; so does a dropped connection to the publisher (a ZMQ socket monitor): the
process behind it died or restarted, and a successor's sequence may happen to continue ours.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from vsup.proxy.kv_index import DEFAULT_CAPACITY, OK, InstanceIndex

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the thread looks for instances added, reset or removed
REPLAY_WAIT_MS = 1000  # the longest wait for one replayed batch before giving up on a replay
DRAIN = 256  # messages taken from one socket before the others get a turn
END_SEQ = -1  # vLLM's end-of-replay marker


def replay_endpoint(endpoint: str) -> str:
    """Where an instance's replay socket is, by vsup's naming (launch.py): the endpoint + 'r'."""
    return endpoint + "r"


def decode(payload: bytes) -> list[Any]:
    """An EventBatch's events as plain values; ValueError when it is not one."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not an EventBatch [ts, events, ...]")
    return [event for event in batch[1] if isinstance(event, dict)]


class KvEvents:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, replay: bool = True) -> None:
        self.capacity = capacity
        self.replay = replay
        self.lock = threading.Lock()
        self.indexes: dict[str, InstanceIndex] = {}  # backend name -> its blocks
        self.endpoints: dict[str, str] = {}
        self.received = 0  # batches (metrics, tests)
        self.replayed = 0
        self.disconnects = 0  # publishers lost (each clears its instance)
        self._reopen: set[str] = set()
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the event loop's side
    def watch(self, name: str, endpoint: str) -> None:
        """Subscribe to `name`'s events at `endpoint` (once; a new endpoint starts afresh)."""
        if self._stop.is_set():
            return  # closed (its balancer was replaced): the pool still calls its listener
        with self.lock:
            if self.endpoints.get(name) == endpoint:
                return
            self.endpoints[name] = endpoint
            self.indexes[name] = InstanceIndex(self.capacity)
            self._reopen.add(name)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vsup-kv-events", daemon=True)
            self._thread.start()

    def reset(self, name: str) -> None:
        with self.lock:
            index = self.indexes.get(name)
            if index is not None:
                index.reset()
                self._reopen.add(name)

    def forget(self, name: str) -> None:
        with self.lock:
            self.endpoints.pop(name, None)
            self.indexes.pop(name, None)
            self._reopen.add(name)

    def matched(self, name: str, keys: Sequence[int]) -> int:
        with self.lock:
            index = self.indexes.get(name)
            return index.matched(keys) if index is not None else 0

    def block_size(self, name: str) -> int:
        index = self.indexes.get(name)
        return index.block_size if index is not None else 0

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)

    # -- the thread
    def _run(self) -> None:
        sockets: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}  # name -> (SUB, its monitor)
        names: dict[zmq.Socket, str] = {}
        monitors: dict[zmq.Socket, str] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                with self.lock:
                    reopen, self._reopen = self._reopen, set()
                    endpoints = dict(self.endpoints)
                for name in reopen:
                    old = sockets.pop(name, None)
                    if old is not None:
                        for sock in old:
                            poller.unregister(sock)
                            names.pop(sock, None)
                            monitors.pop(sock, None)
                        old[0].disable_monitor()
                        old[1].close(linger=0)
                        old[0].close(linger=0)
                    if name in endpoints:
                        sub = self._ctx.socket(zmq.SUB)
                        sub.setsockopt(zmq.SUBSCRIBE, b"")
                        # a dropped connection is a publisher gone (the instance died or restarted):
                        # what it said it held is forgotten before anything of its successor arrives
                        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                        sub.connect(endpoints[name])
                        sockets[name], names[sub], monitors[monitor] = (sub, monitor), name, name
                        poller.register(sub, zmq.POLLIN)
                        poller.register(monitor, zmq.POLLIN)
                for sock, _ in poller.poll(POLL_MS):
                    if sock in monitors:
                        self._disconnected(monitors[sock], sock)
                        continue
                    name = names[sock]
                    for _ in range(DRAIN):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._message(name, endpoints[name], frames)
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                logger.warning("KV events: the subscriber stopped: %s; kv_aware routes by load alone from now on", exc)
        finally:
            for pair in sockets.values():
                for sock in reversed(pair):
                    sock.close(linger=0)
            with self.lock:
                for index in self.indexes.values():
                    index.reset()  # nothing follows the instances any more: claim nothing

    def _disconnected(self, name: str, monitor: zmq.Socket) -> None:
        try:
            while True:
                monitor.recv_multipart(zmq.NOBLOCK)  # (event, value) and the endpoint: only disconnects are asked for
                with self.lock:
                    index = self.indexes.get(name)
                    if index is not None:
                        index.reset()
                        self._reopen.add(name)  # what the old connection still has queued is dropped
                        self.disconnects += 1
        except zmq.Again:
            pass

    def _message(self, name: str, endpoint: str, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            events: Any = decode(frames[2])
        except ValueError:
            events = None  # unreadable: apply() clears
        with self.lock:
            index = self.indexes.get(name)
            if index is None or name in self._reopen:
                return  # reset or forgotten since: from a process that may be gone
            start = None
            if index.check(seq) != OK or (index.last_seq is None and seq > 0):
                start = index.last_seq + 1 if index.last_seq is not None and seq > index.last_seq else 0
        if start is not None and self.replay:
            self._replay(name, endpoint, start, seq)
        with self.lock:
            index = self.indexes.get(name)
            if index is None or name in self._reopen:
                return
            self.received += 1
            if index.apply(seq, events if events is not None else [None]) != OK:
                logger.info("KV events of %s: batch %d does not follow %s; its entries cleared", name, seq, index.last_seq)

    def _replay(self, name: str, endpoint: str, start: int, until: int) -> None:
        """Batches start..until-1 from the instance's replay socket, applied in order."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(replay_endpoint(endpoint))
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_WAIT_MS):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ or seq >= until:
                    return
                try:
                    events: Any = decode(frames[3])
                except ValueError:
                    events = [None]
                with self.lock:
                    index = self.indexes.get(name)
                    if index is None or name in self._reopen:
                        return
                    index.apply(seq, events)
                    self.replayed += 1
        finally:
            dealer.close(linger=0)
