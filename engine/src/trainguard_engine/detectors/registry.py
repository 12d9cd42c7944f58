"""The one ordered list of detectors the pipeline walks (see :mod:`.base` for the interface).

Order matters: for each batch a detector sees what the ones before it decided -- a non-finite loss is
judged first (explosion / NaN source / plain), then the gradient detectors (which see that), then the
loss curve (which defers to all of them), then the independent families; for an exit, the stall it
ends (progress) before the exit's own verdict (process).
"""

from __future__ import annotations

from typing import Dict, Tuple

from ..catalogue import KINDS, SECTIONS
from .adapter import Adapters
from .base import Detector
from .gradient import Gradients
from .loss import LossCurve, NonFiniteLoss
from .memory import Memory
from .process import Process
from .progress import Progress
from .sequence import Sequences
from .straggler import Performance

DETECTORS: Tuple[Detector, ...] = (
    NonFiniteLoss(), Gradients(), LossCurve(), Memory(), Sequences(), Adapters(), Performance(), Progress(),
    Process(),
)

BY_NAME: Dict[str, Detector] = {d.name: d for d in DETECTORS}


def _check() -> None:
    """Names unique, kinds in the catalogue, sections known: at import, so a bad registration fails
    loudly before any event is processed."""
    if len(BY_NAME) != len(DETECTORS):
        raise AssertionError(f"detector names repeat: {[d.name for d in DETECTORS]}")
    for d in DETECTORS:
        unknown = [k for k in d.kinds if k not in KINDS]
        if not d.name or not d.kinds or unknown:
            raise AssertionError(f"{d!r}: needs a name and catalogue kinds (unknown: {unknown})")
        if d.independent and not d.names_only:
            raise AssertionError(f"{d!r}: an independent detector (the column hook) must be names_only")
        if d.section not in SECTIONS:
            raise AssertionError(f"{d!r}: section {d.section!r} is not one of {sorted(SECTIONS)}")


_check()
