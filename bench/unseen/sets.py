#!/usr/bin/env python3
"""The sets of unseen training shapes, what each shape is expected to give, and how a set is scored.

Each set is a module with ``SHAPES`` (name -> (expected, what it is)) and ``run(name)`` (the training,
``trainguard.init`` already called); its expectations are decided from what was done to the run, not from
the detector's answer. Importing this module (or a set's ``SHAPES``) does not import torch.

``expected``: ``healthy``, ``-`` (unmanifested: listed, not scored) or incident kinds separated by ``|``
(any one among the run's incidents, open or resolved, is right).
"""

from __future__ import annotations

import importlib
from typing import Dict, Tuple

HEALTHY = "healthy"
UNMANIFESTED = "-"
"""Expected for a shape whose planted cause does not show in what the SDK reports: listed, not scored."""
LR_TOO_HIGH = "loss/divergence|loss/oscillation|gradient/explosion"
"""The kinds an LR too high may show as (any one found is right): the catalogue's 'LR too high' family."""

Expectations = Dict[str, Tuple[str, str]]

SETS: Dict[str, Tuple[str, bool]] = {
    # set: (its module, scored with the trace rules of probe.py)
    "stop34": ("bench.unseen.shapes", False),  # stop 34's shapes + stop 35's two tuning variants (tuned on)
    "heldout35": ("bench.unseen.heldout", True),  # stop 35's held-out set: run once, SPENT
    "tuning36": ("bench.unseen.tuning2", True),  # stop 36's tuning set
    "heldout36": ("bench.unseen.heldout2", True),  # stop 36's held-out set: run once, SPENT
    "heldout37": ("bench.unseen.heldout3", True),  # stop 37's held-out set: run once, SPENT
    "tuning38": ("bench.unseen.tuning3", True),  # stop 38's tuning set
    "heldout38": ("bench.unseen.heldout4", True),  # stop 38's held-out set: judged ONCE, SPENT
    "tuning39": ("bench.unseen.tuning4", True),  # stop 39's tuning set
    "heldout39": ("bench.unseen.heldout5", True),  # stop 39's held-out set: judged once per engine, SPENT
    "heldout40": ("bench.unseen.heldout6", True),  # stop 40's held-out set: judged once per engine, SPENT
    "tuning41": ("bench.unseen.tuning5", True),  # stop 41's tuning set
    "heldout41": ("bench.unseen.heldout7", True),  # stop 41's held-out set: judged once per engine, SPENT
    "tuning42": ("bench.unseen.tuning6", True),  # stop 42's tuning set
    "heldout42": ("bench.unseen.heldout8", True),  # stop 42's held-out set: judged once per engine, SPENT
    "tuning43": ("bench.unseen.tuning7", True),  # stop 43's tuning set
    "heldout43": ("bench.unseen.heldout9", True),  # stop 43's held-out set: judged once per engine, SPENT
    "tuning44": ("bench.unseen.tuning8", True),  # stop 44's tuning set
    "heldout44": ("bench.unseen.heldout10", True),  # stop 44's held-out set: judged once per engine, SPENT
    "heldout45": ("bench.unseen.heldout11", True),  # stop 45's held-out set: judged once per setting, SPENT
    "heldout47": ("bench.unseen.heldout12", True),  # stop 47's held-out set: judged once (default), SPENT
    "heldout49": ("bench.unseen.heldout13", True),  # stop 49's held-out set: judged once (MANIFEST), SPENT
    "heldout50": ("bench.unseen.heldout14", True),  # stop 50's held-out set: judged once (MANIFEST), SPENT
}

JUMP_RULE = frozenset({"tuning44", "heldout44", "heldout45", "heldout47", "heldout49", "heldout50"})
"""Sets (stop 44, decided before either ran; heldout47 added with its file, before it ran) whose failing
shapes also count as manifested on a one-step jump (heldout49 and heldout50 too, each added with its file,
before it ran; their own per-fault checks, heldout13.MANIFEST and heldout14.MANIFEST, are their primary
scoring): a loss value >= ``JUMP_FACTOR`` x the median of the ``JUMP_POINTS`` values before it. One bad
batch on a run that learned far below its start lands under 2x the initial level (probe.py's rule) and was
never scored."""
JUMP_FACTOR = 10.0
JUMP_POINTS = 20

VANISH_STALL = frozenset({"heldout45"})
"""Sets (stop 45, decided with heldout45 before it ran) in which ``gradient/vanishing`` also counts as a
stalling kind (probe.STALL_KINDS): a dead-ReLU net never rises 2x its start, so it is scored when its loss
did not learn."""


def shapes(set_name: str) -> Expectations:
    """The ``SHAPES`` of one set."""
    return importlib.import_module(SETS[set_name][0]).SHAPES  # type: ignore[no-any-return]


def set_of(name: str) -> str:
    """The set a shape belongs to (``KeyError`` when none)."""
    for set_name in SETS:
        if name in shapes(set_name):
            return set_name
    raise KeyError(name)


def trace_rules(set_name: str) -> bool:
    """Whether ``set_name`` is scored with the trace rules (manifested / learned) of probe.py."""
    return SETS[set_name][1]
