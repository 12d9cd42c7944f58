"""EventStore on Elasticsearch 8.x (the official ``elasticsearch`` client, ``pip install
'trainguard-server[elasticsearch]'``). It passes the same contract as the memory and SQLite stores
(tests/services/storage/test_event_store_contract.py).

**Indices.** One index per UTC day of the event's time: ``<prefix>-events-YYYY.MM.DD``. An index template
``<prefix>-events`` (pattern ``<prefix>-events-*``, created or updated at the first write) gives every
such index its settings and an explicit, ``strict`` mapping:

- keyword: ``uid`` (the document ``_id``), ``event_id``, ``project``, ``run_id``, ``host``, ``kind``,
  ``severity``, ``fingerprint`` (an exception's ``fp:v1`` digest); integer ``rank``; long ``step``,
  ``time_ns``, ``stored_us``; date ``@timestamp`` (the event time in ms, for Kibana and time ranges);
- ``text``: what full-text search reads (type, message, traceback, log line), analysed by ``tg_text``:
  a pattern tokenizer splitting on everything but letters and digits (``torch.OutOfMemoryError`` →
  ``torch``, ``outofmemoryerror``; underscores separate too) + ``lowercase`` + ``asciifolding`` — the
  tokens SQLite's FTS5 ``unicode61 remove_diacritics 2`` and the memory store produce, so the three
  implementations find the same events — + ``truncate`` at 1024 characters (Lucene refuses a whole
  document over one term of more than 32766 bytes, e.g. a base64 blob in a log line);
- ``payload``: the envelope as JSON text, kept in ``_source`` only (not indexed, no doc values). JSON
  text rather than an object because envelopes carry NaN/±Inf, which JSON documents cannot.

Retention is dropping whole indices: :meth:`ElasticsearchEventStore.drop_expired_indices` deletes the days
older than ``retention_days`` (also run from :meth:`put` at most once per ``retention_check_s``). Indices are
named by the *event's* day, so a redelivered event always lands in the index that holds its first copy.
(noida-db, the ES-compatible server the tests run, has no ILM and no data-stream APIs; on a real cluster
daily indices also work with curator-style jobs or an ILM delete phase if an operator prefers.)

**Idempotence.** ``_id`` = a digest of (project, event_id) and every write is ``op_type=create``: a
redelivered event gets 409 (version conflict) and is counted as a duplicate, so the first copy wins and
:meth:`put` returns how many were new, as the contract says.

**Bulk writes.** Chunks of at most ``chunk_docs`` documents / ``chunk_bytes`` bytes. Items answered 429 or
5xx, and whole requests that fail with a connection error, a timeout, 429 or 5xx, are retried with
exponential backoff and jitter (``initial_backoff_s`` doubling up to ``max_backoff_s``, at most
``max_retries`` retries); an item answered ``index_not_found_exception`` (a cluster that does not
auto-create indices) gets its index created and is retried. Anything else — a 4xx such as a mapping
conflict, or retries exhausted — is a rejection: every other event of the batch is still written, then
:class:`EventIndexingError` is raised naming each rejected event, its status and ES's reason (and each is
logged), so a rejected event never vanishes silently: the processor does not commit the batch.

**Visibility.** Writes are durable when :meth:`put` returns (ES fsyncs its translog per request by
default) but become searchable at the next refresh (``refresh_interval``, 1 s). A store reads its own
writes: a read that follows writes by the same store first refreshes the indices it wrote to (once).
That is what the contract's read-after-write tests need and what the embedded server (one process) needs,
without ``refresh=wait_for`` on writes — the processor writes once per queue record, serially, so waiting
up to a refresh interval per write would cap it at about one record per second — or ``refresh=true``,
which makes a tiny segment per write. Another process (a separate API) sees events within
``refresh_interval``, as with any Elasticsearch reader.

**Search.** The shared grammar (``memory.parse_search_query``): each term becomes a ``match_phrase``
(words ANDed; a word with punctuation in it is a phrase of its tokens, as in FTS5), a single-token prefix
``tok*`` a ``prefix`` query on the analysed token (complete: no expansion limit), a phrase prefix a
``match_phrase_prefix`` (at most ``phrase_prefix_expansions`` expansions of its last word per shard).
No user text ever reaches a query parser. Best first by BM25; ties by ``uid``. Pages use
``search_after`` with an opaque cursor ``(snapshot, score, uid)``: the first page records the newest
``stored_us`` it saw, later pages only see events stored up to it, so events stored after a pagination
started never show up in it (a writer whose clock lags the others' by more than the write interval could
still slip one in). BM25 scores move as events arrive (document count, term frequencies, average length
are corpus-wide), so a later page continues after the *current* score of the previous page's last hit
(one extra small query), not the score in the cursor. That is exact while the new statistics keep the
snapshot's order — a new document count or term frequency scales every score alike; a new average length
can swap two events of different lengths whose scores were close. A point-in-time would freeze the
scores, but its id does not fit the API's 512-character cursor and it pins server resources for every
abandoned pagination. Snippets are made from the hit's text with the same code as the memory store, so
every implementation marks matches alike (``[out of memory]``), whatever highlighter the server has.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar

from elastic_transport import ConnectionError as TransportConnectionError
from elastic_transport import ConnectionTimeout
from elasticsearch import ApiError, Elasticsearch

from .base import EventsRejected, EventStore, Page, SearchHit, StoredEvent
from .common import (
    SearchTerm,
    _Doc,
    _snippet,
    _term_hits,
    check_limit,
    decode_cursor,
    encode_cursor,
    normalize_token,
    parse_search_query,
    tokenize,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_VERSION = 1
MAX_PAGE = 9999                 # size + 1 must stay within index.max_result_window (10000)
_PREFIX_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,199}")
_DAY_FORMAT = "%Y.%m.%d"
_NS_PER_DAY = 86_400 * 10**9
_MIN_DAY = _dt.date(1, 1, 1).toordinal()
_MAX_DAY = _dt.date(9999, 12, 31).toordinal()
_EPOCH_DAY = _dt.date(1970, 1, 1).toordinal()
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

MAX_TOKEN_CHARS = 1024          # longer tokens are cut: Lucene refuses a document with a term > 32766 bytes
TOKENIZER: Dict[str, Any] = {"type": "pattern", "pattern": "[^\\p{L}\\p{N}]+"}
TRUNCATE: Dict[str, Any] = {"type": "truncate", "length": MAX_TOKEN_CHARS}
ANALYSIS: Dict[str, Any] = {
    "tokenizer": {"tg_words": TOKENIZER},
    "filter": {"tg_truncate": TRUNCATE},
    "analyzer": {"tg_text": {"type": "custom", "tokenizer": "tg_words",
                             "filter": ["lowercase", "asciifolding", "tg_truncate"]}},
}
MAPPINGS: Dict[str, Any] = {
    "dynamic": "strict",
    "_meta": {"managed_by": "trainguard", "schema_version": SCHEMA_VERSION},
    "properties": {
        "uid": {"type": "keyword"},
        "event_id": {"type": "keyword"},
        "project": {"type": "keyword"},
        "run_id": {"type": "keyword"},
        "rank": {"type": "integer"},
        "host": {"type": "keyword"},
        "kind": {"type": "keyword"},
        "severity": {"type": "keyword"},
        "fingerprint": {"type": "keyword"},
        "step": {"type": "long"},
        "time_ns": {"type": "long"},
        "@timestamp": {"type": "date", "format": "epoch_millis"},
        "stored_us": {"type": "long"},
        "text": {"type": "text", "analyzer": "tg_text"},
        "payload": {"type": "keyword", "index": False, "doc_values": False},
    },
}


@dataclass(frozen=True)
class RejectedEvent:
    """One event Elasticsearch did not take, and why."""

    project: str
    event_id: str
    index: str
    status: int                 # the item's HTTP status; 0 when the whole request kept failing
    error: str                  # ES's error type and reason, or the transport error

    def __str__(self) -> str:
        return f"{self.project}/{self.event_id} -> {self.index}: {self.status} {self.error}"


class EventIndexingError(EventsRejected):
    """Raised by :meth:`ElasticsearchEventStore.put` when events were rejected (a 4xx, or retries
    exhausted). Every other event of the batch was written; ``rejected`` lists the others, ``new`` counts
    the events created before the error. Re-applying the batch is safe (writes are idempotent)."""

    def __init__(self, rejected: Sequence[RejectedEvent], new: int) -> None:
        self.rejected = list(rejected)
        self.new = new
        shown = "; ".join(str(r) for r in self.rejected[:5])
        more = f" (and {len(self.rejected) - 5} more)" if len(self.rejected) > 5 else ""
        super().__init__(f"Elasticsearch rejected {len(self.rejected)} event(s): {shown}{more}")


class ElasticsearchUnavailable(RuntimeError):
    """The cluster kept failing whole requests (connection errors, timeouts, 429/5xx) past the retries."""


@dataclass
class _Action:
    uid: str
    index: str
    event: StoredEvent
    source: Dict[str, Any]
    size: int


def document_id(project: str, event_id: str) -> str:
    """The ``_id`` of an event: unique per (project, event id), whatever characters either holds."""
    blob = json.dumps([project, event_id], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def index_day(time_ns: int) -> str:
    """``YYYY.MM.DD`` of ``time_ns`` in UTC (clamped to years 1..9999)."""
    day = min(max(_EPOCH_DAY + int(time_ns) // _NS_PER_DAY, _MIN_DAY), _MAX_DAY)
    return _dt.date.fromordinal(day).strftime(_DAY_FORMAT)


class ElasticsearchEventStore(EventStore):
    """Raw context in daily Elasticsearch indices. See the module docstring for the design.

    Pass a ready ``client`` or connection settings (``hosts`` plus optional ``api_key`` or
    ``basic_auth``, ``verify_certs``, ``ca_certs``). ``index_prefix`` names everything this store owns:
    the template ``<prefix>-events`` and the indices ``<prefix>-events-YYYY.MM.DD``; two stores with
    different prefixes never see each other's events. ``manage_template=False`` leaves the template to
    an operator (the user then needs no ``manage_index_templates`` privilege).
    """

    def __init__(self, client: Optional[Elasticsearch] = None, *, hosts: Any = None,
                 api_key: Optional[str] = None, basic_auth: Optional[Tuple[str, str]] = None,
                 verify_certs: bool = True, ca_certs: Optional[str] = None, request_timeout: float = 30.0,
                 index_prefix: str = "trainguard", shards: int = 1, replicas: int = 1,
                 refresh_interval: str = "1s", codec: Optional[str] = "best_compression",
                 retention_days: Optional[int] = None, retention_check_s: float = 3600.0,
                 manage_template: bool = True, read_your_writes: bool = True,
                 max_retries: int = 8, initial_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 chunk_docs: int = 1000, chunk_bytes: int = 8 * 2**20,
                 phrase_prefix_expansions: int = 1000) -> None:
        if not _PREFIX_RE.fullmatch(index_prefix):
            raise ValueError(f"index_prefix {index_prefix!r}: use lower-case letters, digits, '.', '_' or "
                             "'-', starting with a letter or digit")
        if retention_days is not None and retention_days < 1:
            raise ValueError(f"retention_days must be at least 1 (or None: keep everything), "
                             f"not {retention_days!r}")
        if client is None:
            if hosts is None:
                raise ValueError("pass an Elasticsearch client or hosts")
            kwargs: Dict[str, Any] = {"verify_certs": verify_certs, "request_timeout": request_timeout}
            if api_key:
                kwargs["api_key"] = api_key
            if basic_auth:
                kwargs["basic_auth"] = basic_auth
            if ca_certs:
                kwargs["ca_certs"] = ca_certs
            client = Elasticsearch(hosts, **kwargs)
            self._owns_client = True
        else:
            self._owns_client = False
        self.client: Elasticsearch = client
        self.prefix = index_prefix
        self.template_name = f"{index_prefix}-events"
        self.pattern = f"{index_prefix}-events-*"
        self._index_re = re.compile(re.escape(f"{index_prefix}-events-") + r"(\d{4}\.\d{2}\.\d{2})")
        self.shards, self.replicas = shards, replicas
        self.refresh_interval, self.codec = refresh_interval, codec
        self.retention_days, self.retention_check_s = retention_days, retention_check_s
        self.manage_template, self.read_your_writes = manage_template, read_your_writes
        self.max_retries = max_retries
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, max_backoff_s
        self.chunk_docs, self.chunk_bytes = max(1, chunk_docs), max(1, chunk_bytes)
        self.phrase_prefix_expansions = phrase_prefix_expansions
        self._lock = threading.Lock()
        self._template_ready = False
        self._dirty: Set[str] = set()          # indices written since this store's last refresh
        self._last_stamp_us = 0
        self._last_retention = -float("inf")
        self._sleep: Callable[[float], None] = time.sleep
        # counters, for /metrics and tests
        self.retries = 0                       # bulk requests re-sent (whole or some items)
        self.rejected = 0                      # events reported in EventIndexingError

    # --- template and indices ------------------------------------------------------------------
    def template_body(self) -> Dict[str, Any]:
        """The index template this store puts (``PUT _index_template/<prefix>-events``)."""
        settings: Dict[str, Any] = {"number_of_shards": self.shards, "number_of_replicas": self.replicas,
                                    "refresh_interval": self.refresh_interval, "analysis": ANALYSIS}
        if self.codec:
            settings["codec"] = self.codec
        return {"index_patterns": [self.pattern], "priority": 200,
                "template": {"settings": {"index": settings}, "mappings": MAPPINGS},
                "_meta": {"managed_by": "trainguard", "schema_version": SCHEMA_VERSION}}

    def ensure_template(self) -> None:
        """Create or update the index template (idempotent). Existing indices keep their mapping; new
        daily indices get the new one."""
        if not self.manage_template or self._template_ready:
            return
        body = self.template_body()
        self._retrying("put the index template", lambda client: client.indices.put_index_template(
            name=self.template_name, index_patterns=body["index_patterns"], priority=body["priority"],
            template=body["template"], meta=body["_meta"]))
        self._template_ready = True

    def _retrying(self, what: str, call: Callable[[Elasticsearch], T]) -> T:
        """``call`` with the bulk writes' backoff on connection errors, timeouts, 429 and 5xx;
        :class:`ElasticsearchUnavailable` once the retries are spent; other errors as they come."""
        client = self.client.options(max_retries=0, retry_on_status=())
        attempt = 0
        while True:
            if attempt:
                self.retries += 1
                self._sleep(self._backoff(attempt))
            attempt += 1
            try:
                return call(client)
            except (TransportConnectionError, ConnectionTimeout) as exc:
                error = f"{type(exc).__name__}: {exc}"
            except ApiError as exc:
                if exc.status_code not in _RETRY_STATUSES:
                    raise
                error = f"{exc.status_code} {exc.error}: {_reason(exc.info)}"
            if attempt > self.max_retries:
                raise ElasticsearchUnavailable(f"could not {what}: failed {attempt} times ({error})")

    def index_for(self, time_ns: int) -> str:
        return f"{self.prefix}-events-{index_day(time_ns)}"

    def indices(self) -> List[str]:
        """This store's daily indices, oldest first."""
        answer = self.client.indices.resolve_index(name=self.pattern, expand_wildcards="open,closed")
        names = [str(item["name"]) for item in answer.get("indices", [])]
        return sorted(n for n in names if self._index_re.fullmatch(n))

    def drop_expired_indices(self, now_ns: Optional[int] = None) -> List[str]:
        """Delete the daily indices older than ``retention_days`` (today and the ``retention_days``
        days before it stay). Returns the deleted names; nothing without ``retention_days``."""
        if self.retention_days is None:
            return []
        now_ns = time.time_ns() if now_ns is None else now_ns
        today = _EPOCH_DAY + now_ns // _NS_PER_DAY
        oldest_kept = _dt.date.fromordinal(max(today - self.retention_days, _MIN_DAY))
        expired = []
        for name in self.indices():
            match = self._index_re.fullmatch(name)
            if match and _dt.datetime.strptime(match.group(1), _DAY_FORMAT).date() < oldest_kept:
                expired.append(name)
        for i in range(0, len(expired), 50):  # explicit names: clusters refuse wildcard deletes
            self.client.indices.delete(index=",".join(expired[i:i + 50]), ignore_unavailable=True)
        if expired:
            log.info("elasticsearch retention (%s days): deleted %s", self.retention_days, ", ".join(expired))
        with self._lock:
            self._dirty.difference_update(expired)
        return expired

    def _maybe_apply_retention(self) -> None:
        if self.retention_days is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last_retention < self.retention_check_s:
                return
            self._last_retention = now
        try:
            self.drop_expired_indices()
        except Exception as exc:  # retention is housekeeping: never fail a write for it
            log.warning("elasticsearch retention failed (will retry in %.0f s): %s",
                        self.retention_check_s, exc)

    # --- writes ---------------------------------------------------------------------------------
    def put(self, events: Sequence[StoredEvent]) -> int:
        if not events:
            return 0
        self.ensure_template()
        stamp = self._stamp_us()
        actions = [self._action(e, stamp) for e in events]
        new = 0
        rejected: List[RejectedEvent] = []
        written: Set[str] = set()
        try:
            for chunk in self._chunks(actions):
                written.update(a.index for a in chunk)
                n, bad = self._bulk(chunk)
                new += n
                rejected += bad
        finally:
            if written:
                with self._lock:
                    self._dirty.update(written)
        if rejected:
            raise EventIndexingError(rejected, new)
        self._maybe_apply_retention()
        return new

    def _stamp_us(self) -> int:
        with self._lock:
            self._last_stamp_us = max(time.time_ns() // 1000, self._last_stamp_us + 1)
            return self._last_stamp_us

    def _action(self, event: StoredEvent, stamp_us: int) -> _Action:
        payload = json.dumps(event.payload, separators=(",", ":"), ensure_ascii=False)
        exception = event.payload.get("exception") if isinstance(event.payload, Mapping) else None
        fingerprint = exception.get("fingerprint") if isinstance(exception, Mapping) else None
        uid = document_id(event.project, event.event_id)
        time_ns = int(event.time_ns)
        source = {"uid": uid, "event_id": event.event_id, "project": event.project, "run_id": event.run_id,
                  "rank": int(event.rank), "host": event.host, "kind": event.kind, "severity": event.severity,
                  "fingerprint": fingerprint if isinstance(fingerprint, str) else "",
                  "step": int(event.step), "time_ns": time_ns, "@timestamp": time_ns // 1_000_000,
                  "stored_us": stamp_us, "text": event.text, "payload": payload}
        size = len(payload.encode()) + len(event.text.encode()) + 512
        return _Action(uid=uid, index=self.index_for(time_ns), event=event, source=source, size=size)

    def _chunks(self, actions: List[_Action]) -> Iterator[List[_Action]]:
        chunk: List[_Action] = []
        size = 0
        for action in actions:
            if chunk and (len(chunk) >= self.chunk_docs or size + action.size > self.chunk_bytes):
                yield chunk
                chunk, size = [], 0
            chunk.append(action)
            size += action.size
        if chunk:
            yield chunk

    def _bulk(self, chunk: List[_Action]) -> Tuple[int, List[RejectedEvent]]:
        """Write one chunk until every item is created, a duplicate, or rejected."""
        pending = chunk
        new = 0
        rejected: List[RejectedEvent] = []
        attempt = 0
        last_error: Dict[str, Tuple[int, str]] = {}
        while pending:
            if attempt:
                self.retries += 1
                self._sleep(self._backoff(attempt))
            attempt += 1
            try:
                answer = self.client.options(max_retries=0, retry_on_status=()).bulk(
                    operations=[line for a in pending
                                for line in ({"create": {"_index": a.index, "_id": a.uid}}, a.source)])
            except (TransportConnectionError, ConnectionTimeout) as exc:
                error: Tuple[int, str] = (0, f"{type(exc).__name__}: {exc}")
            except ApiError as exc:
                if exc.status_code not in _RETRY_STATUSES:
                    raise
                error = (exc.status_code, f"{exc.error}: {_reason(exc.info)}")
            else:
                retry: List[_Action] = []
                missing: Set[str] = set()
                for action, item in zip(pending, answer["items"]):
                    result = next(iter(item.values()))
                    status = int(result.get("status", 0))
                    if status in (200, 201):
                        new += 1
                        continue
                    if status == 409:  # version conflict: the event is already stored
                        continue
                    err = result.get("error") or {}
                    err_type = str(err.get("type", "")) if isinstance(err, Mapping) else str(err)
                    reason = f"{err_type}: {_reason(err)}"
                    not_found = status == 404 and err_type == "index_not_found_exception"
                    if status in _RETRY_STATUSES or not_found:
                        if not_found:
                            missing.add(action.index)
                        last_error[action.uid] = (status, reason)
                        retry.append(action)
                    else:
                        rejected.append(RejectedEvent(action.event.project, action.event.event_id,
                                                      action.index, status, reason))
                for index in sorted(missing):
                    self._create_index(index)
                if len(answer["items"]) != len(pending):  # never seen; never lose events over it
                    retry = pending[len(answer["items"]):] + retry
                pending = retry
                error = (0, "")
            if not pending:
                break
            if error[1]:
                for action in pending:
                    last_error[action.uid] = error
            if attempt > self.max_retries:
                if error[1] and len(pending) == len(chunk) and not new and not rejected:
                    raise ElasticsearchUnavailable(
                        f"Elasticsearch bulk failed {attempt} times ({error[0] or 'no answer'}: {error[1]}); "
                        f"{len(pending)} event(s) not written")
                for action in pending:
                    status, reason = last_error.get(action.uid, (0, "retries exhausted"))
                    rejected.append(RejectedEvent(action.event.project, action.event.event_id, action.index,
                                                  status, f"after {attempt} attempts: {reason}"))
                break
        for item in rejected:  # logged at once: a later chunk may still raise ElasticsearchUnavailable
            log.error("elasticsearch rejected event %s", item)
        self.rejected += len(rejected)
        return new, rejected

    def _backoff(self, attempt: int) -> float:
        """Equal jitter: uniform in [cap/2, cap] where cap = min(max_backoff_s,
        initial_backoff_s * 2^(attempt-1))."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * (2 ** (attempt - 1)))
        return random.uniform(cap / 2, cap)

    def _create_index(self, index: str) -> None:
        def create(client: Elasticsearch) -> None:
            try:
                client.indices.create(index=index)  # the template gives it settings and mappings
            except ApiError as exc:
                if exc.error != "resource_already_exists_exception":
                    raise

        self._retrying(f"create index {index}", create)

    # --- reads ----------------------------------------------------------------------------------
    def _before_read(self) -> None:
        if not self.read_your_writes:
            return
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        if not dirty:
            return
        try:
            self.client.indices.refresh(index=",".join(sorted(dirty)), ignore_unavailable=True,
                                        allow_no_indices=True)
        except Exception:
            with self._lock:
                self._dirty.update(dirty)
            raise

    def _search(self, **kwargs: Any) -> Dict[str, Any]:
        self._before_read()
        answer = self.client.search(index=self.pattern, ignore_unavailable=True, allow_no_indices=True,
                                    track_total_hits=False, **kwargs)
        return dict(answer.body)

    def get(self, project: str, event_id: str) -> Optional[StoredEvent]:
        answer = self._search(
            query={"bool": {"filter": [{"term": {"project": project}}, {"term": {"event_id": event_id}}]}},
            sort=[{"stored_us": "asc"}, {"uid": "asc"}], size=1)
        hits = answer["hits"]["hits"]
        return _event(hits[0]["_source"]) if hits else None

    def list_for_run(self, project: str, run_id: str, *, kinds: Optional[Sequence[str]] = None,
                     limit: int = 100, cursor: Optional[str] = None) -> Page[StoredEvent]:
        check_limit(limit)
        kind_set = sorted(set(kinds)) if kinds is not None else None
        scope = [project, run_id, kind_set]
        after = decode_cursor(cursor, "events", scope, (int, str)) if cursor else None
        if kind_set == []:
            return Page(items=[])
        size = min(limit, MAX_PAGE)
        filters: List[Dict[str, Any]] = [{"term": {"project": project}}, {"term": {"run_id": run_id}}]
        if kind_set is not None:
            filters.append({"terms": {"kind": kind_set}})
        request: Dict[str, Any] = {"query": {"bool": {"filter": filters}},
                                   "sort": [{"time_ns": "asc"}, {"uid": "asc"}], "size": size + 1}
        if after is not None:
            request["search_after"] = after
        hits = self._search(**request)["hits"]["hits"]
        page = _page(hits, size,
                     lambda h: encode_cursor("events", scope, [int(h["sort"][0]), str(h["sort"][1])]))
        return Page(items=[_event(h["_source"]) for h in page.items], next_cursor=page.next_cursor)

    def search(self, project: str, query: str, *, run_id: Optional[str] = None, limit: int = 50,
               cursor: Optional[str] = None) -> Page[SearchHit]:
        terms = parse_search_query(query)
        check_limit(limit)
        scope = [project, query, run_id]
        after = decode_cursor(cursor, "search", scope, (int, float, str)) if cursor else None
        size = min(limit, MAX_PAGE)
        filters: List[Dict[str, Any]] = [{"term": {"project": project}}]
        if run_id is not None:
            filters.append({"term": {"run_id": run_id}})
        if after is not None:
            filters.append({"range": {"stored_us": {"lte": after[0]}}})
        request: Dict[str, Any] = {
            "query": {"bool": {"must": [self._term_query(t) for t in terms], "filter": filters}},
            "sort": [{"_score": "desc"}, {"uid": "asc"}], "size": size + 1}
        if after is None:
            request["aggs"] = {"snapshot": {"max": {"field": "stored_us"}}}
        else:
            request["search_after"] = [self._anchor_score(request["query"], after[2], after[1]), after[2]]
        answer = self._search(**request)
        if after is None:
            value = ((answer.get("aggregations") or {}).get("snapshot") or {}).get("value")
            snapshot = int(value) if value is not None else 0
        else:
            snapshot = int(after[0])
        hits = answer["hits"]["hits"]
        page = _page(hits, size, lambda h: encode_cursor(
            "search", scope, [snapshot, float(h["sort"][0]), str(h["sort"][1])]))
        out = []
        for hit in page.items:
            event = _event(hit["_source"])
            out.append(SearchHit(event=event, snippet=_make_snippet(event, terms),
                                 score=float(hit["_score"])))
        return Page(items=out, next_cursor=page.next_cursor)

    def _anchor_score(self, query: Dict[str, Any], uid: str, fallback: float) -> float:
        """The current score of the previous page's last hit. BM25 reads corpus statistics (document
        count, term frequencies, average length) that change as events arrive, so the score in the
        cursor may no longer be the one ES computes now; continuing after the last hit's *current*
        score keeps the pages complete and free of duplicates as long as the snapshot's order holds. The
        cursor's score is used if that event is gone."""
        anchor = {"bool": {"must": query["bool"]["must"],
                           "filter": [*query["bool"]["filter"], {"term": {"uid": uid}}]}}
        hits = self._search(query=anchor, size=1, source=False)["hits"]["hits"]
        return float(hits[0]["_score"]) if hits else fallback

    def _term_query(self, term: SearchTerm) -> Dict[str, Any]:
        """One ANDed term as an ES query; the text ES sees is the term's own tokens joined by spaces,
        so ES and the shared grammar agree on token boundaries and no syntax is ever parsed."""
        words = [term.raw[start:end] for _, start, end in tokenize(term.raw)]
        if not term.prefix:
            return {"match_phrase": {"text": {"query": " ".join(words)}}}
        if len(words) == 1:
            normalized = self._normalize(words[0])
            if normalized is not None:
                return {"prefix": {"text": {"value": normalized}}}
        return {"match_phrase_prefix": {"text": {"query": " ".join(words),
                                                 "max_expansions": self.phrase_prefix_expansions}}}

    def _normalize(self, word: str) -> Optional[str]:
        """``word`` as the index has it (prefix queries are not analysed): lower case for ASCII, else
        what the index's analyser makes of it (``_analyze``; e.g. ß → ss). None when it is not one token."""
        if word.isascii():
            return word.lower()[:MAX_TOKEN_CHARS]
        try:
            answer = self.client.indices.analyze(
                tokenizer=TOKENIZER, filter=["lowercase", "asciifolding", TRUNCATE], text=word)
        except ApiError as exc:  # e.g. a user without the privilege: the shared normalisation is close
            log.warning("elasticsearch _analyze failed (%s); normalising %r locally", exc, word)
            return normalize_token(word)[:MAX_TOKEN_CHARS]
        tokens = [str(t["token"]) for t in answer.get("tokens", [])]
        return tokens[0] if len(tokens) == 1 else None

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


