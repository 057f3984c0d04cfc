"""configs/vsup.yaml documents every key of vsup/config/schema.py, with its default value: it is
`vsup config --example`, rendered from the model's descriptions, checked in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from vsup.config.example import example_yaml, tune_settings_yaml, with_tune_settings
from vsup.config.schema import VsupConfig, load_config
from vsup.config.tune_settings import TuneSettings, load_tune_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "vsup.yaml"
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


def test_every_config_key_is_in_the_example_with_a_comment():
    text = EXAMPLE.read_text()
    documented = yaml_keys(yaml.safe_load(text))
    expected = set(model_keys(VsupConfig))
    assert expected - documented == set(), "keys missing from configs/vsup.yaml"
    assert documented - expected == set(), "configs/vsup.yaml has keys the config does not know"
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.endswith(":"):
            assert "#" in line, f"no comment on: {line!r}"


def test_the_example_loads_and_holds_the_defaults_but_turns_the_memory_watchdog_on():
    config = load_config(EXAMPLE)
    defaults = model_keys(VsupConfig, shown=True)
    assert model_keys(VsupConfig)["restart.max_rss"] is None and defaults["restart.max_rss"] == 1.2
    assert "(this example turns it on; the default is null)" in EXAMPLE.read_text()
    loaded = config.model_dump()
    for key, default in defaults.items():
        if key == "model":
            continue  # required: the example names one
        value = loaded
        for part in key.split("."):
            value = value[part]
        assert value == default, f"configs/vsup.yaml {key}: {value!r}, but the default is {default!r}"


def test_the_checked_in_example_is_the_generated_one():
    assert EXAMPLE.resolve() == ROOT / "vsup" / "config" / "data" / "vsup.yaml"
    assert EXAMPLE.read_text() == example_yaml(), (
        "configs/vsup.yaml differs from the descriptions in vsup/config/schema.py: "
        "run `.venv/bin/python scripts/config_reference.py`")


def test_vsup_config_example_prints_it():
    result = subprocess.run([str(VSUP), "config", "--example"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == EXAMPLE.read_text()
    tune = subprocess.run([str(VSUP), "config", "--tune-settings"], capture_output=True, text=True, timeout=60)
    assert tune.returncode == 0 and tune.stdout == tune_settings_yaml()
    bare = subprocess.run([str(VSUP), "config"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and bare.stderr.startswith("vsup: error: say what to show: --example")


@pytest.mark.parametrize("section", [None, *(name for name, f in VsupConfig.model_fields.items()
                                             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))])
def test_every_key_and_section_has_a_description(section):
    model = VsupConfig if section is None else VsupConfig.model_fields[section].annotation
    missing = [name for name, field in model.model_fields.items() if not field.description]
    assert missing == [], f"{section or 'top level'}: keys without a description (their documentation): {missing}"


def test_byte_sizes_are_spelled_out_and_sections_read_as_before():
    text = example_yaml()
    assert "  max_body_bytes: 8388608         # [fixed] larger request bodies get 413 (8 MiB)\n" in text
    assert "  max_bytes: 52428800             # [fixed] rotate an instance log at this size (50 MiB)\n" in text
    assert "\nplacement:                        # how cores and memory are split among the instances" in text
    assert "model: /srv/models/my-model       # [relaunch] REQUIRED: " in text


def test_the_tune_settings_have_every_key_and_load_as_the_defaults(tmp_path):
    text = tune_settings_yaml()
    assert set(yaml.safe_load(text)) == set(TuneSettings.model_fields)
    path = tmp_path / "tune.yaml"
    path.write_text(text)
    assert load_tune_settings(path).model_dump() == TuneSettings().model_dump()
    doc = (ROOT / "docs" / "tune.md").read_text()
    assert with_tune_settings(doc) == doc, "docs/tune.md's settings differ: run `.venv/bin/python scripts/config_reference.py`"
