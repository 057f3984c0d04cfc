"""Reading a configuration file strictly and boundedly, and naming where a key was written.

`read_text(path)` takes at most MAX_FILE_BYTES and decodes UTF-8 (a bad byte is named by offset,
line and column); `load_yaml(text, origin)` composes YAML nested at most MAX_DEPTH deep and
expanding (through aliases and merges) to at most MAX_VALUES values, refuses a key given twice,
and returns the node tree beside the data, so `describe` (a pydantic error as one line per bad
key) and `where` (a key as "FILE:LINE: key") can name lines. Nothing here knows the keys:
vsup/config/schema.py does.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from vsup.errors import ConfigError

MiB = 1024**2

# A vsup configuration is a few KiB with ~70 keys; these leave room for long vllm.args/env lists.
MAX_FILE_BYTES = 1 * MiB
MAX_DEPTH = 32
MAX_VALUES = 10_000
# Error lines name at most this many problems.
MAX_PROBLEMS = 5


def read_text(path: Path) -> str:
    """The file's text, or a ConfigError: unreadable, over MAX_FILE_BYTES, not UTF-8."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES // MiB} MiB; a vsup configuration is a few KiB "
                          "(`vsup config --example --all` lists every key)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                          f"(line {line}, column {column}); save the file as UTF-8") from None


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that vsup will not take (too deep, too large, a key given twice)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, counting while it composes: the depth of nesting, and for every node the
    number of values it stands for once aliases are expanded (an alias is one node in the YAML tree
    but a full copy for whoever walks the result: validation, error messages). A "billion laughs"
    document is refused after composing a few dozen nodes, before anything walks it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._size: dict[int, tuple[int, int]] = {}  # id(node) -> (values when expanded, height)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            if id(node) not in self._size:  # still being composed: the alias is inside its own anchor
                raise _Refused(None, None, f"alias *{event.anchor} refers to a node that contains it", event.start_mark)
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels; a vsup configuration needs 4", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        sizes = [self._size[id(child)] for child in children]
        values = 1 + sum(size for size, _ in sizes)
        height = 1 + max((h for _, h in sizes), default=0)
        if values > MAX_VALUES:
            raise _Refused(None, None, f"expands to more than {MAX_VALUES} values (through YAML aliases and merges); "
                           "a vsup configuration needs a few hundred", mark)
        if height > MAX_DEPTH:
            raise _Refused(None, None, f"nested deeper than {MAX_DEPTH} levels once its aliases are expanded; "
                           "a vsup configuration needs 4", mark)
        self._size[id(node)] = (values, height)
        return node


def load_yaml(text: str, origin: str) -> tuple[Any, Any]:
    """(the YAML node tree, for line numbers; the Python data) or a ConfigError."""
    loader = None
    try:
        loader = _BoundedLoader(text)
        root = loader.get_single_node()
        if root is not None:
            _check_duplicate_keys(root)
        data = loader.construct_document(root) if root is not None else None
    except _Refused as exc:
        where = f"{origin}:{exc.problem_mark.line + 1}" if exc.problem_mark else origin
        raise ConfigError(f"{where}: {exc.problem}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, other controls)
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{origin}:{line}: not valid YAML: character U+{exc.character:04X} at offset {exc.position} "
                          f"is not allowed ({exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}" if mark else origin
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    return root, data


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_duplicate_keys(root: Any) -> None:
    """YAML says keys are unique; PyYAML lets the last one win. Name the key and both lines.
    (Explicit keys may still override keys merged in with `<<: *anchor`.)"""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:  # an alias: the same node again
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], Any] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    dotted = f"{path}{key.value}"
                    previous = first.setdefault((key.tag, key.value), key)
                    if previous is not key:
                        raise _Refused(None, None, f"{_clip(dotted)}: given twice (lines {previous.start_mark.line + 1} "
                                       f"and {key.start_mark.line + 1}); YAML would keep only the last: remove one",
                                       key.start_mark)
                    stack.append((value, f"{dotted}."))
                else:
                    stack.append((value, path))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}{index}.") for index, item in enumerate(node.value))


# --- error messages -----------------------------------------------------------------------------

_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = 60
_quote.maxlong = 40
_quote.maxlist = _quote.maxtuple = _quote.maxdict = _quote.maxset = 4
_quote.maxlevel = 2


