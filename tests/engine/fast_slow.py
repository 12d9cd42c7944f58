"""The harness of the engine's exactness tests for speed-only changes: a pipeline on the fast path and one on
the slow (reference) path over the same events in pieces, both restored from the fast one's snapshot every few
pieces (whatever the fast path keeps outside the snapshot starts empty there). Piece by piece the outputs and the
snapshots must be equal, and at the end the incidents."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Sequence

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline


def run_fast_and_slow(events: Sequence[Dict[str, Any]], settings: DetectionSettings, fast: ContextManager[object],
                      slow: Callable[[], ContextManager[object]], piece: int = 37, restore_every: int = 3) -> None:
    """``fast`` is entered around each piece of the fast pipeline (an oracle or a counter: re-entered each
    time), ``slow()`` makes the context that puts the reference path in place around the slow one's piece."""
    fast_pipe, slow_pipe = Pipeline(settings), Pipeline(settings)
    for k, lo in enumerate(range(0, len(events), piece)):
        part = list(events[lo:lo + piece])
        with fast:
            out_fast = fast_pipe.process(part)
        with slow():
            out_slow = slow_pipe.process(part)
        assert out_fast == out_slow, lo
        blob = fast_pipe.snapshot()
        assert blob == slow_pipe.snapshot(), lo
        if k % restore_every == restore_every - 1:
            fast_pipe = Pipeline.restore(blob, settings)
            slow_pipe = Pipeline.restore(blob, settings)
    assert fast_pipe.incidents() == slow_pipe.incidents()
