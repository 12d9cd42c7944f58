#!/usr/bin/env python3
"""Rewrite the README's "What it detects" table from the engine's catalogue data.

    python tools/catalogue_table.py           # rewrite README.md between the table's markers
    python tools/catalogue_table.py --check   # exit 1 when README.md differs (what the test checks)

The table is ``trainguard_engine.catalogue.readme_table()``: the ``fires_when`` / ``settings`` / ``row``
fields of engine/src/trainguard_engine/data/catalogue.toml, with every default read from
``DetectionSettings``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "sdk" / "src"), str(REPO / "engine" / "src")]

from trainguard_engine.catalogue import README_BEGIN, README_END, readme_table  # noqa: E402

README = REPO / "README.md"


def rendered(text: str) -> str:
    """``text`` with the table between the markers replaced by the generated one."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"{README}: the catalogue table markers are missing")
    return text[:start] + readme_table() + text[end + len(README_END):]


def main(argv: list) -> int:  # type: ignore[type-arg]
    text = README.read_text(encoding="utf-8")
    new = rendered(text)
    if "--check" in argv:
        if new != text:
            print("README.md's catalogue table is stale: run python tools/catalogue_table.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
