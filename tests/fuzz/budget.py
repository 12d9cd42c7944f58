"""How much the fuzz suite tries, by a named profile and a multiplier (both from the environment).

``TRAINGUARD_FUZZ_PROFILE`` names the profile:

* ``ci`` (the default): the counts the suite runs with everywhere unless told otherwise, sized so the whole
  suite stays inside the 30-minute CI budget on the 2-core CI machine (stop 36: the schemathesis file at 15
  examples per operation and phase instead of 50, the HTTP decoder file at 150 / 100 instead of 400 / 300;
  before/after figures in bench/results/ci_time_stop36.txt; stop 37: the pipeline file at 100 per test instead
  of 300, the gRPC decoder file at 200 / 100 instead of 500 / 250, figures in ci_time_stop37.txt);
* ``full``: every test's full count (what the files ran with before stop 36 / 37) -- a deeper run before a
  release or after touching a decoder: ``TRAINGUARD_FUZZ_PROFILE=full pytest tests/fuzz``.

``TRAINGUARD_FUZZ_SCALE`` (a positive number, default 1) then multiplies the profile's count; a longer hunt on
a workstation is e.g. ``TRAINGUARD_FUZZ_PROFILE=full TRAINGUARD_FUZZ_SCALE=20 pytest tests/fuzz``.

A test that gives no ``ci`` count runs its full count under both profiles.
"""

from __future__ import annotations

import os
from typing import Optional

SCALE_ENV = "TRAINGUARD_FUZZ_SCALE"
PROFILE_ENV = "TRAINGUARD_FUZZ_PROFILE"
PROFILES = ("ci", "full")


def scale() -> float:
    """The multiplier from ``TRAINGUARD_FUZZ_SCALE`` (a positive number; 1 when unset)."""
    raw = os.environ.get(SCALE_ENV, "").strip()
    value = float(raw) if raw else 1.0
    if not value > 0:
        raise ValueError(f"{SCALE_ENV} must be a positive number, got {raw!r}")
    return value


def profile() -> str:
    """The profile named by ``TRAINGUARD_FUZZ_PROFILE``: ``ci`` (when unset) or ``full``."""
    name = os.environ.get(PROFILE_ENV, "").strip().lower() or "ci"
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV} must be one of {', '.join(PROFILES)}, got {name!r}")
    return name


def examples(full: int, ci: Optional[int] = None) -> int:
    """The example count of a test: ``full`` under the ``full`` profile, ``ci`` (``full`` when not given) under
    the ``ci`` profile, times :func:`scale` (at least 1)."""
    base = full if ci is None or profile() == "full" else ci
    return max(1, round(base * scale()))
