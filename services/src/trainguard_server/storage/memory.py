"""In-memory reference implementations of the store contracts (``storage/base.py``), for tests and
demos; the helpers they share with the production stores are in :mod:`.common`.

The memory stores keep records as JSON text, exactly as the SQLite stores do, so both return equal
objects (NaN survives; tuples come back as lists) and a caller can never mutate stored state through a
returned object. Every public method takes one lock: the stores are safe to share between threads. Nothing
is durable and nothing is bounded: they are for tests and for ``--data-dir :memory:`` style demos.
"""

from __future__ import annotations

import bisect
import copy
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from trainguard_engine.records import Cluster, Incident, RunRecord

from .base import (
    Bucket,
    EventStore,
    IncidentStore,
    IncidentWorkflow,
    MetricPoint,
    MetricStore,
    MetricSummary,
    Page,
    ProjectStore,
    SearchHit,
    StoredEvent,
    TokenInfo,
)
from .common import (
    T,
    _bm25,
    _Doc,
    _event_from_json,
    _event_to_json,
    _page,
    _snippet,
    _term_hits,
    aggregate_bucket,
    bucket_width,
    check_limit,
    check_project_name,
    decode_cursor,
    encode_cursor,
    hash_secret,
    new_token,
    parse_operator_token,
    parse_search_query,
    parse_tag_filter,
    secret_matches,
    split_token,
    tokenize,
)


class MemoryEventStore(EventStore):
    """Raw context in dicts; search scans every event and ranks with the same BM25 as FTS5."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._by_key: Dict[Tuple[str, str], _Doc] = {}
        self._docs: List[_Doc] = []          # in insertion (seq) order
        self._total_tokens = 0

    def put(self, events: Sequence[StoredEvent]) -> int:
        with self._lock:
            new = 0
            for event in events:
                key = (event.project, event.event_id)
                if key in self._by_key:
                    continue
                doc = _Doc(seq=len(self._docs) + 1, project=event.project, run_id=event.run_id,
                           kind=event.kind, time_ns=event.time_ns, text=event.text,
                           blob=_event_to_json(event), tokens=tokenize(event.text))
                self._by_key[key] = doc
                self._docs.append(doc)
                self._total_tokens += len(doc.tokens)
                new += 1
            return new

    def get(self, project: str, event_id: str) -> Optional[StoredEvent]:
        with self._lock:
            doc = self._by_key.get((project, event_id))
            return _event_from_json(doc.blob) if doc else None

    def list_for_run(self, project: str, run_id: str, *, kinds: Optional[Sequence[str]] = None,
                     limit: int = 100, cursor: Optional[str] = None) -> Page[StoredEvent]:
        check_limit(limit)
        kind_set = sorted(set(kinds)) if kinds is not None else None
        scope = [project, run_id, kind_set]
        after = decode_cursor(cursor, "events", scope, (int, int)) if cursor else None
        with self._lock:
            docs = [d for d in self._docs if d.project == project and d.run_id == run_id
                    and (kind_set is None or d.kind in kind_set)]
        docs.sort(key=lambda d: (d.time_ns, d.seq))
        if after is not None:
            docs = [d for d in docs if (d.time_ns, d.seq) > (after[0], after[1])]
        page = _page(docs[:limit + 1], limit, lambda d: encode_cursor("events", scope, [d.time_ns, d.seq]))
        return Page(items=[_event_from_json(d.blob) for d in page.items], next_cursor=page.next_cursor)

    def search(self, project: str, query: str, *, run_id: Optional[str] = None, limit: int = 50,
               cursor: Optional[str] = None) -> Page[SearchHit]:
        terms = parse_search_query(query)
        check_limit(limit)
        scope = [project, query, run_id]
        after = decode_cursor(cursor, "search", scope, (int, float, int)) if cursor else None
        with self._lock:
            snapshot = int(after[0]) if after else len(self._docs)
            docs = self._docs[:snapshot]
            n_docs = len(self._docs)
            avgdl = self._total_tokens / n_docs if n_docs else 0.0
            matches = [(d, [_term_hits(d.tokens, t) for t in terms]) for d in self._docs]
        # document frequencies over the whole store, as FTS5 computes them
        doc_freq = [sum(1 for _, hits in matches if hits[i]) for i in range(len(terms))]
        scored: List[Tuple[float, _Doc, List[List[int]]]] = []
        for doc, hits in matches[:len(docs)]:
            if doc.project != project or (run_id is not None and doc.run_id != run_id):
                continue
            if not all(hits):
                continue
            score = _bm25(hits, doc_freq, n_docs, len(doc.tokens), avgdl, [len(t.tokens) for t in terms])
            scored.append((score, doc, hits))
        scored.sort(key=lambda item: (-item[0], item[1].seq))
        if after is not None:
            last_score, last_seq = after[1], after[2]
            scored = [s for s in scored if s[0] < last_score or (s[0] == last_score and s[1].seq > last_seq)]
        page = _page(scored[:limit + 1], limit,
                     lambda s: encode_cursor("search", scope, [snapshot, s[0], s[1].seq]))
        hits_out = [SearchHit(event=_event_from_json(doc.blob), snippet=_snippet(doc, hits, terms),
                              score=score) for score, doc, hits in page.items]
        return Page(items=hits_out, next_cursor=page.next_cursor)


class MemoryMetricStore(MetricStore):
    """Points in a dict per (project, run, name, rank) series; series() buckets in Python."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._series: Dict[Tuple[str, str, str, int], Dict[int, Tuple[int, float]]] = {}

    def put(self, points: Sequence[MetricPoint]) -> None:
        with self._lock:
            for p in points:
                key = (p.project, p.run_id, p.name, int(p.rank))
                self._series.setdefault(key, {})[int(p.step)] = (int(p.time_ns), float(p.value))

    def names(self, project: str, run_id: str) -> List[str]:
        with self._lock:
            return sorted({k[2] for k in self._series if k[0] == project and k[1] == run_id})

    def series(self, project: str, run_id: str, names: Sequence[str], *, rank: Optional[int] = None,
               start_step: Optional[int] = None, end_step: Optional[int] = None,
               max_points: int = 1000) -> Dict[str, Dict[int, List[Bucket]]]:
        bucket_width(0, 0, max_points)  # validates max_points
        out: Dict[str, Dict[int, List[Bucket]]] = {}
        for name in dict.fromkeys(names):
            with self._lock:
                chosen = {k[3]: sorted(v.items()) for k, v in self._series.items()
                          if k[0] == project and k[1] == run_id and k[2] == name
                          and (rank is None or k[3] == rank)}
            out[name] = _bucket_series(chosen, start_step, end_step, max_points)
        return out

    def summary(self, project: str, run_id: str) -> List[MetricSummary]:
        with self._lock:
            by_name: Dict[str, List[Tuple[int, int, float]]] = {}
            for (proj, run, name, rank), pts in self._series.items():
                if proj == project and run == run_id:
                    by_name.setdefault(name, []).extend((step, rank, v) for step, (_, v) in pts.items())
        out = []
        for name in sorted(by_name):
            rows = sorted(by_name[name], key=lambda r: (r[0], -r[1]))  # last = highest step, lowest rank
            agg = aggregate_bucket(rows[0][0], rows[-1][0], ((s, v) for s, _, v in rows))
            out.append(MetricSummary(name=name, count=agg.count, first_step=rows[0][0], last_step=rows[-1][0],
                                     min=agg.min, max=agg.max, last=agg.last, nonfinite=agg.nonfinite))
        return out


