"""In-memory reference implementations of the store contracts (``storage/base.py``), and the small pure
helpers every implementation shares so that all of them read a query, a cursor or a tag filter alike:

- :func:`parse_search_query` — the search grammar: words ANDed, ``"quoted phrases"``, prefix ``tok*``;
  anything it cannot accept is a ``ValueError`` whose message can be shown to the user as is.
- :func:`encode_cursor` / :func:`decode_cursor` — opaque keyset cursors (base64url JSON) bound to the
  listing and the filters they came from; a cursor that does not decode for *this* listing is
  ``ValueError("invalid cursor")``.
- :func:`parse_tag_filter`, :func:`bucket_width`, :func:`check_limit`, token text helpers.

The memory stores keep records as JSON text, exactly as the SQLite stores do, so both return equal
objects (NaN survives; tuples come back as lists) and a caller can never mutate stored state through a
returned object. Every public method takes one lock: the stores are safe to share between threads. Nothing
is durable and nothing is bounded: they are for tests and for ``--data-dir :memory:`` style demos.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import copy
import hashlib
import hmac
import json
import math
import re
import secrets
import threading
import time
import unicodedata
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

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

T = TypeVar("T")

# ----------------------------------------------------------------------------------------------------------
# Search grammar (shared)
# ----------------------------------------------------------------------------------------------------------

MAX_QUERY_CHARS = 1024
MAX_QUERY_TERMS = 32
SNIPPET_TOKENS = 16          # tokens of context in a snippet
BM25_K1 = 1.2                # FTS5's bm25() constants, so scores agree across implementations
BM25_B = 0.75

_TOKEN_RE = re.compile(r"[^\W_]+")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_UNSUPPORTED_OPERATORS = ("OR", "NOT", "NEAR")


@dataclass(frozen=True)
class SearchTerm:
    """One ANDed term of a query: a word or a quoted phrase, whose last token may be a prefix."""

    raw: str                    # the text as typed, without quotes or the trailing ``*``
    tokens: Tuple[str, ...]     # normalised tokens (see :func:`tokenize`), never empty
    prefix: bool = False        # the last token matches any token starting with it
    phrase: bool = False        # typed in double quotes


def normalize_token(token: str) -> str:
    """Lower case without diacritics, like FTS5's ``unicode61 remove_diacritics 2``."""
    decomposed = unicodedata.normalize("NFKD", token)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).lower()


def tokenize(text: str) -> List[Tuple[str, int, int]]:
    """``(normalised token, start, end)`` for every run of letters and digits in ``text``: the same
    tokens FTS5's unicode61 tokenizer produces (punctuation, underscores and spaces separate tokens)."""
    return [(normalize_token(m.group()), m.start(), m.end()) for m in _TOKEN_RE.finditer(text)]


def parse_search_query(query: str) -> List[SearchTerm]:
    """Parse a user's search text into ANDed terms.

    Grammar: terms separated by whitespace; ``"..."`` is a phrase (its words adjacent, in order);
    a trailing ``*`` on a word or a closing quote makes its last token a prefix; a bare ``AND`` is
    ignored (terms are ANDed anyway). Raises ValueError, with a message meant for the user, for an empty
    or over-long query, an unbalanced quote, a lone ``*``, ``OR``/``NOT``/``NEAR`` (unsupported) or a
    query with no searchable characters. Punctuation-only words are ignored.
    """
    if not isinstance(query, str):
        raise ValueError("search query must be a string")
    text = _CONTROL_RE.sub(" ", query).strip()  # control characters (NUL!) separate words
    if not text:
        raise ValueError("search query is empty")
    if len(text) > MAX_QUERY_CHARS:
        raise ValueError(f"search query is too long ({len(text)} characters; at most {MAX_QUERY_CHARS})")
    terms: List[SearchTerm] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        if ch == '"':
            close = text.find('"', i + 1)
            if close < 0:
                raise ValueError(f"unbalanced quote in search query at character {i + 1}: "
                                 'close the phrase with another "')
            raw = text[i + 1:close]
            i = close + 1
            prefix = i < n and text[i] == "*"
            while i < n and text[i] == "*":
                i += 1
            if i < n and not text[i].isspace() and text[i] != '"':
                raise ValueError(f"put a space after the closing quote at character {close + 1}")
            _add_term(terms, raw, prefix=prefix, phrase=True)
            continue
        start = i
        while i < n and not text[i].isspace() and text[i] != '"':
            i += 1
        word = text[start:i]
        if word == "AND":
            continue
        if word in _UNSUPPORTED_OPERATORS:
            raise ValueError(f"{word} is not supported: words are ANDed; "
                             f'write "{word.lower()}" to search for the word itself')
        stripped = word.rstrip("*")
        _add_term(terms, stripped, prefix=len(stripped) < len(word), phrase=False)
    if not terms:
        raise ValueError("search query has no searchable words (letters or digits)")
    if len(terms) > MAX_QUERY_TERMS:
        raise ValueError(f"search query has too many terms ({len(terms)}; at most {MAX_QUERY_TERMS})")
    return terms