def _reason(info: Any) -> str:
    if isinstance(info, Mapping):
        error = info.get("error", info)
        if isinstance(error, Mapping):
            caused = error.get("caused_by")
            reason = str(error.get("reason", ""))
            if isinstance(caused, Mapping) and caused.get("reason"):
                reason += f" (caused by {caused.get('type', '')}: {caused['reason']})"
            return reason or json.dumps(error)[:500]
        return str(error)[:500]
    return str(info)[:500]


def _event(source: Mapping[str, Any]) -> StoredEvent:
    return StoredEvent(event_id=source["event_id"], project=source["project"], run_id=source["run_id"],
                       rank=int(source["rank"]), host=source["host"], kind=source["kind"],
                       severity=source["severity"], step=int(source["step"]), time_ns=int(source["time_ns"]),
                       text=source["text"], payload=json.loads(source["payload"]))


def _make_snippet(event: StoredEvent, terms: List[SearchTerm]) -> str:
    tokens = tokenize(event.text)
    doc = _Doc(seq=0, project=event.project, run_id=event.run_id, kind=event.kind, time_ns=event.time_ns,
               text=event.text, blob="", tokens=tokens)
    return _snippet(doc, [_term_hits(tokens, t) for t in terms], terms)


def _page(items: List[T], limit: int, make_cursor: Callable[[T], str]) -> Page[T]:
    if len(items) > limit:
        items = items[:limit]
        return Page(items=items, next_cursor=make_cursor(items[-1]))
    return Page(items=items)


__all__ = ["ANALYSIS", "MAPPINGS", "ElasticsearchEventStore", "ElasticsearchUnavailable",
           "EventIndexingError", "RejectedEvent", "document_id", "index_day"]
