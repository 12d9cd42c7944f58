"""Reading the wild-log corpus and splitting it.

Layout: ``tests/fixtures/wild/<id>/`` holds ``log.txt`` (the pasted lines, cut but never edited),
``source.txt`` (the thread and what was cut) and ``label.json`` (see :class:`Label`).

**The split** is fixed before any tuning and does not depend on a log's content or label: a case is
held out when the first 8 hex digits of SHA-256 of its id, as an integer, are divisible by 3 (about a
third). A case added later falls on its side by the same rule, so a new log can never be moved to the
tuned part after a look at how the classifier does on it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
WILD = ROOT / "tests" / "fixtures" / "wild"
PARTS = ("tune", "heldout")
FRAMEWORKS = ("pytorch", "deepspeed", "megatron", "transformers", "accelerate", "lightning", "fairseq",
              "other")


def part_of(case_id: str) -> str:
    """``"heldout"`` for about a third of the ids (a hash rule fixed before tuning), else ``"tune"``."""
    digest = int(hashlib.sha256(case_id.encode("utf-8")).hexdigest()[:8], 16)
    return "heldout" if digest % 3 == 0 else "tune"


class LabelError(ValueError):
    """A ``label.json`` that does not follow the schema (the message names the case and field)."""


@dataclass(frozen=True)
class Label:
    """What a log shows, judged from its text and thread (never from the product's output).

    ``kind``: the root cause as a catalogue kind (``category/subtype``); ``culprit_rank``: the rank the
    text names as the failing one (None when it names none); ``multi_rank``: output of several ranks;
    ``consequences``: kinds the log also shows that follow from the root cause; ``uncertain``: the
    thread does not settle the root cause (scored, but reported apart).
    """

    kind: str
    culprit_rank: Optional[int]
    multi_rank: bool
    consequences: Tuple[str, ...]
    uncertain: bool
    framework: str
    torch_version: Optional[str]
    notes: str

    @property
    def category(self) -> str:
        return self.kind.split("/", 1)[0]

    @property
    def root_vs_consequence(self) -> bool:
        """Whether this log tests root cause vs consequence: several ranks and a consequence shown."""
        return self.multi_rank and bool(self.consequences)


@dataclass(frozen=True)
class Case:
    """One log of the corpus."""

    case_id: str
    path: Path
    label: Label

    @property
    def log(self) -> Path:
        return self.path / "log.txt"

    @property
    def part(self) -> str:
        return part_of(self.case_id)

    def lines(self) -> int:
        with open(self.log, "rb") as fh:
            return sum(1 for _ in fh)


def _field(doc: Dict[str, Any], name: str, types: Tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise LabelError(f"{where}: missing field {name!r}")
    value = doc[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise LabelError(f"{where}: field {name!r} has type {type(value).__name__}")
    return value


def parse_label(doc: Dict[str, Any], where: str, kinds: Optional[set] = None) -> Label:
    """A :class:`Label` from a ``label.json`` document; :class:`LabelError` naming the field if invalid.
    ``kinds``: the catalogue's kinds (``category/subtype``) every kind must be one of, when given."""
    kind = _field(doc, "kind", (str,), where)
    category = _field(doc, "category", (str,), where)
    if "/" not in kind or kind.split("/", 1)[0] != category:
        raise LabelError(f"{where}: category {category!r} is not the first part of kind {kind!r}")
    consequences = tuple(_field(doc, "consequences", (list,), where))
    for k in (kind, *consequences):
        if not isinstance(k, str) or (kinds is not None and k not in kinds):
            raise LabelError(f"{where}: {k!r} is not a catalogue kind")
    culprit = doc.get("culprit_rank")
    if culprit is not None and (isinstance(culprit, bool) or not isinstance(culprit, int) or culprit < 0):
        raise LabelError(f"{where}: culprit_rank must be a rank (int >= 0) or null, got {culprit!r}")
    framework = _field(doc, "framework", (str,), where)
    if framework not in FRAMEWORKS:
        raise LabelError(f"{where}: framework {framework!r} is not one of {FRAMEWORKS}")
    version = doc.get("torch_version")
    if version is not None and not isinstance(version, str):
        raise LabelError(f"{where}: torch_version must be a string or null")
    return Label(kind=kind, culprit_rank=culprit, multi_rank=bool(_field(doc, "multi_rank", (bool,), where)),
                 consequences=consequences, uncertain=bool(_field(doc, "uncertain", (bool,), where)),
                 framework=framework, torch_version=version, notes=str(doc.get("notes", "")))


def catalogue_kinds() -> set:
    """Every ``category/subtype`` the catalogue defines."""
    from trainguard_engine.catalogue import KINDS

    return set(KINDS)


def load(root: Path = WILD, *, kinds: Optional[set] = None) -> List[Case]:
    """Every case under ``root`` (a directory with ``log.txt``), sorted by id; raises
    :class:`LabelError` on a missing file or an invalid label."""
    cases = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        where = f"{root.name}/{path.name}"
        for name in ("log.txt", "source.txt", "label.json"):
            if not (path / name).is_file():
                raise LabelError(f"{where}: missing {name}")
        doc = json.loads((path / "label.json").read_text(encoding="utf-8"))
        cases.append(Case(path.name, path, parse_label(doc, where, kinds)))
    return cases
