"""Write the instance lifecycle diagram, drawn from vsup/supervisor/states.py's `TRANSITIONS`, into
ARCHITECTURE.md and docs/supervisor.md (between their `lifecycle-diagram` marker comments). Run it
after changing the table:

    .venv/bin/python scripts/lifecycle_diagram.py

`--check` changes nothing and exits 1 when a file differs (tests/test_lifecycle.py runs it)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a plain script from a checkout

from vsup.supervisor.states import diagram  # noqa: E402

FILES = ("ARCHITECTURE.md", "docs/supervisor.md")
BLOCK = re.compile(r"(<!-- lifecycle-diagram:begin[^\n]*-->\n)(.*?)(<!-- lifecycle-diagram:end -->)", re.S)


def with_diagram(text: str, where: str) -> str:
    """`text` with the block between the markers replaced by the current diagram."""
    if len(BLOCK.findall(text)) != 1:
        raise SystemExit(f"{where}: needs exactly one <!-- lifecycle-diagram:begin --> ... "
                         "<!-- lifecycle-diagram:end --> block")
    return BLOCK.sub(lambda m: f"{m[1]}```\n{diagram()}```\n{m[3]}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a file differs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose files to write")
    args = parser.parse_args(argv)
    stale = []
    for name in FILES:
        path = args.root / name
        text = path.read_text()
        new = with_diagram(text, name)
        if new == text:
            print(f"{name}: already up to date")
        elif args.check:
            stale.append(name)
            print(f"{name}: the lifecycle diagram differs from vsup/supervisor/states.py's TRANSITIONS")
        else:
            path.write_text(new)
            print(f"{name}: rewritten")
    if stale:
        print("run `.venv/bin/python scripts/lifecycle_diagram.py`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
