"""The example configurations, rendered from vsup/config/schema.py and checked in:

- `vsup config --example` (configs/vsup.yaml): the keys people set — those whose Field carries a
  `basic(...)` flag — at most 30, every line at most 100 characters, each key valid where it is;
- `vsup config --example --all` (docs/configuration.md, the reference): every key, its default,
  its description and its reload class;
- `vsup config --tune-settings` (docs/tune.md): the keys of a `vsup tune --settings FILE` file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from vsup.config import example
from vsup.config.example import basic_keys, example_yaml, tune_settings_yaml, with_reference, with_tune_settings
from vsup.config.fleet import models_of
from vsup.config.schema import BASIC, RELOAD, VsupConfig, load_config, parse_config
from vsup.config.tune_settings import TuneSettings, load_tune_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "vsup.yaml"
REFERENCE = ROOT / "docs" / "configuration.md"
TUNE_DOC = ROOT / "docs" / "tune.md"
VSUP = Path(sys.executable).parent / "vsup"


def model_keys(model: type[BaseModel], prefix: str = "", *, shown: bool = False) -> dict[str, object]:
    """dotted key -> default, for every leaf field of the config model (shown: what the example
    shows instead: the example of a key that is off by default but worth turning on)."""
    keys = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.update(model_keys(field.annotation, f"{prefix}{name}.", shown=shown))
        elif shown and field.examples and not field.is_required():
            keys[f"{prefix}{name}"] = field.examples[0]
        else:
            keys[f"{prefix}{name}"] = field.get_default(call_default_factory=True)
    return keys


def yaml_keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in data.items():
        if isinstance(value, dict) and value and name != "env":
            keys |= yaml_keys(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def value_at(data: dict, key: str) -> object:
    for part in key.split("."):
        data = data[part]
    return data


def every_key_line_has_a_comment(text: str) -> None:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.endswith(":"):
            assert "#" in line, f"no comment on: {line!r}"


# ---- `vsup config --example`: what a user sets -------------------------------------------------------

def test_the_example_is_the_flagged_keys_at_most_30_in_lines_of_at_most_100_characters():
    text = EXAMPLE.read_text()
    shown = yaml_keys(yaml.safe_load(text))
    assert shown == set(basic_keys()) and len(basic_keys()) == len(shown)
    assert len(shown) <= 30, f"`vsup config --example` shows {len(shown)} keys"
    assert shown <= set(RELOAD), f"keys the config does not know: {shown - set(RELOAD)}"
    assert {"model", "served_model_name", "instances", "vllm.args", "vllm.env", "vllm.venv", "proxy.host", "proxy.port",
            "proxy.api_key", "proxy.policy", "restart.max_rss", "log.dir"} <= shown
    long = [line for line in text.splitlines() if len(line) > example.MAX_WIDTH]
    assert long == [], long
    every_key_line_has_a_comment(text)
    assert "tune" not in yaml.safe_load(text)


def test_the_example_loads_with_the_defaults_but_a_model_and_the_memory_watchdog_on():
    config = load_config(EXAMPLE)
    loaded = config.model_dump()
    defaults = model_keys(VsupConfig)
    for key in basic_keys():
        if key in ("model", "restart.max_rss"):
            continue
        assert value_at(loaded, key) == defaults[key], key
    assert config.restart.max_rss == 1.2 and defaults["restart.max_rss"] is None
    assert config.model == "/srv/models/my-model"


def test_the_examples_second_form_is_a_fleet_vsup_takes():
    text = EXAMPLE.read_text()
    fleet = "\n".join(line.removeprefix("# ") for line in text[text.index("# models:"):].splitlines()) + "\n"
    data = {k: v for k, v in yaml.safe_load(text).items() if k not in ("model", "served_model_name", "instances")}
    combined = yaml.safe_dump(data) + fleet
    chat, embed = models_of(parse_config(combined, "fleet.yaml"))
    assert (chat.name, chat.config.instances, embed.name) == ("chat", 2, "embed")
    assert embed.config.vllm.args == ["--runner", "pooling", "--convert", "embed"]


def test_a_long_short_comment_is_refused_when_the_example_is_rendered(monkeypatch):
    """The width is checked where the example is made, not only here: this check can fail."""
    extra = VsupConfig.model_fields["instances"].json_schema_extra
    assert isinstance(extra, dict)
    monkeypatch.setitem(extra, BASIC, "a comment that says far too much about a key in a file a newcomer reads " * 2)
    with pytest.raises(ValueError, match="runs over 100 characters: 'instances: auto"):
        example_yaml()


def test_taking_the_flag_off_a_key_takes_it_out_of_the_example(monkeypatch):
    extra = VsupConfig.model_fields["served_model_name"].json_schema_extra
    assert isinstance(extra, dict)
    monkeypatch.delitem(extra, BASIC)
    assert "served_model_name" not in basic_keys() and "\nserved_model_name:" not in example_yaml()
    assert "\nserved_model_name:" in example_yaml(full=True)


def test_the_checked_in_example_is_the_generated_one():
    assert EXAMPLE.resolve() == ROOT / "vsup" / "config" / "data" / "vsup.yaml"
    assert EXAMPLE.read_text() == example_yaml(), (
        "configs/vsup.yaml differs from vsup/config/schema.py: run `.venv/bin/python scripts/config_reference.py`")


# ---- `vsup config --example --all`: the reference ----------------------------------------------------

def test_the_reference_has_every_key_with_a_comment_and_its_default():
    text = example_yaml(full=True)
    documented = yaml_keys(yaml.safe_load(text))
    expected = set(model_keys(VsupConfig))
    assert expected - documented == set(), "keys missing from `vsup config --example --all`"
    assert documented - expected == set(), "`vsup config --example --all` has keys the config does not know"
    every_key_line_has_a_comment(text)
    config = parse_config(text, "reference.yaml")
    defaults = model_keys(VsupConfig, shown=True)
    assert model_keys(VsupConfig)["restart.max_rss"] is None and defaults["restart.max_rss"] == 1.2
    assert "(this example turns it on; the default is null)" in text
    loaded = config.model_dump()
    for key, default in defaults.items():
        if key != "model":  # required: the example names one
            assert value_at(loaded, key) == default, f"--all {key}: {value_at(loaded, key)!r}, but the default is {default!r}"


def test_docs_configuration_holds_the_reference():
    text = REFERENCE.read_text()
    assert with_reference(text) == text, (
        "docs/configuration.md's reference differs from `vsup config --example --all`: "
        "run `.venv/bin/python scripts/config_reference.py`")
    assert f"```yaml\n{example_yaml(full=True)}```" in text


@pytest.mark.parametrize("section", [None, *(name for name, f in VsupConfig.model_fields.items()
                                             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))])
def test_every_key_and_section_has_a_description(section):
    model = VsupConfig if section is None else VsupConfig.model_fields[section].annotation
    missing = [name for name, field in model.model_fields.items() if not field.description]
    assert missing == [], f"{section or 'top level'}: keys without a description (their documentation): {missing}"


def test_byte_sizes_are_spelled_out_and_sections_read_as_before():
    text = example_yaml(full=True)
    assert "  max_body_bytes: 8388608         # [fixed] larger request bodies get 413 (8 MiB)\n" in text
    assert "  max_bytes: 52428800             # [fixed] rotate an instance log at this size (50 MiB)\n" in text
    assert "\nplacement:                        # how cores and memory are split among the instances" in text
    assert "model: /srv/models/my-model       # [relaunch] REQUIRED: " in text


# ---- `vsup config --tune-settings`: a `vsup tune --settings FILE` file ----------------------------------

def test_the_tune_settings_have_every_key_and_load_as_the_defaults(tmp_path):
    text = tune_settings_yaml()
    assert set(yaml.safe_load(text)) == set(TuneSettings.model_fields)
    every_key_line_has_a_comment(text)
    path = tmp_path / "tune.yaml"
    path.write_text(text)
    assert load_tune_settings(path).model_dump() == TuneSettings().model_dump()
    doc = TUNE_DOC.read_text()
    assert with_tune_settings(doc) == doc, "docs/tune.md's settings differ: run `.venv/bin/python scripts/config_reference.py`"


# ---- the command -------------------------------------------------------------------------------------

def test_vsup_config_prints_each():
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(VSUP), "config", *args], capture_output=True, text=True, timeout=60)

    assert run("--example").stdout == EXAMPLE.read_text()
    assert run("--example", "--all").stdout == example_yaml(full=True)
    assert run("--tune-settings").stdout == tune_settings_yaml()
    bare = run()
    assert bare.returncode == 2 and bare.stderr.startswith("vsup: error: say what to show: --example")
    alone = run("--all")
    assert alone.returncode == 2 and "--example" in alone.stderr and alone.stderr.count("\n") == 1
