"""Detectors: pure code from (run state, one observation, settings) to findings.

Each module owns one family of the catalogue and returns :class:`~trainguard_engine.incidents.Finding`
objects (or resolves incidents whose condition cleared). The metric and memory detectors implement one
interface (:mod:`.base`) and are walked in the order of :mod:`.registry`: :mod:`.loss` (a non-finite loss,
told apart from a gradient explosion, and the loss curve), :mod:`.gradient`, :mod:`.memory`,
:mod:`.sequence`, :mod:`.adapter`. Exceptions, log lines and exits (:mod:`.process`) and heartbeats,
stalls and lost runs (:mod:`.progress`) are the pipeline's event and timer entry points. The helpers below
format numbers and evidence windows the same way everywhere.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from trainguard.core.events import wire_float

from .. import _native

_native.detectors_path(__path__)  # the compiled detectors first, when the engine's build is used (first:
# before any import below could reach a detector module)

from ..state import RankState  # noqa: E402


def fmt_number(value: float) -> str:
    """``NaN``, ``Infinity``, or 4 significant digits (``0.4503``, ``2.067e+06``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return f"{value:.4g}"


def finite_or_none(value: Optional[float]) -> Optional[float]:
    """``value`` when it is a finite number, else None (a record never holds a bare NaN/Inf: a ratio to a
    base near the smallest float overflows to inf)."""
    return value if value is not None and math.isfinite(value) else None


def fmt_duration(seconds: float) -> str:
    """``"2.5 s"``, ``"5 min 3 s"``, ``"2 h 5 min"``."""
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def window(rank: RankState, name: str, upto_step: int, most: int) -> List[Dict[str, Any]]:
    """The last ``most`` values of ``name`` at steps <= ``upto_step``, as evidence ``[{"step", "value"}]``
    with non-finite values in the JSON mapping's spelling."""
    points = rank.series(name, -(2**63), upto_step)[-most:]
    return [{"step": s, "value": wire_float(v)} for s, v, _t in points]


def first_line(text: str, most: int = 160) -> str:
    """The first non-empty line of ``text``, cut at ``most`` characters."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= most else line[: most - 3] + "..."
    return ""
