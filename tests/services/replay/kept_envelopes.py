"""Test support: the envelopes ``trainguard replay`` sends for a log, and the incidents the engine's pipeline
shows for them under given settings (a correlate rule's window checked on a real import)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_server.replay import Importer, ReplayOptions
from trainguard_server.replay.backends import DryRunBackend

Event = Dict[str, Any]


class KeptBackend(DryRunBackend):
    """A dry-run backend that keeps a copy of every envelope it is sent."""

    def __init__(self) -> None:
        self.events: List[Event] = []

    def send(self, events: Sequence[Event], timeout: float) -> Any:
        self.events.extend(copy.deepcopy(list(events)))
        return super().send(events, timeout)


def envelopes(log: Path, run_id: str = "kept") -> List[Event]:
    """The envelopes ``trainguard replay``'s defaults build for ``log`` (as rank 0's file)."""
    backend = KeptBackend()
    Importer(ReplayOptions(run_id=run_id, logs=[(0, log)]), backend).run()
    return backend.events


def shown(events: Sequence[Event], settings: DetectionSettings) -> List[Tuple[str, str]]:
    """The kinds of the incidents no other one explains, earliest first, once the pipeline has seen
    ``events`` and a minute past the last."""
    pipeline = Pipeline(settings)
    pipeline.process(list(events))
    pipeline.advance(max(int(e["time_unix_nano"]) for e in events) + 60 * 10**9)
    return [(i.category, i.subtype) for i in sorted(pipeline.incidents(), key=lambda i: i.first_ns)
            if not i.explained_by]
