"""The commented example configurations, rendered from the config model (pure).

`example_yaml()` (`vsup config --example`, configs/vsup.yaml): the keys a user sets — those
whose Field carries a `basic(comment, ...)` flag in vsup/config/schema.py — each with its default
(or, for a required key or one worth turning on, its example) and that short comment; every line
at most MAX_WIDTH characters. It ends with the second form (`models:`) commented out.

`example_yaml(full=True)` (`vsup config --example --all`, the reference in docs/configuration.md):
every key with its default (or example) and its `description` as the comment; a section's comment
is the description of its field in `VsupConfig` (or in its section, for a section inside one, like
`health.warmup`). A key that is off by default but worth turning on (`restart.max_rss`) shows its
example, and its default after the comment. Byte counts (keys ending in `bytes`) get their size
in KiB/MiB/GiB added. Each key's comment starts with its reload class in brackets ([live],
[relaunch], ...: what a `vsup reload` does with a change, from the table in
vsup/config/schema.py, `RELOAD`); the header says what each means.

`tune_settings_yaml()` (`vsup config --tune-settings`, docs/tune.md): the keys of a
`vsup tune --settings FILE` file, rendered the same way from vsup/config/tune_settings.py.

scripts/config_reference.py writes them where they are checked in (vsup/config/data/vsup.yaml,
which configs/vsup.yaml links to; the blocks of docs/configuration.md and docs/tune.md);
tests/test_example_config.py keeps each identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from vsup.config.reloading import MEANING, Reload
from vsup.config.schema import BASIC, RELOAD, ModelConfig, VsupConfig
from vsup.config.tune_settings import TuneSettings

FULL_HEADER = (
    "# vsup configuration: every key, with its default and what it does.",
    "# `vsup run --config my.yaml`. Only `model` is required; delete what you do not change.",
    "# Unknown keys are errors (a typo never falls back to a default silently).",
    "# `vsup config --example --all` prints this file; it is generated from vsup/config/schema.py.",
    "# `vsup config --example` prints only the keys people set, with short comments.",
    "# Each comment starts with what `vsup reload` (SIGHUP) does with a change to the key:",
    *(f"#   [{kind.value}] {MEANING[kind]}" for kind in Reload),
)
BASIC_HEADER = (
    "# vsup configuration: the keys people set. `vsup run --config my.yaml`",
    "# Only `model` is required; delete what you do not change. Unknown keys are errors.",
    f"# All {len(RELOAD)} keys, their defaults and what `vsup reload` does with a change to each:",
    "# `vsup config --example --all`, or docs/configuration.md.",
)
# The second form of the short example, commented out; tests/test_example_config.py loads it.
BASIC_FLEET = (
    "# Several models behind the one endpoint, the proxy routing each request by its \"model\":",
    "# leave out model, served_model_name and instances above, and list the models (docs/fleet.md):",
    "# models:",
    "#   - {model: /srv/models/chat, served_model_name: chat, instances: 2}",
    "#   - model: /srv/models/embed",
    "#     served_model_name: embed",
    "#     instances: 1",
    "#     vllm: {args: [--runner, pooling, --convert, embed]}",
)
TUNE_HEADER = (
    "# vsup tune's settings: what it may try and the load it measures with (docs/tune.md).",
    "# `vsup tune --config my.yaml --settings this.yaml`; each key's flag overrides it",
    "# (--instances-per-node for instances_per_node). `vsup config --tune-settings` prints this file.",
)
COMMENT_COLUMN = 34  # where the `#` of each key's comment goes (0-based), as a hand-aligned file has it
MAX_WIDTH = 100  # the longest line of the short example
# The copies in docs/ sit between these lines (scripts/config_reference.py writes them).
REFERENCE_BEGIN = "<!-- BEGIN `vsup config --example --all` (scripts/config_reference.py writes it; edit vsup/config/schema.py) -->"
REFERENCE_END = "<!-- END `vsup config --example --all` -->"
TUNE_BEGIN = "<!-- BEGIN `vsup config --tune-settings` (scripts/config_reference.py writes it; edit vsup/config/tune_settings.py) -->"
TUNE_END = "<!-- END `vsup config --tune-settings` -->"


def example_yaml(*, full: bool = False) -> str:
    lines = [*(FULL_HEADER if full else BASIC_HEADER), ""]
    sections = []
    for name, field in VsupConfig.model_fields.items():
        if _section_model(field) is None:
            if full or _basic(field):
                lines.append(_key_line(name, field, "", name, full=full))
        else:
            sections.append((name, field))
    for name, field in sections:
        section = _section_lines(name, field, "", full=full)
        if section:
            lines.append("")
            lines.extend(section)
    lines.extend(["", *(_fleet_lines() if full else BASIC_FLEET)])
    if not full:
        too_long = [line for line in lines if len(line) > MAX_WIDTH]
        if too_long:
            raise ValueError(f"a line of `vsup config --example` runs over {MAX_WIDTH} characters: {too_long[0]!r}")
    return "\n".join(lines) + "\n"


def tune_settings_yaml() -> str:
    lines = [*TUNE_HEADER, ""]
    for name, field in TuneSettings.model_fields.items():
        lines.append(_key_line(name, field, "", None, full=True))
    return "\n".join(lines) + "\n"


def basic_keys() -> list[str]:
    """The dotted keys `vsup config --example` shows, in its order."""
    return _basic_keys(VsupConfig)


def _basic_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        section = _section_model(field)
        if section is not None:
            keys.extend(_basic_keys(section, f"{prefix}{name}."))
        elif _basic(field):
            keys.append(f"{prefix}{name}")
    return keys


def _basic(field: FieldInfo) -> str | None:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    comment = extra.get(BASIC)
    return str(comment) if comment else None


def _fleet_lines() -> list[str]:
    """The second form, commented out: the keys of one entry of `models:` (ModelConfig)."""
    lines = ["# The second form: several models behind the one endpoint, the proxy routing each request by its",
             '# "model" (docs/fleet.md). Leave out the top-level model,',
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


def _section_lines(name: str, field: FieldInfo, indent: str, prefix: str = "", *, full: bool) -> list[str]:
    model = _section_model(field)
    assert model is not None, f"{name} is not a section"
    lines = []
    for key, subfield in model.model_fields.items():
        if _section_model(subfield) is None:
            if full or _basic(subfield):
                lines.append(_key_line(key, subfield, indent + "  ", f"{prefix}{name}.{key}", full=full))
        else:
            lines.extend(_section_lines(key, subfield, indent + "  ", f"{prefix}{name}.", full=full))
    if not lines:
        return []
    return [_commented(f"{indent}{name}:", field.description if full else _basic(field)), *lines]


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _key_line(name: str, field: FieldInfo, indent: str, key: str | None, *, full: bool) -> str:
    """`key`: the dotted key whose reload class tags the comment (None: no tag)."""
    if not field.description:
        raise ValueError(f"{name}: every config key needs a description (it is the key's documentation)")
    if field.is_required() and not field.examples:
        raise ValueError(f"{key or name}: a required config key needs an example (it is the example config's value)")
    default = field.get_default(call_default_factory=True)
    value = field.examples[0] if field.examples else default
    if not full:
        comment = _basic(field)
        assert comment is not None
        return _commented(f"{indent}{name}: {_scalar(value)}", comment)
    if field.is_required():
        comment = f"REQUIRED: {field.description}"
    elif field.examples:
        comment = f"{field.description} (this example turns it on; the default is {_scalar(default)})"
    else:
        comment = field.description
        if name.endswith("bytes") and isinstance(value, int):
            comment += f" ({_size(value)})"
    tag = f"[{RELOAD[key].reload.value}] " if key is not None else ""
    return _commented(f"{indent}{name}: {_scalar(value)}", tag + comment)


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


def with_block(document: str, text: str, begin: str, end: str, name: str = "the document") -> str:
    """`document` with what lies between the `begin` and `end` lines replaced by `text` as a
    ```yaml block; ValueError when it has no such block."""
    start, stop = document.find(begin), document.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{name} has no {begin!r} ... {end!r} block")
    return document[:start] + f"{begin}\n```yaml\n{text}```\n" + document[stop:]


def with_reference(document: str) -> str:
    """docs/configuration.md with its `vsup config --example --all` block as today's."""
    return with_block(document, example_yaml(full=True), REFERENCE_BEGIN, REFERENCE_END, "docs/configuration.md")


def with_tune_settings(document: str) -> str:
    """docs/tune.md with its `vsup config --tune-settings` block as today's."""
    return with_block(document, tune_settings_yaml(), TUNE_BEGIN, TUNE_END, "docs/tune.md")
