"""Named baselines, kept as small JSON documents in the incident store's key-value state (I/O).

``IncidentStore.save_state/load_state`` is the same small key -> bytes table the processor's snapshot and
the webhook notifier already use; every store implementation passes its contract (tests/services/storage),
and it lives with incidents, runs and tokens in SQLite under the data directory that the gateway,
processor and API processes share, so a baseline defined through the API is visible to
``trainguard gate --data-dir`` and the other way round.

Keys: ``gate.baseline/<project>/<name>``, one document per baseline; listings read the keys under the
project's prefix (no separate index to keep in step). A baseline is a frozen list of runs (resolved from a
tag when it was defined, so later runs carrying the tag -- the candidates -- do not join it) plus the
profile built from them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from ..storage.base import IncidentStore
from .profile import Profile

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """``name`` when it is a valid baseline name (letters, digits, ``._-``, up to 128), else ValueError."""
    if not NAME_RE.fullmatch(name or ""):
        raise ValueError(f"a baseline name is 1-128 letters, digits, '.', '_' or '-' (starting with a letter "
                         f"or digit), got {name!r}")
    return name


@dataclass
class Baseline:
    project: str
    name: str
    runs: List[str]                    # as resolved when defined
    tag: str = ""                      # the tag it was resolved from ("" for an explicit list)
    description: str = ""
    created_ns: int = 0
    updated_ns: int = 0
    profile: Dict[str, Any] = field(default_factory=dict)  # Profile.to_dict()

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Baseline:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def get_profile(self) -> Profile:
        return Profile.from_dict(self.profile)


class BaselineRepo:
    """Baselines of every project in one incident store."""

    def __init__(self, state: IncidentStore) -> None:
        self.state = state

    @staticmethod
    def _key(project: str, name: str) -> str:
        return f"gate.baseline/{project}/{name}"

    def get(self, project: str, name: str) -> Optional[Baseline]:
        """``project``'s baseline ``name``; None when there is none or ``name`` is not a baseline name. A name
        with a '/' must not be looked up: project ``a``'s ``b/y`` is the key of project ``a/b``'s ``y``
        (stop 44: ``POST /api/v1/gate`` with ``"baseline": "b/y"`` resolved the other tenant's baseline and
        went on to gate the candidate against it)."""
        if not NAME_RE.fullmatch(name or ""):
            return None
        blob = self.state.load_state(self._key(project, name))
        return Baseline.from_dict(json.loads(blob)) if blob else None

    def names(self, project: str) -> List[str]:
        prefix = self._key(project, "")
        # a name never holds '/': a longer one belongs to a project whose name extends this one ("a/b")
        return [key[len(prefix):] for key in self.state.state_keys(prefix) if "/" not in key[len(prefix):]]

    def delete(self, project: str, name: str) -> bool:
        """Remove ``name``; False when the project has no such baseline (or ``name`` is not a baseline name:
        see :meth:`get`)."""
        if self.get(project, name) is None:
            return False
        key = self._key(project, name)
        self.state.save_states({key: None})  # a None value deletes its key
        return True

    def save(self, baseline: Baseline) -> None:
        """One key per baseline, so saves from any number of API processes never lose one another."""
        check_name(baseline.name)
        self.state.save_state(self._key(baseline.project, baseline.name),
                              json.dumps(baseline.to_dict(), allow_nan=False).encode())
