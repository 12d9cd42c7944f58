"""Pure helpers every store implementation shares, so that all of them read a query, a cursor or a tag
filter alike (the SQLite, Elasticsearch, ClickHouse and in-memory stores import them from here):

- :func:`parse_search_query` — the search grammar: words ANDed, ``"quoted phrases"``, prefix ``tok*``;
  anything it cannot accept is a ``ValueError`` whose message can be shown to the user as is.
- :func:`encode_cursor` / :func:`decode_cursor` — opaque keyset cursors (base64url JSON) bound to the
  listing and the filters they came from; a cursor that does not decode for *this* listing is
  ``ValueError("invalid cursor")``.
- :func:`parse_tag_filter`, :func:`bucket_width`, :func:`check_limit`, token text and token-secret helpers,
  BM25 scoring and snippets (the same numbers FTS5 gives), non-finite value codes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
import unicodedata
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, TypeVar

from .base import (
    Bucket,
    Page,
    StoredEvent,
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
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what SQLite (and every store) can bind as an integer
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
    for the same ``kind`` and ``scope`` and its values have ``types`` (float accepts int; an int must fit in
    64 bits: a forged cursor cannot reach a store with an integer it cannot bind)."""
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
            elif not isinstance(value, typ) or (isinstance(value, int)
                                                and not INT64_MIN <= value <= INT64_MAX):
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