def _add_term(terms: List[SearchTerm], raw: str, *, prefix: bool, phrase: bool) -> None:
    tokens = tuple(tok for tok, _, _ in tokenize(raw))
    if not tokens:
        if prefix:
            raise ValueError("'*' must follow at least one letter or digit (prefix search: tok*)")
        return  # punctuation only: nothing to match, like the tokenizer would do
    terms.append(SearchTerm(raw=raw, tokens=tokens, prefix=prefix, phrase=phrase))


# ----------------------------------------------------------------------------------------------------------
# Cursors, limits, tag filters, buckets (shared)
# ----------------------------------------------------------------------------------------------------------

MAX_CURSOR_CHARS = 2048
CursorValue = Any  # int | float | str


def _scope_digest(scope: Sequence[Any]) -> str:
    blob = json.dumps(list(scope), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def encode_cursor(kind: str, scope: Sequence[Any], key: Sequence[CursorValue]) -> str:
    """An opaque cursor for the listing ``kind`` with filters ``scope``, resuming after ``key``."""
    body = json.dumps({"k": kind, "s": _scope_digest(scope), "v": list(key)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, kind: str, scope: Sequence[Any], types: Sequence[type]) -> List[Any]:
    """The key inside ``cursor``; ValueError("invalid cursor") unless it was made by :func:`encode_cursor`
    for the same ``kind`` and ``scope`` and its values have ``types`` (float accepts int)."""
    try:
        if not isinstance(cursor, str) or not cursor or len(cursor) > MAX_CURSOR_CHARS:
            raise ValueError
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw.decode())
        if (not isinstance(data, dict) or data.get("k") != kind or data.get("s") != _scope_digest(scope)
                or not isinstance(data.get("v"), list) or len(data["v"]) != len(types)):
            raise ValueError
        values: List[Any] = data["v"]
        for value, typ in zip(values, types):
            if isinstance(value, bool):
                raise ValueError
            if typ is float:
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError
            elif not isinstance(value, typ):
                raise ValueError
        return [float(v) if t is float else v for v, t in zip(values, types)]
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise ValueError("invalid cursor") from None


def check_limit(limit: int) -> int:
    """``limit`` if it is a positive int, else ValueError."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit!r}")
    return limit


def parse_tag_filter(tag: str) -> Tuple[str, Optional[str]]:
    """``"key=value"`` → (key, value); ``"key"`` → (key, None). ValueError for an empty key."""
    key, sep, value = tag.partition("=")
    key = key.strip()
    if not key:
        raise ValueError(f"invalid tag filter {tag!r}: use key=value or key")
    return key, (value if sep else None)


def bucket_width(lo: int, hi: int, max_points: int) -> int:
    """Step width of equal buckets covering ``[lo, hi]`` with at most ``max_points`` buckets (≥ 1)."""
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
        raise ValueError(f"max_points must be a positive integer, not {max_points!r}")
    span = hi - lo + 1
    return max(1, -(-span // max_points))


# Non-finite codes used by every store that cannot store NaN natively (SQLite turns NaN into NULL).
FINITE, NAN, POS_INF, NEG_INF = 0, 1, 2, 3


def nonfinite_code(value: float) -> int:
    if value != value:
        return NAN
    if value == math.inf:
        return POS_INF
    if value == -math.inf:
        return NEG_INF
    return FINITE


def from_nonfinite_code(code: int, value: Optional[float]) -> float:
    if code == NAN:
        return math.nan
    if code == POS_INF:
        return math.inf
    if code == NEG_INF:
        return -math.inf
    return float(value) if value is not None else math.nan


# ----------------------------------------------------------------------------------------------------------
# Token text (shared)
# ----------------------------------------------------------------------------------------------------------

TOKEN_KINDS = ("ingest", "read")
_TOKEN_RE_FULL = re.compile(r"tg_(ingest|read)_([0-9a-f]{16})_([0-9a-f]{48})")


def new_token(kind: str) -> Tuple[str, str, str]:
    """``(token text, token id, secret)`` for a fresh token: ``tg_<kind>_<id16hex>_<secret48hex>``."""
    check_token_kind(kind)
    token_id, secret = secrets.token_hex(8), secrets.token_hex(24)
    return f"tg_{kind}_{token_id}_{secret}", token_id, secret


def split_token(token: str) -> Optional[Tuple[str, str, str]]:
    """``(kind, token id, secret)`` from token text, or None if it is not TrainGuard token text."""
    match = _TOKEN_RE_FULL.fullmatch(token) if isinstance(token, str) else None
    return (match.group(1), match.group(2), match.group(3)) if match else None


def hash_secret(secret: str) -> str:
    """SHA-256 of the secret: 192 random bits need no salt or slow hash."""
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    """Constant-time comparison of ``secret``'s hash with ``stored_hash``."""
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def check_token_kind(kind: str) -> None:
    if kind not in TOKEN_KINDS:
        raise ValueError(f"token kind must be one of {', '.join(TOKEN_KINDS)}, not {kind!r}")


def parse_operator_token(kind: str, token: str) -> Tuple[str, str]:
    """``(token id, secret)`` of token text an operator chose for ``kind``; ValueError unless it is
    ``tg_<kind>_<16 hex>_<48 hex>`` with that kind. One can be made with
    ``python -c "import secrets as s; print('tg_ingest_' + s.token_hex(8) + '_' + s.token_hex(24))"``."""
    check_token_kind(kind)
    parts = split_token(token)
    if parts is None:
        raise ValueError(f"a {kind} token must look like tg_{kind}_<16 hex digits>_<48 hex digits>")
    if parts[0] != kind:
        raise ValueError(f"token text is a {parts[0]} token, not a {kind} token")
    return parts[1], parts[2]


def check_project_name(project: str) -> None:
    if not isinstance(project, str) or not project.strip():
        raise ValueError("project name must be a non-empty string")


# ----------------------------------------------------------------------------------------------------------
# Memory stores
# ----------------------------------------------------------------------------------------------------------


def _page(items: List[T], limit: int, make_cursor: Callable[[T], str]) -> Page[T]:
    """``items`` holds up to ``limit + 1`` entries: the extra one only says that a next page exists."""
    if len(items) > limit:
        items = items[:limit]
        return Page(items=items, next_cursor=make_cursor(items[-1]))
    return Page(items=items)


def _event_to_json(event: StoredEvent) -> str:
    return json.dumps(asdict(event), separators=(",", ":"))


def _event_from_json(text: str) -> StoredEvent:
    return StoredEvent(**json.loads(text))


@dataclass
class _Doc:
    seq: int
    project: str
    run_id: str
    kind: str
    time_ns: int
    text: str
    blob: str                             # the StoredEvent as JSON
    tokens: List[Tuple[str, int, int]]


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


def _term_hits(tokens: List[Tuple[str, int, int]], term: SearchTerm) -> List[int]:
    """Start positions in ``tokens`` where ``term`` matches."""
    want, size = term.tokens, len(term.tokens)
    out = []
    for i in range(len(tokens) - size + 1):
        if all(tokens[i + k][0] == want[k] for k in range(size - 1)):
            last = tokens[i + size - 1][0]
            if last == want[-1] or (term.prefix and last.startswith(want[-1])):
                out.append(i)
    return out


def _bm25(hits: List[List[int]], doc_freq: List[int], n_docs: int, doc_len: int, avgdl: float,
          sizes: List[int]) -> float:
    """FTS5's bm25() with the sign flipped (higher is better)."""
    score = 0.0
    for term_hits, df in zip(hits, doc_freq):
        idf = math.log((n_docs - df + 0.5) / (df + 0.5))
        if idf <= 0.0:
            idf = 1e-6
        freq = len(term_hits)
        norm = BM25_K1 * (1 - BM25_B + BM25_B * doc_len / avgdl) if avgdl else BM25_K1
        score += idf * (freq * (BM25_K1 + 1)) / (freq + norm)
    return score


def _snippet(doc: _Doc, hits: List[List[int]], terms: List[SearchTerm]) -> str:
    """About SNIPPET_TOKENS tokens around the first match; each match (a word, or a whole phrase) in
    [brackets], overlapping matches merged — as FTS5's snippet() marks them."""
    spans = sorted((start, start + len(term.tokens) - 1) for term_hits, term in zip(hits, terms)
                   for start in term_hits)
    merged: List[List[int]] = []
    for first, last in spans:
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    tokens, text = doc.tokens, doc.text
    if not merged:
        return text[:200]
    lo = max(0, min(merged[0][0] - 2, len(tokens) - SNIPPET_TOKENS))
    hi = min(len(tokens), lo + SNIPPET_TOKENS)
    parts, pos = [], (tokens[lo][1] if lo else 0)
    for first, last in merged:
        if first < lo or first >= hi:
            continue
        last = min(last, hi - 1)
        parts.append(text[pos:tokens[first][1]])
        parts.append("[" + text[tokens[first][1]:tokens[last][2]] + "]")
        pos = tokens[last][2]
    end = tokens[hi - 1][2] if hi < len(tokens) else len(text)
    parts.append(text[pos:end])
    return ("…" if lo > 0 else "") + "".join(parts) + ("…" if hi < len(tokens) else "")


def aggregate_bucket(step_start: int, step_end: int, steps_values: Iterable[Tuple[int, float]]) -> Bucket:
    """The bucket of ``(step, value)`` pairs in step order: min/max/mean over finite values (NaN when
    there are none), last = the value at the highest step (NaN/Inf as is), nonfinite counted."""
    count, nonfinite, total = 0, 0, 0.0
    lo, hi, last = math.inf, -math.inf, math.nan
    finite = 0
    for _, value in steps_values:
        count += 1
        last = value
        if math.isfinite(value):
            finite += 1
            total += value
            lo = min(lo, value)
            hi = max(hi, value)
        else:
            nonfinite += 1
    if not finite:
        lo = hi = math.nan
    return Bucket(step_start=step_start, step_end=step_end, count=count, min=lo, max=hi,
                  mean=total / finite if finite else math.nan, last=last, nonfinite=nonfinite)


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

    def save_state(self, key: str, state: bytes) -> None:
        with self._lock:
            self._state[key] = bytes(state)

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
