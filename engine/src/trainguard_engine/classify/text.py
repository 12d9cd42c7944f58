"""The classifier's shared machinery: the text window (launcher prefixes stripped, lines, bounded
searches around literal needles), a rule's hit and the classification it becomes, sizes, ranks. Pure."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..catalogue import EXCEPTION_RULES, classify_exit

MAX_TEXT_CHARS = 2_000_000
"""Characters of one text that are read: the first :data:`HEAD_CHARS` and the last ones."""
HEAD_CHARS = 400_000
MAX_HITS = 32
"""Occurrences of one needle that a rule examines."""
WINDOW_BEFORE = 400
WINDOW_AFTER = 6_000
"""A rule's regexes see this many characters before and after an occurrence of its needle."""
MAX_LINE_CHARS = 500
MAX_LINES = 6
TRACEBACK_TAIL_CHARS = 256_000
"""The Python-traceback fallback parses at most this much of the end of a text."""

Facts = Dict[str, Any]


@dataclass(frozen=True)
class Classification:
    """What an error text means.

    ``category``/``subtype``: a catalogue kind. ``rule``: the rule that decided (see the module table).
    ``confidence``: 0..1, how specific the evidence is (an exact PyTorch/NCCL message with parsed fields
    ~0.9; a generic phrase ~0.5). ``headline``: one line naming what was parsed, fit for an incident
    title. ``facts``: the parsed details (JSON-ready; sizes in bytes). ``lines``: the matching text
    line(s), prefixes stripped, each at most :data:`MAX_LINE_CHARS`. ``note``: what the match implies,
    for a summary. ``also``: other rules that matched the same text."""

    category: str
    subtype: str
    rule: str
    confidence: float
    headline: str
    facts: Mapping[str, Any] = field(default_factory=dict)
    lines: Tuple[str, ...] = ()
    note: str = ""
    also: Tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``"category/subtype"``."""
        return f"{self.category}/{self.subtype}"


# ----------------------------------------------------------------------------------------------------
# The text as the rules see it


_PREFIX_RE = re.compile(r"\[(?P<stream>[A-Za-z_]{1,32}\d{1,7})\]:(?: )?")
_STREAM_RANK_RE = re.compile(r"(?:rank|default)(\d+)$")


class _Text:
    """A text with launcher prefixes stripped in place (a multi-line C++ message carries the prefix on
    its first line only, so lines keep their order); ``lower`` for needles; ``stream_at(pos)`` names the
    prefix of the line at ``pos`` ("" for an unprefixed line)."""

    def __init__(self, raw: str, scan: FrozenSet[str] = frozenset()) -> None:
        if len(raw) > MAX_TEXT_CHARS:
            raw = raw[:HEAD_CHARS] + "\n" + raw[-(MAX_TEXT_CHARS - HEAD_CHARS):]
        lines: List[str] = []
        self.starts: List[int] = []    # offset of each prefixed line ...
        self.streams: List[str] = []   # ... and its prefix; unprefixed lines are not listed
        self.ends: List[int] = []
        offset = 0
        for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            match = _PREFIX_RE.match(line)
            if match:
                line = line[match.end():]
                self.starts.append(offset)
                self.streams.append(match.group("stream"))
                self.ends.append(offset + len(line))
            lines.append(line)
            offset += len(line) + 1
        self.text = "\n".join(lines) + "\n"
        self.lower = self.text.lower()
        lower = self.lower
        self.scanned = scan
        ascii_only = lower.isascii()  # O(1): CPython keeps the flag
        self.present: FrozenSet[str] = frozenset([n for n in scan if (not ascii_only or n.isascii())
                                                  and n in lower])
        """The needle pre-scan: which of ``scan`` (every rule's needles, :data:`..GATES`) occur -- one
        pass per needle over the text, shared by all rules (a rule whose needles are all absent is not
        run; ``has`` answers the others from it). A needle with a non-ASCII character cannot occur in an
        ASCII text: it is not searched there."""

    def has(self, needle: str) -> bool:
        """Whether ``needle`` (lower case) occurs: the pre-scan's answer, else one ``str.find``."""
        if needle in self.scanned:
            return needle in self.present
        return needle in self.lower

    def find_all(self, needle: str, start: int = 0) -> Iterator[int]:
        """Positions of ``needle`` (lower case) in the text, at most :data:`MAX_HITS`."""
        if start == 0 and needle in self.scanned and needle not in self.present:
            return
        found = 0
        pos = self.lower.find(needle, start)
        while pos >= 0 and found < MAX_HITS:
            yield pos
            found += 1
            pos = self.lower.find(needle, pos + max(1, len(needle)))

    def first(self, *needles: str) -> int:
        """The earliest position of any of ``needles``, or -1."""
        best = -1
        scanned, present = self.scanned, self.present
        for needle in needles:
            if needle in scanned and needle not in present:
                continue
            pos = self.lower.find(needle)
            if pos >= 0 and (best < 0 or pos < best):
                best = pos
        return best

    def window(self, pos: int, before: int = WINDOW_BEFORE, after: int = WINDOW_AFTER) -> Tuple[int, str]:
        """``(offset, text)`` of the bounded window around ``pos``."""
        start = max(0, pos - before)
        return start, self.text[start: pos + after]

    def line_at(self, pos: int) -> str:
        """The line containing ``pos``, cut to :data:`MAX_LINE_CHARS` around ``pos``."""
        start = self.text.rfind("\n", max(0, pos - MAX_LINE_CHARS), pos) + 1
        if start == 0 and pos > MAX_LINE_CHARS:
            start = pos - MAX_LINE_CHARS // 4
        end = self.text.find("\n", pos, pos + MAX_LINE_CHARS)
        if end < 0:
            end = min(len(self.text), start + MAX_LINE_CHARS)
        line = self.text[start:end].strip()
        return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "..."

    def stream_at(self, pos: int) -> str:
        index = bisect.bisect_right(self.starts, pos) - 1
        if index >= 0 and pos <= self.ends[index]:
            return self.streams[index]
        return ""


@dataclass
class _Hit:
    """One rule's match."""

    category: str
    subtype: str
    confidence: float
    pos: int
    facts: Facts
    headline: str
    note: str = ""
    extra_lines: Tuple[int, ...] = ()   # further positions whose lines are evidence
    supporting: bool = False            # never the classification; only adds facts (ENRICHING_RULES)
    rule: str = ""


_Rule = Callable[[_Text], Optional[_Hit]]


def _search(pattern: re.Pattern[str], t: _Text, pos: int, before: int = WINDOW_BEFORE,
            after: int = WINDOW_AFTER) -> Optional[Tuple[int, re.Match[str]]]:
    offset, text = t.window(pos, before, after)
    match = pattern.search(text)
    return (offset, match) if match else None


_BRACKET_RANK_RE = re.compile(r"\[(?:(?P<pg>PG [^\]\n]{0,80}) )?Rank (?P<rank>\d+)\]")
_DEFAULT_PG_RE = re.compile(r"^PG (?:ID )?0\b|default_pg")
"""A ``[PG ...]`` tag of the default process group (``PG ID 0 PG GUID 0(default_pg)``, ``PG 0``), whose
ranks are the global ranks."""


def _rank_of(t: _Text, pos: int, facts: Facts) -> Optional[int]:
    """The rank the text names for ``pos``: ``facts["rank"]``, else the line's ``[rankN]:`` prefix, else a
    ``[Rank N]`` / ``[PG ... Rank N]`` tag on its line. The launcher's prefix is the process's global rank;
    the tag is its rank *within the process group* the message is about (``[rank9]:... [PG ID 5 PG GUID
    55(mesh_replicate) Rank 1]``: global rank 9 is rank 1 of sub-group 5), the same number only in the
    default group -- so the prefix wins where both are there, and a tag of another group alone is kept as
    ``facts["pg_rank"]`` (with ``facts["pg"]``), not as the rank (None: the caller's stream names it)."""
    rank = facts.get("rank")
    if isinstance(rank, int):
        return rank
    match = _STREAM_RANK_RE.search(t.stream_at(pos))
    if match:
        facts["rank"] = int(match.group(1))
        return facts["rank"]
    line_start = t.text.rfind("\n", max(0, pos - MAX_LINE_CHARS), pos) + 1
    tag = _BRACKET_RANK_RE.search(t.text, line_start, pos + 200)
    if tag is not None:
        group = tag.group("pg")
        if group and not _DEFAULT_PG_RE.search(group):
            facts.setdefault("pg", group)
            facts.setdefault("pg_rank", int(tag.group("rank")))
            return None
        facts["rank"] = int(tag.group("rank"))
        return facts["rank"]
    return None


def _on_rank(rank: Optional[int]) -> str:
    return f" on rank {rank}" if rank is not None else ""


_INT_RE = re.compile(r"-?\d+")


def _ints(text: str) -> List[int]:
    return [int(x) for x in _INT_RE.findall(text[:40_000])[:4096]]


def _shorten(text: str, most: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 3] + "..."


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in list(ranks)[:16])
    return shown + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


SIGBUS = 7


def _exit_kind(code: int) -> Tuple[str, str, str]:
    """The kind of an exit the *text* reports (a launcher's exit code, a signal it names): the exit decision
    path, except that a death by SIGBUS (-7, 135) is ``process/exit`` -- the exit path's 'aborted: OOM or a
    CUDA error' for 134/135 is about SIGABRT; a bus error is shared memory or a mapped file (the DataLoader's
    own 'Unexpected bus error' line says so too)."""
    verdict = classify_exit(code)
    if verdict is None:
        return "process", "exit", "exit code 0"
    if verdict.signal == SIGBUS or (not verdict.signal and verdict.exit_code == 128 + SIGBUS):
        return "process", "exit", verdict.describe()
    return verdict.category, verdict.subtype, verdict.describe()


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


_TYPE_RULES = tuple((rule, re.compile(rule.pattern, re.IGNORECASE) if rule.pattern else None)
                    for rule in EXCEPTION_RULES)
