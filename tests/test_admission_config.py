"""The admission keys: one-line errors naming the key, max_num_seqs read from vllm.args, per-model
values in a fleet, the gate's priority rules (a client never picks a priority above its key's)."""

from __future__ import annotations

import pytest

from vsup.config.admission import instance_limit, resolved
from vsup.config.fleet import models_of
from vsup.config.schema import ApiKeyConfig, ProxyConfig, parse_config
from vsup.errors import ConfigError, VsupError
from vsup.proxy.auth import named_keys
from vsup.proxy.gate import Gate, needed

FLEET = """\
proxy: {max_in_flight_per_instance: 4, api_keys: [{name: web, key: k1, priority: 10}]}
models:
  - model: /srv/chat
    served_model_name: chat
    vllm: {args: [--max-num-seqs, "6"]}
    proxy: {max_in_flight_per_instance: max_num_seqs, reserved_slots: 1, queue_timeout: 5}
  - model: /srv/embed
    served_model_name: embed
"""


def test_fleet_limits_per_model_and_max_num_seqs_from_args():
    chat, embed = models_of(parse_config(FLEET, "f.yaml"))
    assert instance_limit(chat.config) == 6 and resolved(chat.config).max_in_flight_per_instance == 6
    assert resolved(chat.config).queue_timeout == 5 and resolved(chat.config).reserved_slots == 1
    assert instance_limit(embed.config) == 4  # the top level's
    assert instance_limit(parse_config("model: /srv/m\n", "f.yaml")) is None  # default: no admission queue
    assert instance_limit(parse_config("model: /srv/m\nproxy: {max_in_flight_per_instance: 0}\n", "f.yaml")) is None


@pytest.mark.parametrize("text, message", [
    ("model: /srv/m\nproxy: {max_in_flight_per_instance: max_num_seqs}\n",
     "f.yaml:2: proxy.max_in_flight_per_instance: max_num_seqs reads --max-num-seqs N from vllm.args, which sets none"),
    ("model: /srv/m\nproxy: {max_in_flight_per_instance: 2, reserved_slots: 2}\n",
     "reserved_slots (2) must be less than max_in_flight_per_instance (2)"),
    ("model: /srv/m\nvllm: {args: [--max-num-seqs=2]}\nproxy: {max_in_flight_per_instance: max_num_seqs, reserved_slots: 2}\n",
     "proxy.reserved_slots: 2 must be less than the 2 requests per instance"),
    ("model: /srv/m\nproxy: {max_in_flight_per_instance: -1}\n", "must be 0 or more"),
    ("model: /srv/m\nproxy: {api_keys: [{name: a, key: x, key_env: Y}]}\n", "proxy.api_keys[0]"),
    ("model: /srv/m\nproxy: {api_keys: [{name: a, key: x}, {name: a, key: y}]}\n", "the name 'a' is used twice"),
    ("model: /srv/m\nproxy: {api_keys: [{name: a, key: x, requests_per_minute: 0}]}\n", "proxy.api_keys[0].requests_per_minute"),
    ("model: /srv/m\nproxy: {priority_header: X-Priority}\n", "priority_header_values is empty"),
    ("model: /srv/m\nproxy: {priority_header: 'bad header', priority_header_values: {a: 1}}\n", "is not an HTTP header name"),
    ("models:\n  - {model: /srv/a, proxy: {api_keys: []}}\n", "models[0].proxy.api_keys: is machine-wide"),
])
def test_errors_name_the_key(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "f.yaml")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_key_env_read_and_named_when_unset():
    config = ProxyConfig(api_keys=[ApiKeyConfig(name="web", key_env="WEB_KEY")])
    assert named_keys(config, {"WEB_KEY": "secret"}) == [("web", "secret")]
    with pytest.raises(VsupError, match=r"proxy.api_keys\[0\].key_env: the environment variable WEB_KEY"):
        named_keys(config, {})


def test_priority_from_the_key_and_the_allowed_header_never_above_the_key():
    config = ProxyConfig(api_keys=[ApiKeyConfig(name="web", key="a", priority=5), ApiKeyConfig(name="bulk", key="b", priority=-5)],
                         priority_header="X-Priority", priority_header_values={"interactive": 10, "batch": -10})
    gate = Gate({}, lambda: 0.0)
    gate.configure(config, {})
    assert gate.admission.top == 10
    assert gate.priority("web", {}) == 5
    assert gate.priority("web", {"x-priority": "batch"}) == -10
    assert gate.priority("web", {"x-priority": "interactive"}) == 5  # lowered to its key's
    assert gate.priority("bulk", {"x-priority": "interactive"}) == -5
    assert gate.priority("", {"x-priority": "interactive"}) == 10  # proxy.api_key / no auth: the header's value
    assert gate.priority("web", {"x-priority": "urgent"}).status == 400
    assert not needed(ProxyConfig(), {"chat": ProxyConfig()})
    assert needed(ProxyConfig(), {"chat": ProxyConfig(max_in_flight_per_instance=2)})
