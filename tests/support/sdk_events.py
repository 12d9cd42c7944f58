"""What an in-process SDK (``endpoint="memory://"``) delivered, for the integration tests."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import trainguard

Series = List[Tuple[int, float]]


def events() -> List[Dict[str, Any]]:
    """Every envelope delivered so far by the current client (flushes first)."""
    assert trainguard.flush(5)
    client = trainguard.get_client()
    assert client is not None
    return list(client.worker._transport.events)  # type: ignore[attr-defined]


def series(evs: List[Dict[str, Any]], name: str) -> Series:
    """(envelope step, value) of every point named ``name``, in delivery order; ``"NaN"``/``"Infinity"``
    spellings read as floats."""
    out: Series = []
    for e in evs:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] == name:
                value = p["value"]
                out.append((e["step"], float(value) if not isinstance(value, str)
                            else float(value.replace("Infinity", "inf"))))
    return out
