"""Test support: a log imported with ``trainguard replay``'s defaults into a temporary local data directory
(the same gateway, processor and pipeline as ``trainguard serve``), and the incidents it left, read as
bench/wild's judge reads them."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, List

from bench.wild import judge
from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"


def imported(path: Path, run_id: str = "local") -> List[Dict[str, Any]]:
    """The incidents of ``path`` imported as rank 0's log of run ``run_id``."""
    with tempfile.TemporaryDirectory(prefix="tg-local-import-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id=run_id, logs=[(0, path)]), backend).run()
            backend.finish()
            return backend.incidents(run_id)
        finally:
            backend.close()


def kind(incident: Any) -> str:
    return f"{incident['category']}/{incident['subtype']}"


def shown(incidents: List[Dict[str, Any]]) -> List[str]:
    """The kinds a user reads, top first (incidents no other explains: ``judge.ordered``)."""
    return [kind(i) for i in judge.ordered(incidents)]


def lines_of(case: str) -> List[str]:
    """A wild-corpus case's pasted lines."""
    return (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()


def pasted(tmp_path: Path, lines: List[str]) -> Path:
    """``lines`` written as a log file under ``tmp_path``."""
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