def _bucket_series(by_rank: Dict[int, List[Tuple[int, Tuple[int, float]]]], start_step: Optional[int],
                   end_step: Optional[int], max_points: int) -> Dict[int, List[Bucket]]:
    """Equal-width buckets over one range shared by every rank (so ranks line up on a chart)."""
    if not by_rank:
        return {}
    lo = start_step if start_step is not None else min(pts[0][0] for pts in by_rank.values())
    hi = end_step if end_step is not None else max(pts[-1][0] for pts in by_rank.values())
    if lo > hi:
        return {}
    width = bucket_width(lo, hi, max_points)
    out: Dict[int, List[Bucket]] = {}
    for rank in sorted(by_rank):
        pts = by_rank[rank]
        steps = [s for s, _ in pts]
        i, j = bisect.bisect_left(steps, lo), bisect.bisect_right(steps, hi)
        buckets: List[Bucket] = []
        k = i
        while k < j:
            index = (steps[k] - lo) // width
            b_end = lo + (index + 1) * width
            m = bisect.bisect_left(steps, b_end, k, j)
            buckets.append(aggregate_bucket(lo + index * width, min(b_end - 1, hi),
                                            ((s, v) for s, (_, v) in pts[k:m])))
            k = m
        if buckets:
            out[rank] = buckets
    return out


@dataclass
class _Row:
    """A stored record: the JSON document plus the fields listings filter and order on."""

    project: str
    key: str            # run_id / incident_id / fingerprint
    order_ns: int       # last_event_ns / first_ns / last_ns
    doc: str
    status: str = ""
    run_id: str = ""
    tags: Optional[Dict[str, str]] = None


