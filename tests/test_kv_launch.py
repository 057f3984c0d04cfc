"""kv_aware in the supervisor: each instance of a kv_aware model publishes its KV-cache events on a
private ipc socket of its own (in the 0700 instances' folder), and its backend says where."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.test_launch import config, instance
from vsup.config.schema import parse_config
from vsup.errors import ConfigError
from vsup.supervisor.launch import build_command, kv_events_endpoint, wants_kv_events

ENV = {"RUNTIME_DIRECTORY": "/run/vsup"}


def test_kv_aware_gives_each_instance_its_private_events_socket():
    cfg = config("proxy:\n  policy: kv_aware\n")
    argv, _ = build_command(instance(), cfg, ENV)
    given = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert given == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/vsup/instances-8000/1.kv",
                     "replay_endpoint": "ipc:///run/vsup/instances-8000/1.kvr", "topic": "kv"}
    beside = dataclasses.replace(instance(), port=8201)  # a replacement started beside it: its own socket
    assert kv_events_endpoint(beside, cfg, ENV) == "ipc:///run/vsup/instances-8000/1b.kv"
    assert wants_kv_events(cfg)


def test_other_policies_publish_nothing():
    cfg = config("proxy:\n  policy: prefix_affinity\n")
    argv, _ = build_command(instance(), cfg, ENV)
    assert "--kv-events-config" not in argv and kv_events_endpoint(instance(), cfg, ENV) == ""
    assert not wants_kv_events(cfg)


def test_a_fleet_turns_events_on_for_its_kv_aware_model_only():
    cfg = parse_config("models:\n  - model: /m/a\n    proxy: {policy: kv_aware}\n  - model: /m/b\n")
    assert wants_kv_events(cfg)


def test_own_kv_events_config_is_refused_under_kv_aware():
    cfg = config('  args: [--kv-events-config, "{}"]\nproxy:\n  policy: kv_aware\n')
    with pytest.raises(ConfigError, match=r"vllm.args\[0\].*not allowed with proxy.policy: kv_aware"):
        build_command(instance(), cfg, ENV)
    mine = config('  args: [--kv-events-config, "{}"]\n')  # another policy: the user's own publisher stays theirs
    assert "--kv-events-config" in build_command(instance(), mine, ENV)[0]


def test_a_socket_path_too_long_names_tmpdir():
    with pytest.raises(ConfigError, match=r"proxy.policy: kv_aware: the KV-events socket .* point TMPDIR"):
        kv_events_endpoint(instance(), config("proxy:\n  policy: kv_aware\n"), {"TMPDIR": "/" + "d" * 84})
