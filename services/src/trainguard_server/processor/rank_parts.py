"""A big run's snapshot part stored below the run: its ranks in parts of ``RANKS_PER_PART``, only the parts
that changed written again (issue 20: no single state key holds a whole big run).

The pipeline saves a run as one part (``Pipeline.changed_parts``: ``run/<key>`` = the run's versioned
JSON, 28 MB for a 4,096-rank run). :class:`RankParts` sits between it and the state store, one per
pipeline (partition):

* :meth:`RankParts.to_store` turns a ``changed_parts`` mapping into what to write: a run part of at most
  ``split_above`` bytes passes through unchanged; a bigger one becomes a head (``run/<key>``: the run with
  its ``ranks`` list replaced by ``{"rank_parts": n, "ranks": count}`` in the same place) and ``n``
  parts ``ranks/<i>/<key>`` (ranks ``i*RANKS_PER_PART ..`` in the run's order, as a JSON list). A head or
  rank part whose bytes equal what was last stored under its name is not written again; rank parts beyond
  the current count, and every part of a deleted run, are deleted (``None``).
* :meth:`RankParts.saved` -- after the store's transaction committed -- adopts what was written as "last
  stored" (a failed save leaves it as it was: the pipeline gives the same runs again next time).
* :meth:`RankParts.from_store` turns stored parts back into what ``Pipeline.restore_parts`` reads: each
  head with its rank parts joined into the exact bytes of the run part it came from (same JSON encoder,
  same key order). A head whose rank parts are missing is passed on as it is (the pipeline finds it
  unreadable: that run alone is quarantined and its parts deleted at the next save); rank parts without a
  head are deleted at the next save.

Exactness: ``from_store(to_store(parts)) == parts`` byte for byte (tests/services/processor/
test_rank_parts.py). A run part from the pipeline is a ``trainguard_engine.pipeline.RunPart``: it says
where its ranks list is and carries each rank's bytes (the pipeline encodes only the ranks touched since
its last encode), so the split is a join of those, with no parse; other bytes are scanned (``_split_text``)
or, failing that, parsed and encoded again. What the split saves is bytes written when ranks stayed quiet
between checkpoints, and it bounds the largest stored value (``RANKS_PER_PART`` ranks' state) -- one run
is still one partition's, so one processor's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Mapping, Optional

from trainguard_engine.pipeline import RunPart

SPLIT_ABOVE_BYTES = 1 << 20
"""A run part above this many bytes is stored as a head and rank parts (~150 ranks of SDK-shaped state)."""
RANKS_PER_PART = 128
"""Ranks per rank part (~0.9 MB of SDK-shaped state at 20 steps of history)."""
RANK_PART_PREFIX = "ranks/"
"""Rank parts are named ``ranks/<i>/<the run part's name after 'run/'>``."""
_RUN = "run/"
_RANKS_KEY = ',"ranks":['
_DECODER = json.JSONDecoder()


