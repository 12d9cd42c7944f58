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
sys.path[:0] = [str(REPO / "sdk" / "src"), str(REPO / "engine" / "src"), str(REPO / "tools")]

from generated import between, main  # noqa: E402

from trainguard_engine.catalogue import README_BEGIN, README_END, readme_table  # noqa: E402

README = REPO / "README.md"


def rendered(text: str) -> str:
    """``text`` with the table between the markers replaced by the generated one."""
    return between(text, README_BEGIN, README_END, readme_table(), README)


if __name__ == "__main__":
    sys.exit(main(README, rendered, "catalogue_table.py", sys.argv[1:]))
