"""Placeholder: the adapter detector family (issue 4). Replaced by its implementation."""

from __future__ import annotations

from typing import Any, List, Sequence

from ..catalogue import DetectionSettings
from ..incidents import Finding
from ..state import RankState, RunState


def on_metrics(run: RunState, rank: RankState, points: Sequence[Any], step: int, time_ns: int,
               event_id: str, settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank`` (``points``: (name, step, value) tuples)."""
    return []
