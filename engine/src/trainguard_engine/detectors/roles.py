"""What a point name is to a detector (its *role*), decided once per settings object and name: a detector
that reads a batch by its points' names (the gradient family's :func:`~.numeric.read_batch`, the perf
detectors' :func:`~.straggler.on_metrics`) looks each name up in :meth:`RoleMemo.of` and decides only a name
it has not seen (:func:`remember`), instead of testing every point against its name sets on every batch.
Derived from the code and the settings (never from the state): not snapshotted."""

from __future__ import annotations

from typing import Any, Dict, Tuple

ROLES_MAX = 4096
"""Most names remembered per settings object (then that object's roles start afresh)."""
SETTINGS_MAX = 64
"""Most settings objects remembered (then all start afresh)."""


class RoleMemo:
    """``name -> role`` per settings object, keyed by ``id(settings)`` and holding the object (its id cannot
    be reused by another while held), so that projects with their own settings, alternating, each keep
    theirs. An entry is a ``(settings, roles)`` pair replaced whole: a thread never reads one settings
    object's roles under another's. ``last`` is the entry asked for last: a caller tests it first, inline
    (``last = memo.last; roles = last[1] if last[0] is settings else memo.of(settings)``: no call on the
    usual batch, one pipeline's settings)."""

    def __init__(self) -> None:
        self.held: Dict[int, Tuple[Any, Dict[str, int]]] = {}
        self.last: Tuple[Any, Dict[str, int]] = (None, {})

    def of(self, settings: Any) -> Dict[str, int]:
        """The roles remembered under ``settings`` (a new, empty dict the first time)."""
        held = self.held.get(id(settings))
        if held is None or held[0] is not settings:
            if len(self.held) >= SETTINGS_MAX:
                self.held.clear()
            held = self.held[id(settings)] = (settings, {})
        self.last = held
        return held[1]


def remember(roles: Dict[str, int], name: str, role: int) -> int:
    """``role``, remembered as ``name``'s in ``roles`` (from :meth:`RoleMemo.of`; at ROLES_MAX names it
    starts afresh)."""
    if len(roles) >= ROLES_MAX:
        roles.clear()
    roles[name] = role
    return role
