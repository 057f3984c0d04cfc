"""Record what a vLLM instance publishes on its KV-events socket (docs/kv-events.md's evidence).

    python scripts/kv_events_probe.py ipc:///path/kv.pub [--replay ipc:///path/kv.replay] [--seconds 30] [--topic T]

Subscribes (pyzmq SUB) to every topic, prints one JSON line per message: the topic, the sequence
number (8-byte big-endian frame), and the msgpack payload decoded to plain values (bytes as hex).
With --replay, after the live window it asks the replay (ROUTER) socket for everything from seq 0
and prints what comes back, up to the end marker (seq -1). Needs pyzmq and msgspec (vLLM's venv
has both).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import zmq


def plain(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def show(kind: str, frames: list[bytes]) -> None:
    topic, seq, payload = frames[-3:]
    seq_n = int.from_bytes(seq, "big", signed=True)
    decoded = plain(msgspec.msgpack.decode(payload)) if payload else None
    print(json.dumps({"via": kind, "topic": topic.decode(), "seq": seq_n, "bytes": len(payload), "batch": decoded}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--replay")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--topic", default="")
    args = parser.parse_args()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(args.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    deadline = time.monotonic() + args.seconds
    print(json.dumps({"subscribed": args.endpoint}), flush=True)
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000)):
            show("pub", sub.recv_multipart())
    if args.replay:
        req = ctx.socket(zmq.DEALER)
        req.connect(args.replay)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        while req.poll(5000):
            frames = req.recv_multipart()
            if int.from_bytes(frames[-2], "big", signed=True) == -1:
                print(json.dumps({"via": "replay", "end": True}), flush=True)
                break
            show("replay", frames)
    sys.exit(0)


if __name__ == "__main__":
    main()
