"""vLLM's KV-cache events publisher (`--kv-events-config`), as the fake needs it: a ZMQ PUB socket
sending (topic, 8-byte big-endian sequence number, msgpack [ts, events, dp_rank]) per batch and a
ROUTER socket answering a replay request (the 8-byte start sequence) with every buffered batch
from it on, then the end marker (sequence -1) — the wire format of vLLM 0.32's
ZmqEventPublisher (docs/kv-events.md). One thread owns both sockets, as in vLLM.

Faults: FAKE_VLLM_KV_EVENTS_DROP=N,M: batches N and M are not sent live (still kept for replay,
a subscriber's missed message); FAKE_VLLM_KV_EVENTS_BUFFER=K keeps only K batches for replay (0:
a gap replay cannot fill).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    def __init__(self, config: dict) -> None:
        self.topic = str(config.get("topic", "")).encode()
        self.drop = {int(s) for s in os.environ.get("FAKE_VLLM_KV_EVENTS_DROP", "").split(",") if s.strip()}
        size = int(os.environ.get("FAKE_VLLM_KV_EVENTS_BUFFER", config.get("buffer_steps", 10000)))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=size)
        self._queue: queue.Queue[list | None] = queue.Queue()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(config.get("endpoint", "tcp://*:5557"))
        self._replay = None
        if config.get("replay_endpoint"):
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config["replay_endpoint"])
        self.seq = 0  # the next batch's
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-kv-events")
        self._thread.start()

    def publish(self, events: list[dict]) -> None:
        if events:
            self._queue.put(events)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                client, _, start = self._replay.recv_multipart()
                first = int.from_bytes(start, "big")
                for seq, payload in self._buffer:
                    if seq >= first:
                        self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                break
            seq, self.seq = self.seq, self.seq + 1
            payload = encoder.encode([time.time(), events, 0])
            if seq not in self.drop:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
