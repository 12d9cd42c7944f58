"""Megatron-LM's training log lines (``megatron/training/training.py``, ``training_log()``)::

     [2026-03-01 12:00:00] iteration      100/    1000 | consumed samples:         3200 | elapsed time per
     iteration (ms): 412.3 | learning rate: 1.500000E-04 | global batch size:    32 | lm loss: 3.201000E+00 |
     loss scale: 65536.0 | grad norm: 1.234 | number of skipped iterations:   0 |

Contract: a line with ``iteration N/ M |`` is a record at step N, timed by its leading ``[date time]`` when
it has one (local time, as ``datetime.now()`` printed it); every other ``|``-separated ``name: value`` (or
older ``name value``) is a field, named as printed (``lm loss``, ``grad norm``, ``loss scale``,
``elapsed time per iteration (ms)``: the synonym table knows them). Other lines are not metrics (pass the
same file as a log to import them as log lines). Streamed line by line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, Optional

from ..times import leading_timestamp
from .base import RawRecord, Source

ITERATION = re.compile(r"\biteration\s+(?P<n>\d+)\s*/\s*(?P<of>\d+)\s*\|")
_FIELD = re.compile(
    r"^\s*(?P<name>[^:|]+?)\s*:?\s+(?P<value>[-+]?(?:\d[\d.]*(?:[eE][-+]?\d+)?|nan|inf)|"
    r"[-+]?(?:nan|inf))\s*$",
    re.IGNORECASE,
)
HEAD = 1 << 16


def head_matches(path: Path, pattern: re.Pattern[str]) -> bool:
    """Whether a line in the first 64 KiB of the text file ``path`` matches ``pattern``."""
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        head = fh.read(HEAD)
    if b"\x00" in head:
        return False
    return pattern.search(head.decode("utf-8", "replace")) is not None


class MegatronLogSource(Source):
    """A Megatron-LM text log (see the module doc)."""

    format = "megatron"

    @staticmethod
    def detect(path: Path) -> bool:
        return head_matches(path, ITERATION)

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        year = 1970
        position = -1
        with open(self.path, "rb") as fh:
            for number, data in enumerate(fh, 1):
                self._bytes(len(data))
                line = data.decode("utf-8", "replace")
                m = ITERATION.search(line)
                if m is None:
                    continue
                stats.lines += 1
                position += 1
                time_ns: Optional[int] = leading_timestamp(line.lstrip(), year)
                fields: Dict[str, str] = {}
                for part in line[m.end() :].split("|"):
                    f = _FIELD.match(part)
                    if f is not None:
                        fields[f.group("name").strip()] = f.group("value")
                yield RawRecord(
                    number, position, fields, native=True, step=int(m.group("n")), time_ns=time_ns
                )