def _json_bytes(doc: Any) -> bytes:
    """The pipeline's encoder for parts (trainguard_engine.pipeline): the joined run part is its bytes."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")


def _digest(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=16).digest()


def rank_part_name(run_name: str, index: int) -> str:
    """The name of rank part ``index`` of the run part ``run_name`` (``run/<key>``)."""
    return f"{RANK_PART_PREFIX}{index}/{run_name[len(_RUN):]}"


def _split_rank_name(name: str) -> Optional[tuple[str, int]]:
    """(run part name, index) of a rank part name; None when ``name`` is not one."""
    index, sep, rest = name[len(RANK_PART_PREFIX):].partition("/")
    if not name.startswith(RANK_PART_PREFIX) or not sep or not index.isdigit():
        return None
    return _RUN + rest, int(index)


class RankParts:
    """The rank-level split of one pipeline's run parts (see the module doc)."""

    def __init__(self, split_above: Optional[int] = None, ranks_per_part: Optional[int] = None) -> None:
        """``split_above`` / ``ranks_per_part``: default the module's ``SPLIT_ABOVE_BYTES`` /
        ``RANKS_PER_PART`` (read when the object is made)."""
        self.split_above = SPLIT_ABOVE_BYTES if split_above is None else split_above
        self.ranks_per_part = max(1, RANKS_PER_PART if ranks_per_part is None else ranks_per_part)
        self._stored: Dict[str, bytes] = {}       # head / rank part name -> digest of its stored bytes
        self._rank_parts: Dict[str, int] = {}     # split run part name -> how many rank parts are stored
        self._orphans: List[str] = []             # stored rank parts of no head: deleted at the next save
        self._pending: Optional[tuple[Dict[str, Optional[bytes]], Dict[str, int]]] = None

    # --- saving -------------------------------------------------------------------------------
    def to_store(self, parts: Mapping[str, Optional[bytes]]) -> Dict[str, Optional[bytes]]:
        """What to write for ``parts`` (a ``Pipeline.changed_parts`` mapping); call :meth:`saved` once it
        is stored."""
        out: Dict[str, Optional[bytes]] = {}
        counts: Dict[str, int] = {}
        for name in self._orphans:
            out[name] = None
        for name, blob in parts.items():
            if not name.startswith(_RUN):
                out[name] = blob
                continue
            stored = self._rank_parts.get(name, 0)
            pieces = self._split(name, blob) if blob is not None and len(blob) > self.split_above else {}
            if len(pieces) < 2:  # small, deleted, or no ranks to split off: the run part as it is
                out[name] = blob if blob is None or type(blob) is bytes else bytes(blob)
                counts[name] = 0
            else:
                for piece_name, piece in pieces.items():
                    if self._stored.get(piece_name) != _digest(piece):
                        out[piece_name] = piece
                counts[name] = len(pieces) - 1
            for index in range(counts[name], stored):
                out[rank_part_name(name, index)] = None
        self._pending = ({k: v for k, v in out.items() if k.startswith((_RUN, RANK_PART_PREFIX))}, counts)
        return out

    def _split(self, name: str, blob: bytes) -> Dict[str, bytes]:
        """The head and rank parts of run part ``name`` (head first)."""
        return (self._split_pieces(name, blob) or self._split_text(name, blob)
                or self._split_parsed(name, blob))

    def _split_pieces(self, name: str, blob: bytes) -> Optional[Dict[str, bytes]]:
        """:meth:`_split_text` from the pipeline's own per-rank encodings (a ``RunPart``: where its ranks
        list is and each rank's bytes), without scanning the part; None when ``blob`` carries none."""
        if not isinstance(blob, RunPart) or not blob.rank_pieces:
            return None
        at, end, ranks = blob.ranks_at, blob.ranks_end, blob.rank_pieces
        if blob[at - len(_RANKS_KEY) + 1:at + 1] != _RANKS_KEY.encode("ascii"):
            return None
        step = self.ranks_per_part
        count = (len(ranks) + step - 1) // step
        marker = json.dumps({"rank_parts": count, "ranks": len(ranks)}, separators=(",", ":"))
        head = b"".join((blob[:at], marker.encode("ascii"), blob[end:]))
        pieces = {name: head}
        for index in range(count):
            chunk = ranks[index * step:(index + 1) * step]
            pieces[rank_part_name(name, index)] = b"[" + b",".join(chunk) + b"]"
        return pieces

    def _split_text(self, name: str, blob: bytes) -> Optional[Dict[str, bytes]]:
        """:meth:`_split_parsed` without re-encoding: each rank's bytes are sliced out of the run part where
        the decoder found them (half the cost); None when the part is not laid out as expected (then the
        caller parses it whole)."""
        text = blob.decode("ascii")
        at = text.find(_RANKS_KEY)  # strings hold no bare quote: the first is the run's own "ranks" list
        if at < 0:
            return None
        pos = at + len(_RANKS_KEY)
        spans: List[tuple[int, int]] = []
        scan = _DECODER.raw_decode
        try:
            while text[pos] != "]":
                _rank, end = scan(text, pos)
                spans.append((pos, end))
                pos = end + 1 if text[end] == "," else end
                if text[end] not in ",]":
                    return None
        except (ValueError, IndexError):
            return None
        if not spans:
            return None
        step = self.ranks_per_part
        count = (len(spans) + step - 1) // step
        marker = {"rank_parts": count, "ranks": len(spans)}
        head = f"{text[:at]},\"ranks\":{json.dumps(marker, separators=(',', ':'))}{text[pos + 1:]}"
        try:  # the marker must be where the run's ranks were
            if json.loads(head)["run"]["ranks"] != marker:
                return None
        except (ValueError, KeyError, TypeError):
            return None
        pieces = {name: head.encode("ascii")}
        for index in range(count):
            chunk = spans[index * step:(index + 1) * step]
            pieces[rank_part_name(name, index)] = f"[{text[chunk[0][0]:chunk[-1][1]]}]".encode("ascii")
        return pieces

    def _split_parsed(self, name: str, blob: bytes) -> Dict[str, bytes]:
        """The head and rank parts of run part ``name``, by parsing and encoding it."""
        doc = json.loads(blob)
        run = doc["run"]
        ranks = run["ranks"]
        step = self.ranks_per_part
        chunks = [ranks[i:i + step] for i in range(0, len(ranks), step)]
        run["ranks"] = {"rank_parts": len(chunks), "ranks": len(ranks)}
        pieces = {name: _json_bytes(doc)}
        for index, chunk in enumerate(chunks):
            pieces[rank_part_name(name, index)] = _json_bytes(chunk)
        return pieces

    def saved(self) -> None:
        """The last :meth:`to_store` mapping is stored: it is what the next one compares with."""
        if self._pending is None:
            return
        written, counts = self._pending
        self._pending = None
        self._orphans.clear()
        for name, blob in written.items():
            if blob is None:
                self._stored.pop(name, None)
            else:
                self._stored[name] = _digest(blob)
        for name, count in counts.items():
            if count:
                self._rank_parts[name] = count
            else:
                self._rank_parts.pop(name, None)
                if written.get(name) is None:
                    self._stored.pop(name, None)

    # --- restoring ----------------------------------------------------------------------------
    def from_store(self, stored: Mapping[str, bytes]) -> Dict[str, bytes]:
        """What ``Pipeline.restore_parts`` reads of the ``stored`` parts (name -> bytes): rank parts joined
        into their runs' parts; remembers what is stored, for :meth:`to_store`."""
        self._stored.clear()
        self._rank_parts.clear()
        self._orphans = []
        ranks: Dict[str, Dict[int, bytes]] = {}
        out: Dict[str, bytes] = {}
        for name, blob in stored.items():
            split = _split_rank_name(name)
            if split is not None:
                ranks.setdefault(split[0], {})[split[1]] = blob
            else:
                out[name] = blob
        for run_name, pieces in ranks.items():
            head = out.get(run_name)
            if head is None:  # rank parts of no run: deleted at the next save
                self._orphans += [rank_part_name(run_name, i) for i in sorted(pieces)]
                continue
            joined = self._join(head, pieces)
            if joined is None:  # a head these parts do not complete: passed on as it is (quarantined)
                continue
            out[run_name] = joined
            self._stored[run_name] = _digest(head)
            for index, piece in pieces.items():
                self._stored[rank_part_name(run_name, index)] = _digest(piece)
            self._rank_parts[run_name] = len(pieces)
        for run_name, pieces in ranks.items():  # a head left unjoined still owns its stored rank parts
            if run_name in out and run_name not in self._rank_parts:
                self._rank_parts[run_name] = max(pieces) + 1
        return out

    @staticmethod
    def _join(head: bytes, pieces: Mapping[int, bytes]) -> Optional[bytes]:
        """The run part of ``head`` and its rank parts; None when they do not make one."""
        try:
            doc = json.loads(head)
            run = doc["run"]
            marker = run["ranks"]
            count = int(marker["rank_parts"])
            if sorted(pieces) != list(range(count)):
                return None
            ranks: List[Any] = []
            for index in range(count):
                chunk = json.loads(pieces[index])
                if not isinstance(chunk, list):
                    return None
                ranks += chunk
            if len(ranks) != int(marker["ranks"]):
                return None
            run["ranks"] = ranks
            return _json_bytes(doc)
        except (ValueError, TypeError, KeyError):
            return None


__all__ = ["RANKS_PER_PART", "RANK_PART_PREFIX", "SPLIT_ABOVE_BYTES", "RankParts", "rank_part_name"]