def quote(value: Any) -> str:
    """A value as an error message shows it: YAML's spelling of true/false/null, else a repr cut
    to a short excerpt (a 10 MB value or a deep structure must not become a 10 MB error line)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return _quote.repr(value)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


# Keys that were replaced or removed, by "section.key" ("key" at the top level), with what to write
# instead: refused with that line, not as unknown (an old config must not run with a meaning it did
# not ask for, and its author learns where the setting went).
_DERIVED = "; remove this key (restart.max_delay sets the longest wait; docs/supervisor.md, \"Restart policy\")"
REPLACED = {
    "proxy.affinity_max_imbalance": "replaced by proxy.affinity_load_factor (bounded-load hashing: no instance above ceil((1 + ε) x the"
                                    " mean load), default 0.25; docs/proxy.md): remove this key, and set that one if the default does not fit",
    "restart.initial_delay": "derived now: the first restart waits 1 s (at most restart.max_delay)" + _DERIVED,
    "restart.multiplier": "derived now: each further failure in a row doubles the wait, up to restart.max_delay" + _DERIVED,
    "restart.jitter": "derived now: up to 1 s at random is added to each wait" + _DERIVED,
    "restart.crash_loop_failures": "replaced by restart.max_failures (failures in a row, with no start ready restart.stable_after"
                                   " seconds between them, that mark an instance failed): rename this key",
    "restart.crash_loop_window": "replaced by restart.stable_after: failures count until a start stays ready that long, not"
                                 " within a window; remove this key (restart.max_failures says how many make a crash loop)",
    "tune": "`vsup tune`'s settings left the run file (`vsup run` never read them): give them as `vsup tune` flags, or move"
            " this section's keys to a file of their own, `vsup tune --settings FILE` (docs/tune.md)",
}
_UNION_MEMBERS = {"int", "float", "str"}  # what pydantic names the members of `int | float | str` unions


def describe(exc: ValidationError, root: Any, origin: str, *, listing: str = "`vsup config --example --all` lists every key") -> str:
    """One entry per bad key: "<file>:<line>: <dotted.key>: <value> is not valid: <why>"; several
    are joined with "; " (the CLI prints one line), at most MAX_PROBLEMS of them. `listing`: where
    an unknown key's author finds the keys there are."""
    problems: dict[str, tuple[str, list[str]]] = {}  # key -> (start of the entry, reasons)
    for error in exc.errors():
        # drop the union member names pydantic adds to the location ("int", "literal['auto']")
        loc = [part for part in error["loc"] if not (isinstance(part, str) and (part in _UNION_MEMBERS or "[" in part))]
        key = _clip("".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(top level)")
        line = _line_of(root, loc)
        where = f"{origin}:{line}" if line else origin
        if error["type"] == "extra_forbidden" and _replaced(loc) in REPLACED:
            problems.setdefault(key, (f"{where}: {key}: {REPLACED[_replaced(loc)]}", []))
        elif error["type"] == "extra_forbidden":
            problems.setdefault(key, (f"{where}: {key}: unknown key (check the spelling; {listing})", []))
        elif error["type"] == "missing":
            problems.setdefault(key, (f"{where}: {key}: required key is missing", []))
        else:
            value = error.get("input")
            reasons = problems.setdefault(key, (f"{where}: {key}: {quote(value)} is not valid", []))[1]
            reasons.append(_reason(error, value))
    entries = []
    for head, reasons in problems.values():
        if reasons:
            # a union (`instances: 3 or auto`) fails once per member: "a valid integer or 'auto'"
            first, *rest = reasons
            head += ": " + " or ".join([first, *(r.removeprefix("Input should be ") for r in rest)])
        entries.append(head)
    if len(entries) > MAX_PROBLEMS:
        entries = entries[:MAX_PROBLEMS] + [f"and {len(entries) - MAX_PROBLEMS} more"]
    return "; ".join(entries)


def _replaced(loc: list) -> str:
    """The REPLACED entry a key's location names: "section.key", or "key" at the top level (and
    for a key of a list's entry, `models[1].tune`)."""
    if len(loc) >= 2 and isinstance(loc[-2], str):
        return f"{loc[-2]}.{loc[-1]}"
    return str(loc[-1]) if loc else ""


def _reason(error: Mapping[str, Any], value: Any) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "string_type" and isinstance(value, (int, float, bool)):
        message += " (quote it: YAML reads it as a number or a boolean)"
    return message


def _line_of(node: Any, loc: list, *, exact: bool = False) -> int | None:
    """The 1-based line of the YAML node at `loc`, or of its nearest existing parent (None with
    exact=True: the key is not in the file)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if pair is None:
                return None if exact else line
            line = pair[0].start_mark.line + 1
            node = pair[1]
        elif isinstance(node, yaml.SequenceNode) and str(part).isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            return line
    return line


class Located(Protocol):
    """A configuration that remembers where it was read (VsupConfig)."""

    _origin: str | None
    _root: Any
    _prefix: str | None  # a model's view of a fleet: "models[1]" (vsup/config/fleet.py)


def key_path(key: str) -> list[str]:
    """"models[1].placement.nodes" -> ["models", "1", "placement", "nodes"]."""
    return [part for piece in key.split(".") for part in piece.replace("]", "").split("[") if part]


def line_of(cfg: Located, key: str) -> int | None:
    """The line of the file that sets `key` (None: the file does not)."""
    return _line_of(cfg._root, key_path(key), exact=True) if cfg._origin is not None else None


def where(cfg: Located, key: str) -> str:
    """How an error names a key: "FILE:LINE: dotted.key" when the file sets it, "FILE: dotted.key
    (default)" when it does not, the bare key for a config that was not read from a file. A
    model's view names its entry's key (`models[1].placement.nodes`) unless the value it has
    came from the top level."""
    prefix = getattr(cfg, "_prefix", None)
    if prefix:
        own = f"{prefix}.{key}"
        if cfg._origin is None or line_of(cfg, own) is not None or line_of(cfg, key) is None:
            key = own
    if cfg._origin is None:
        return key
    line = line_of(cfg, key)
    return f"{cfg._origin}:{line}: {key}" if line else f"{cfg._origin}: {key} (default)"
