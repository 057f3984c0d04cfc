"""The commented example configuration, rendered from the config model (pure).

Every key of vsup/config/schema.py appears with its default (or, for a required key, its
example) and its `description` as the comment; a section's comment is the description of its
field in `VsupConfig` (or in its section, for a section inside one, like `health.warmup`). A key
that is off by default but worth turning on (`restart.max_rss`) shows its example, and its
default after the comment. Byte counts (keys ending in `bytes`) get their size in KiB/MiB/GiB added.
Each key's comment starts with its reload class in brackets ([live], [relaunch], ...: what a
`vsup reload` does with a change, from the table in vsup/config/schema.py, `RELOAD`); the header
says what each means.
`vsup config --example` prints this text; vsup/config/data/vsup.yaml (configs/vsup.yaml) and
the README's configuration reference are this text checked in (scripts/config-reference writes
both; tests/test_example_config.py and tests/test_readme.py keep them identical).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from vsup.config.reloading import MEANING, Reload
from vsup.config.schema import RELOAD, ModelConfig, VsupConfig
from vsup.config.tune_settings import TuneSettings

HEADER = (
    "# vsup configuration: every key, with its default and what it does.",
    "# `vsup run --config configs/vsup.yaml`. Only `model` is required; delete what you do not change.",
    "# Unknown keys are errors (a typo never falls back to a default silently).",
    "# `vsup config --example` prints this file; it is generated from vsup/config/schema.py.",
    "# Each comment starts with what `vsup reload` (SIGHUP) does with a change to the key:",
    *(f"#   [{kind.value}] {MEANING[kind]}" for kind in Reload),
)
COMMENT_COLUMN = 34  # where the `#` of each key's comment goes (0-based), as a hand-aligned file has it
# The README's copy sits between these two lines.
README_BEGIN = "<!-- BEGIN `vsup config --example` (scripts/config_reference.py writes it; edit vsup/config/schema.py) -->"
README_END = "<!-- END `vsup config --example` -->"
# `vsup config --tune-settings`: the keys of a `vsup tune --settings FILE` file (docs/tune.md holds it).
TUNE_HEADER = (
    "# vsup tune's settings: what it may try and the load it measures with (docs/tune.md).",
    "# `vsup tune --config my.yaml --settings this.yaml`; each key's flag overrides it",
    "# (--instances-per-node for instances_per_node). `vsup config --tune-settings` prints this file.",
)
TUNE_BEGIN = "<!-- BEGIN `vsup config --tune-settings` (scripts/config_reference.py writes it; edit vsup/config/tune_settings.py) -->"
TUNE_END = "<!-- END `vsup config --tune-settings` -->"


def example_yaml() -> str:
    lines = [*HEADER, ""]
    sections = []
    for name, field in VsupConfig.model_fields.items():
        if _section_model(field) is None:
            lines.append(_key_line(name, field, "", name))
        else:
            sections.append((name, field))
    for name, field in sections:
        lines.append("")
        lines.extend(_section_lines(name, field, ""))
    lines.extend(["", *_fleet_lines()])
    return "\n".join(lines) + "\n"


def tune_settings_yaml() -> str:
    """`vsup config --tune-settings`: every key of vsup/config/tune_settings.py, rendered like the example."""
    lines = [*TUNE_HEADER, ""]
    for name, field in TuneSettings.model_fields.items():
        lines.append(_commented(f"{name}: {_scalar(field.get_default(call_default_factory=True))}", field.description))
    return "\n".join(lines) + "\n"


def _fleet_lines() -> list[str]:
    """The second form, commented out: the keys of one entry of `models:` (ModelConfig)."""
    lines = ["# The second form: several models behind the one endpoint, the proxy routing each request by its",
             '# "model" (README: "Several models on one machine"). Leave out the top-level model,',
             "# served_model_name and instances; the other top-level keys are every model's defaults. Each entry:",
             "# models:"]
    for i, (key, field) in enumerate(ModelConfig.model_fields.items()):
        lead = "#   - " if i == 0 else "#     "
        if _section_model(field) is not None:
            lines.append(_commented(f"{lead}{key}: {{}}", field.description))
            continue
        value = field.examples[0] if field.is_required() and field.examples else field.get_default(call_default_factory=True)
        lines.append(_commented(f"{lead}{key}: {_scalar(value)}", ("REQUIRED: " if field.is_required() else "") + (field.description or "")))
    return lines


def _section_lines(name: str, field: FieldInfo, indent: str, prefix: str = "") -> list[str]:
    model = _section_model(field)
    assert model is not None, f"{name} is not a section"
    lines = [_commented(f"{indent}{name}:", field.description)]
    for key, subfield in model.model_fields.items():
        if _section_model(subfield) is None:
            lines.append(_key_line(key, subfield, indent + "  ", f"{prefix}{name}.{key}"))
        else:
            lines.extend(_section_lines(key, subfield, indent + "  ", f"{prefix}{name}."))
    return lines


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _key_line(name: str, field: FieldInfo, indent: str, key: str) -> str:
    if not field.description:
        raise ValueError(f"{name}: every config key needs a description (it is the key's documentation)")
    if field.is_required():
        if not field.examples:
            raise ValueError(f"{key}: a required config key needs an example (it is the example config's value)")
        value, comment = field.examples[0], f"REQUIRED: {field.description}"
    elif field.examples:
        default = field.get_default(call_default_factory=True)
        value, comment = field.examples[0], f"{field.description} (this example turns it on; the default is {_scalar(default)})"
    else:
        value, comment = field.get_default(call_default_factory=True), field.description
        if name.endswith("bytes") and isinstance(value, int):
            comment += f" ({_size(value)})"
    return _commented(f"{indent}{name}: {_scalar(value)}", f"[{RELOAD[key].reload.value}] {comment}")


def _commented(text: str, comment: str | None) -> str:
    if not comment:
        return text
    return f"{text.ljust(COMMENT_COLUMN)}# {comment}" if len(text) < COMMENT_COLUMN else f"{text}  # {comment}"


def _scalar(value: Any) -> str:
    """A default as YAML writes it on one line: null, true, 1.5, auto, [], {}."""
    if isinstance(value, Path):
        value = str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _size(count: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= size and count % size == 0:
            return f"{count // size} {unit}"
    return f"{count} bytes"


def with_readme_reference(readme: str) -> str:
    """The README text with the example between README_BEGIN and README_END replaced by today's."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md has no {README_BEGIN!r} ... {README_END!r} block")
    block = f"{README_BEGIN}\n```yaml\n{example_yaml()}```\n"
    return readme[:begin] + block + readme[end:]


def with_tune_settings(document: str) -> str:
    """docs/tune.md with its `vsup config --tune-settings` block as today's."""
    begin, end = document.find(TUNE_BEGIN), document.find(TUNE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"docs/tune.md has no {TUNE_BEGIN!r} ... {TUNE_END!r} block")
    return document[:begin] + f"{TUNE_BEGIN}\n```yaml\n{tune_settings_yaml()}```\n" + document[end:]
