"""Gradient norms of sharded training, combined over the ranks of a step (issue 21).

Under FSDP2, DeepSpeed ZeRO or tensor parallelism each rank holds a share of every gradient, and reading
the full gradients' norm would take a collective in the training step. The SDK instead reports each rank's
**sum of squares of its share** -- ``grad/shard_sumsq`` for the whole model and
``grad/shard_sumsq/layer/<layer>`` per layer -- where a replica that another rank already counts
contributes 0 (``trainguard.integrations.torch._shares``). The full gradient's squared norm is the sum of
the shares' squared norms, exactly (a partition of its elements), so once every rank of the run reported
a step the engine adds them up and the step's ``grad/global_norm`` / ``grad/layer/<layer>`` is the square
root: the same value, to floating-point rounding, as the norm of the unsharded gradients.

The shares wait in each reporting rank's detector state (``detectors["shards"]``: name -> step -> value,
at most :data:`KEEP_STEPS` steps per name, snapshotted with the rank); a step is combined once, when its
last share arrives, and its shares are then dropped. Pure.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .extract import MetricTuple
from .state import RunState

SHARD_GLOBAL = "grad/shard_sumsq"
SHARD_LAYER = "grad/shard_sumsq/layer/"
STATE_KEY = "shards"
KEEP_STEPS = 64
"""Steps a rank's shares wait for the other ranks' at most (per name): older ones are dropped."""


def is_share(name: str) -> bool:
    return name == SHARD_GLOBAL or name.startswith(SHARD_LAYER)


def _combined_name(name: str) -> str:
    return "grad/global_norm" if name == SHARD_GLOBAL else "grad/layer/" + name[len(SHARD_LAYER):]


def fold(run: RunState, rank: int, points: Sequence[MetricTuple]) -> List[MetricTuple]:
    """Keep ``rank``'s shares among ``points``; the combined norms of every (name, step) now complete --
    each rank ``0 .. world_size - 1`` has reported its share -- as ``(name, step, norm)``."""
    state = run.ranks[rank].detectors.setdefault(STATE_KEY, {})
    out: List[MetricTuple] = []
    for name, step, value in points:
        if not is_share(name) or value - value != 0.0:
            continue
        waiting: Dict[str, float] = state.setdefault(name, {})
        waiting[str(step)] = float(value)
        if len(waiting) > KEEP_STEPS:
            for old in sorted(waiting, key=int)[:len(waiting) - KEEP_STEPS]:
                del waiting[old]
        shares = _complete(run, name, str(step))
        if shares is None:
            continue
        for r, _v in shares:
            del run.ranks[r].detectors[STATE_KEY][name][str(step)]
        out.append((_combined_name(name), step, math.sqrt(max(0.0, sum(v for _r, v in shares)))))
    return out


def _complete(run: RunState, name: str, step: str) -> Optional[List[Tuple[int, float]]]:
    """Every rank's share of (``name``, ``step``) when all ranks of the run have reported it."""
    shares: List[Tuple[int, float]] = []
    for r in range(max(1, run.world_size)):
        rank = run.ranks.get(r)
        if rank is None:
            return None
        value = rank.detectors.get(STATE_KEY, {}).get(name, {}).get(step)
        if value is None:
            return None
        shares.append((r, value))
    return shares
