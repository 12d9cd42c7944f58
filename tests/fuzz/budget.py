"""How much the fuzz suite tries: every fuzz test's example count is its default times
``TRAINGUARD_FUZZ_SCALE`` (environment, default 1). The defaults keep each file under a minute on the
2-core CI machine (the schemathesis run under three); a longer hunt on a workstation is e.g.
``TRAINGUARD_FUZZ_SCALE=20 pytest tests/fuzz``."""

from __future__ import annotations

import os

SCALE_ENV = "TRAINGUARD_FUZZ_SCALE"


def scale() -> float:
    """The multiplier from ``TRAINGUARD_FUZZ_SCALE`` (a positive number; 1 when unset)."""
    raw = os.environ.get(SCALE_ENV, "").strip()
    value = float(raw) if raw else 1.0
    if not value > 0:
        raise ValueError(f"{SCALE_ENV} must be a positive number, got {raw!r}")
    return value


def examples(default: int) -> int:
    """``default`` examples scaled by :func:`scale` (at least 1)."""
    return max(1, round(default * scale()))
