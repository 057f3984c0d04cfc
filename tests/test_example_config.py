"""configs/vsup.yaml documents every key of vsup/supervisor/config.py, with its default value."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel

from vsup.supervisor.config import VsupConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "vsup.yaml"


def model_keys(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """dotted key -> default, for every leaf field of the config model."""
    keys = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.update(model_keys(field.annotation, f"{prefix}{name}."))
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


def test_the_example_loads_and_holds_the_defaults():
    config = load_config(EXAMPLE)
    defaults = model_keys(VsupConfig)
    loaded = config.model_dump()
    for key, default in defaults.items():
        if key == "model":
            continue  # required: the example names one
        value = loaded
        for part in key.split("."):
            value = value[part]
        assert value == default, f"configs/vsup.yaml {key}: {value!r}, but the default is {default!r}"
