"""`models:`: several models in one file, each read as a single-model view (vsup/config/fleet.py)."""

from __future__ import annotations

import pytest

from vsup.config.fleet import is_fleet, models_of, view_of
from vsup.config.loader import where
from vsup.config.schema import parse_config
from vsup.errors import ConfigError, VsupError

FLEET = """\
placement:
  memory_reserve_gib: 1
vllm:
  args: [--dtype, float32]
models:
  - model: /srv/chat
    served_model_name: chat
    instances: 2
    proxy: {policy: prefix_affinity}
  - model: /srv/embed
    served_model_name: embed
    share: 0.25
    placement:
      cores_per_instance: 1
    vllm: {args: [--runner, pooling]}
    warmup: {enabled: false}
"""


def test_each_entry_is_the_top_level_with_its_own_keys_over_it():
    cfg = parse_config(FLEET, "f.yaml")
    assert is_fleet(cfg)
    chat, embed = models_of(cfg)
    assert (chat.name, chat.key, embed.name, embed.key, embed.share) == ("chat", "models[0]", "embed", "models[1]", 0.25)
    assert chat.config.model == "/srv/chat" and chat.config.instances == 2 and chat.config.models is None
    assert chat.config.vllm.args == ["--dtype", "float32"]  # inherited
    assert embed.config.vllm.args == ["--runner", "pooling"]  # replaced whole, not appended
    assert chat.config.proxy.policy == "prefix_affinity" and embed.config.proxy.policy == "round_robin"
    assert embed.config.placement.cores_per_instance == 1 and chat.config.placement.cores_per_instance is None
    assert embed.config.placement.memory_reserve_gib == chat.config.placement.memory_reserve_gib == 1
    assert not embed.config.health.warmup.enabled and chat.config.health.warmup.enabled
    assert view_of(cfg, "embed") == embed


def test_a_view_names_its_own_keys_and_the_top_level_ones_it_inherits():
    chat, embed = models_of(parse_config(FLEET, "f.yaml"))
    assert where(embed.config, "placement.cores_per_instance") == "f.yaml:14: models[1].placement.cores_per_instance"
    assert where(embed.config, "vllm.args") == "f.yaml:15: models[1].vllm.args"
    assert where(chat.config, "vllm.args") == "f.yaml:4: vllm.args"  # the value it has came from there
    assert where(chat.config, "placement.nodes") == "f.yaml: models[0].placement.nodes (default)"


def test_a_single_model_file_is_a_fleet_of_one_view_the_file_itself():
    cfg = parse_config("model: /srv/m\nserved_model_name: m\n", "f.yaml")
    (only,) = models_of(cfg)
    assert not is_fleet(cfg) and only.config is cfg and only.name == "m" and only.key == ""
    assert where(cfg, "placement.nodes") == "f.yaml: placement.nodes (default)"


def test_an_unknown_model_names_the_served_ones():
    with pytest.raises(VsupError, match="no model 'rerank' in this configuration; it serves 'chat', 'embed'"):
        view_of(parse_config(FLEET, "f.yaml"), "rerank")


@pytest.mark.parametrize(("text", "message"), [
    ("models:\n  - model: /m\n    placement: {reserve_cores: 1}\n",
     "f.yaml:3: models[0].placement.reserve_cores: is machine-wide: set it in the top-level placement"),
    ("models:\n  - model: /m\n  - model: /n\n    vllm: {listen: tcp}\n",
     "f.yaml:4: models[1].vllm.listen: is machine-wide: set it in the top-level vllm"),
    ("models:\n  - model: /m\n    proxy: {api_key: k}\n",
     "f.yaml:3: models[0].proxy.api_key: is machine-wide: set it in the top-level proxy"),
    ("model: /m\nmodels:\n  - model: /m\n", "f.yaml:1: model: set it in each entry of models"),
    ("instances: 2\nmodels:\n  - model: /m\n", "f.yaml:1: instances: set it in each entry of models"),
    ("models:\n  - model: /m\n  - model: /m\n", "f.yaml:3: models[1].model: '/m' is also the name of models[0]"),
    ("models:\n  - model: /m\n    served_model_name: a\n  - model: /n\n    served_model_name: a\n",
     "f.yaml:5: models[1].served_model_name: 'a' is also the name of models[0]"),
    ("models:\n  - model: /m\n    placement: {nodes: [a]}\n", "f.yaml:3: models[0].placement.nodes[0]: 'a' is not valid"),
    ("models:\n  - model: /m\n    share: 1.5\n", "f.yaml:3: models[0].share: 1.5 is not valid: Input should be less than or equal to 1"),
    ("models:\n  - served_model_name: a\n", "f.yaml:2: models[0].model: required key is missing"),
    ("models: []\n", "f.yaml:1: models: [] is not valid"),
])
def test_fleet_errors_name_the_entry_and_key(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "f.yaml")
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)