class MemoryIncidentStore(IncidentStore):
    """Runs, incidents, clusters and state blobs in dicts, listed with the same keyset cursors as SQLite."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._runs: Dict[Tuple[str, str], _Row] = {}
        self._incidents: Dict[Tuple[str, str], _Row] = {}
        self._clusters: Dict[Tuple[str, str], _Row] = {}
        self._workflow: Dict[Tuple[str, str], str] = {}
        self._state: Dict[str, bytes] = {}

    # runs
    def upsert_runs(self, runs: Sequence[RunRecord]) -> None:
        rows = [_Row(project=r.project, key=r.run_id, order_ns=int(r.last_event_ns),
                     doc=json.dumps(r.to_dict()), status=r.status, run_id=r.run_id,
                     tags={str(k): str(v) for k, v in r.tags.items()}) for r in runs]
        with self._lock:
            for row in rows:
                self._runs[(row.project, row.key)] = row

    def get_run(self, project: str, run_id: str) -> Optional[RunRecord]:
        with self._lock:
            row = self._runs.get((project, run_id))
        return RunRecord.from_dict(json.loads(row.doc)) if row else None

    def list_runs(self, project: str, *, status: Optional[str] = None, tag: Optional[str] = None,
                  limit: int = 50, cursor: Optional[str] = None) -> Page[RunRecord]:
        tag_key, tag_value = parse_tag_filter(tag) if tag is not None else (None, None)

        def keep(row: _Row) -> bool:
            if status is not None and row.status != status:
                return False
            if tag_key is not None:
                tags = row.tags or {}
                return tag_key in tags and (tag_value is None or tags[tag_key] == tag_value)
            return True

        return self._list(self._runs, "runs", [project, status, tag], project, keep, limit, cursor,
                          RunRecord.from_dict)

    # incidents
    def upsert_incidents(self, incidents: Sequence[Incident]) -> None:
        rows = [_Row(project=i.project, key=i.incident_id, order_ns=int(i.first_ns),
                     doc=json.dumps(i.to_dict()), status=i.status, run_id=i.run_id) for i in incidents]
        with self._lock:
            for row in rows:
                self._incidents[(row.project, row.key)] = row

    def get_incident(self, project: str, incident_id: str) -> Optional[Incident]:
        with self._lock:
            row = self._incidents.get((project, incident_id))
        return Incident.from_dict(json.loads(row.doc)) if row else None

    def list_incidents(self, project: str, *, run_id: Optional[str] = None, status: Optional[str] = None,
                       limit: int = 50, cursor: Optional[str] = None) -> Page[Incident]:
        def keep(row: _Row) -> bool:
            return (run_id is None or row.run_id == run_id) and (status is None or row.status == status)

        return self._list(self._incidents, "incidents", [project, run_id, status], project, keep, limit,
                          cursor, Incident.from_dict)

    # clusters
    def upsert_clusters(self, clusters: Sequence[Cluster]) -> None:
        rows = [_Row(project=c.project, key=c.fingerprint, order_ns=int(c.last_ns),
                     doc=json.dumps(c.to_dict())) for c in clusters]
        with self._lock:
            for row in rows:
                self._clusters[(row.project, row.key)] = row

    def get_cluster(self, project: str, fingerprint: str) -> Optional[Cluster]:
        with self._lock:
            row = self._clusters.get((project, fingerprint))
        return Cluster.from_dict(json.loads(row.doc)) if row else None

    def list_clusters(self, project: str, *, limit: int = 50,
                      cursor: Optional[str] = None) -> Page[Cluster]:
        return self._list(self._clusters, "clusters", [project], project, lambda row: True, limit, cursor,
                          Cluster.from_dict)

    # state
    # workflow
    def get_workflow(self, project: str, incident_id: str) -> Optional[IncidentWorkflow]:
        with self._lock:
            doc = self._workflow.get((project, incident_id))
        return IncidentWorkflow.from_dict(json.loads(doc)) if doc else None

    def get_workflows(self, project: str, incident_ids: Sequence[str]) -> Dict[str, IncidentWorkflow]:
        with self._lock:
            docs = {i: self._workflow.get((project, i)) for i in incident_ids}
        return {i: IncidentWorkflow.from_dict(json.loads(doc)) for i, doc in docs.items() if doc}

    def save_workflow(self, workflow: IncidentWorkflow) -> None:
        with self._lock:
            self._workflow[(workflow.project, workflow.incident_id)] = json.dumps(workflow.to_dict())

    def resolved_like(self, project: str, category: str, subtype: str, *,
                      limit: int = 20) -> List[IncidentWorkflow]:
        with self._lock:
            docs = [IncidentWorkflow.from_dict(json.loads(d)) for (p, _i), d in self._workflow.items()
                    if p == project]
        found = [w for w in docs if w.category == category and w.subtype == subtype and w.resolved_ns > 0
                 and w.root_cause]
        found.sort(key=lambda w: (-w.resolved_ns, w.incident_id))
        return found[:limit]

    def save_states(self, items: Mapping[str, Optional[bytes]]) -> None:
        staged = {str(k): (None if v is None else bytes(v)) for k, v in items.items()}  # raises first
        with self._lock:
            for key, value in staged.items():
                if value is None:
                    self._state.pop(key, None)
                else:
                    self._state[key] = value

    def load_state(self, key: str) -> Optional[bytes]:
        with self._lock:
            return self._state.get(key)

    def state_keys(self, prefix: str) -> List[str]:
        with self._lock:
            return sorted(k for k in self._state if k.startswith(prefix))

    def _list(self, table: Dict[Tuple[str, str], _Row], kind: str, scope: List[Any], project: str,
              keep: Callable[[_Row], bool], limit: int, cursor: Optional[str],
              load: Callable[[Dict[str, Any]], T]) -> Page[T]:
        """Newest first by ``order_ns``, ties by key ascending; keyset cursor ``(order_ns, key)``."""
        check_limit(limit)
        after = decode_cursor(cursor, kind, scope, (int, str)) if cursor else None
        with self._lock:
            rows = [r for r in table.values() if r.project == project and keep(r)]
        rows.sort(key=lambda r: (-r.order_ns, r.key))
        if after is not None:
            rows = [r for r in rows if r.order_ns < after[0] or (r.order_ns == after[0] and r.key > after[1])]
        page = _page(rows[:limit + 1], limit, lambda r: encode_cursor(kind, scope, [r.order_ns, r.key]))
        return Page(items=[load(json.loads(r.doc)) for r in page.items], next_cursor=page.next_cursor)


@dataclass
class _Token:
    info: TokenInfo
    secret_sha256: str


class MemoryProjectStore(ProjectStore):
    """Projects and hashed tokens in dicts."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._projects: Dict[str, int] = {}
        self._tokens: Dict[str, _Token] = {}

    def create_token(self, project: str, kind: str, description: str = "", expires_ns: int = 0) -> str:
        check_project_name(project)
        text, token_id, secret = new_token(kind)
        self._add(project, kind, token_id, secret, description, expires_ns)
        return text

    def add_token(self, project: str, kind: str, token: str, description: str = "") -> TokenInfo:
        """Register operator-chosen token text (a bootstrap token from settings): see
        :func:`parse_operator_token` for what is accepted; ValueError if its id already exists."""
        check_project_name(project)
        token_id, secret = parse_operator_token(kind, token)
        with self._lock:
            if token_id in self._tokens:
                raise ValueError(f"token {token_id} already exists")
            return self._add(project, kind, token_id, secret, description)

    def _add(self, project: str, kind: str, token_id: str, secret: str, description: str,
             expires_ns: int = 0) -> TokenInfo:
        now = time.time_ns()
        info = TokenInfo(token_id=token_id, project=project, kind=kind, created_ns=now,
                         description=description, expires_ns=int(expires_ns))
        with self._lock:
            self._projects.setdefault(project, now)
            self._tokens[token_id] = _Token(info=info, secret_sha256=hash_secret(secret))
        return copy.copy(info)

    def lookup(self, token: str) -> Optional[TokenInfo]:
        parts = split_token(token)
        if parts is None:
            return None
        kind, token_id, secret = parts
        with self._lock:
            stored = self._tokens.get(token_id)
        if stored is None or not secret_matches(secret, stored.secret_sha256) or stored.info.kind != kind:
            return None
        return copy.copy(stored.info)

    def list_tokens(self, project: Optional[str] = None) -> List[TokenInfo]:
        with self._lock:
            infos = [copy.copy(t.info) for t in self._tokens.values()
                     if project is None or t.info.project == project]
        return sorted(infos, key=lambda i: (i.created_ns, i.token_id))

    def revoke(self, token_id: str) -> bool:
        """True when the token exists (it is revoked afterwards, idempotently); False when unknown."""
        with self._lock:
            stored = self._tokens.get(token_id)
            if stored is None:
                return False
            stored.info.revoked = True
            return True

