"""Rewrite the generated part of a document between two marker lines (what tools/catalogue_table.py and
tools/classifier_table.py share): ``main`` writes it, ``--check`` exits 1 when the file is stale."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, List


def between(text: str, begin: str, end: str, content: str, where: Path) -> str:
    """``text`` with what lies between ``begin`` and ``end`` (the markers kept) replaced by ``content``."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{where}: the markers of its generated part are missing")
    return text[:start] + begin + "\n" + content + "\n" + text[stop:]


def main(path: Path, render: Callable[[str], str], tool: str, argv: List[str]) -> int:
    """Write ``render(text)`` to ``path``; with ``--check`` only say whether it is stale (exit 1)."""
    text = path.read_text(encoding="utf-8")
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{path.name}'s generated part is stale: run python tools/{tool}", file=sys.stderr)
            return 1
        return 0
    path.write_text(new, encoding="utf-8")
    return 0
