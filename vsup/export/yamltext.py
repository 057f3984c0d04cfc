"""YAML text for exported files: PyYAML with the keys in the order given, multi-line strings as
literal blocks (a ConfigMap's file stays readable), and `#` comment lines before a document."""

from __future__ import annotations

from collections.abc import Iterable

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def comment(text: str) -> str:
    """Each line of `text` as a YAML comment line."""
    return "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines())


def dump(data: object) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100, allow_unicode=True)


def documents(docs: Iterable[tuple[str, object]]) -> str:
    """A multi-document stream: each (comment text, object) as `---`, its comment lines, the object."""
    return "".join(f"---\n{comment(note)}{dump(data)}" for note, data in docs)
