"""Strict JSON objects for every body the server decodes (ingest and the query API): a key given twice is
refused. ``json.loads`` keeps the last one silently, so a body could mean one thing to a proxy and another
here; proto3 JSON parsers refuse it too."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple


class DuplicateKey(ValueError):
    """A JSON object names one key twice; the message names it."""


def unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """``object_pairs_hook``: an object's members as a dict, :class:`DuplicateKey` for a key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(f"duplicate key {json.dumps(key)} in one object (each field may be given "
                                   f"once)")
            seen.add(key)
    return out
