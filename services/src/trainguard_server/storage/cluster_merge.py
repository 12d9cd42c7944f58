"""Merging views of one stack-fingerprint cluster (``IncidentStore.merge_clusters``): several sources --
processors' partitions -- each count the same fingerprint, and the stored cluster is the merge of their
cumulative views. Pure, backend-neutral: what any store that keeps per-source views uses."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

from trainguard_engine.records import Cluster

_NO_TIME = 2 ** 63


def _view_order(c: Cluster) -> Tuple[int, int, str, str]:
    """Earliest first; ties broken by the whole record, so the order never depends on arrival."""
    return (c.first_ns or _NO_TIME, 0 if c.sample_event_id else 1, c.sample_event_id,
            json.dumps(c.to_dict(), sort_keys=True))


def _union(lists: Sequence[List[str]], most: int) -> List[str]:
    """The members of ``lists`` in order, each once, at most ``most`` of them (or as many as the longest
    list holds: one view comes back whole)."""
    most = max([most] + [len(items) for items in lists])
    out: List[str] = []
    seen = set()
    for items in lists:
        for item in items:
            if item not in seen:
                if len(out) >= most:
                    return out
                seen.add(item)
                out.append(item)
    return out


def merge_views(views: Sequence[Cluster], *, same_source: bool, max_members: int) -> Cluster:
    """The merge of cluster views of one (project, fingerprint): counts summed (views of different sources)
    or their maximum (views of one source: a later view already counts what an earlier one did); first
    seen the earliest, last seen the latest; runs, ranks and hosts united, earliest view's first, capped at
    ``max_members`` (or a view's own longer list); type, version, template and sample from the earliest
    view that has a sample (the earliest exception overall, as the pipeline picks it). The result does
    not depend on the order of ``views``; with ``same_source`` it is also idempotent (a view given again,
    or an older one, changes nothing). Across sources give one view per source (a store keeps them)."""
    if not views:
        raise ValueError("no cluster views to merge")
    ordered = sorted(views, key=_view_order)
    head = ordered[0]
    counts = [int(v.count) for v in ordered]
    firsts = [v.first_ns for v in ordered if v.first_ns]
    merged = Cluster.from_dict(head.to_dict())  # a copy
    merged.count = max(counts) if same_source else sum(counts)
    merged.first_ns = min(firsts) if firsts else 0
    merged.last_ns = max(v.last_ns for v in ordered)
    merged.runs = _union([v.runs for v in ordered], max_members)
    merged.ranks = _union([v.ranks for v in ordered], max_members)
    merged.hosts = _union([v.hosts for v in ordered], max_members)
    if not merged.message_template:
        merged.message_template = next((v.message_template for v in ordered if v.message_template), "")
    return merged


def join_source(views: Dict[str, Cluster], source: str, given: Sequence[Cluster],
                max_members: int) -> Optional[Tuple[Cluster, Cluster]]:
    """Join ``given`` (records of one cluster from ``source``) into ``views`` (the stored view of every
    source, changed in place): ``(source's new view, the merge of every view)`` to store, or None when
    ``given`` adds nothing to ``source``'s view (a replay: nothing to write)."""
    old = views.get(source)
    joined = merge_views(list(given) + ([old] if old is not None else []), same_source=True,
                         max_members=max_members)
    if old is not None and joined == old:
        return None
    views[source] = joined
    return joined, merge_views(list(views.values()), same_source=False, max_members=max_members)
