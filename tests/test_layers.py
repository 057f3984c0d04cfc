"""The parts of vsup depend on each other one way: a part imports only the parts listed before it in
ARCHITECTURE.md, "Parts and their order". Read from the source with ast, so a lazy import inside a
function counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

VSUP = Path(__file__).resolve().parent.parent / "vsup"

ARCHITECTURE = VSUP.parent / "ARCHITECTURE.md"


def order() -> list[str]:
    """The parts in their order, as ARCHITECTURE.md's "Parts and their order" lists them (one source)."""
    section = ARCHITECTURE.read_text(encoding="utf-8").split("## Parts and their order", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"((?:`\w+`\s*·\s*)+`\w+`)", section)
    assert listed, "ARCHITECTURE.md's 'Parts and their order' lists no parts"
    return re.findall(r"`(\w+)`", listed.group(1))


# A part may import the parts before it: lower parts never reach up (the core does not import the
# CLI, the doctor does not import tune, the proxy does not import the supervisor that runs it).
ALLOWED: dict[str, set[str]] = {part: set(order()[:i]) for i, part in enumerate(order())}
TOP_LEVEL = {"__init__", "__main__"}  # the version and `python -m vsup`


def part_of(path: Path) -> str:
    rel = path.relative_to(VSUP)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + ([f"vsup.{a.name}" for a in node.names] if node.module == "vsup" else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            words = name.split(".")
            if words[0] == "vsup" and len(words) > 1 and words[1] not in TOP_LEVEL and words[1] != "__version__":
                found.add(words[1])
    return found


def test_every_part_is_listed():
    parts = {part_of(p) for p in VSUP.rglob("*.py")} - TOP_LEVEL
    assert parts == set(ALLOWED), "a new part needs its place in ALLOWED (and in ARCHITECTURE.md)"


def test_parts_import_only_the_parts_below_them():
    wrong = []
    for path in sorted(VSUP.rglob("*.py")):
        part = part_of(path)
        if part in TOP_LEVEL:
            continue
        for other in sorted(imported_parts(path) - {part} - ALLOWED[part]):
            wrong.append(f"{path.relative_to(VSUP.parent)} imports vsup.{other}")
    assert not wrong, "imports against the parts' order:\n" + "\n".join(wrong)


def test_the_order_names_each_part_once():
    assert len(order()) == len(set(order())), order()


def test_the_checker_sees_a_lazy_import(tmp_path):
    # the rule above would pass vacuously if imported_parts missed imports inside functions
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from vsup.cli.main import main\n    import vsup.tune.search\n")
    assert imported_parts(module) == {"cli", "tune"}
