"""DeepSpeed's progress lines (``deepspeed/runtime/engine.py``, ``_report_progress``, through ``log_dist``)::

    [2026-03-01 12:00:00,123] [INFO] [logging.py:128:log_dist] [Rank 0] step=100, skipped=2, lr=[0.0001],
    mom=[(0.9, 0.999)]

and its fp16 optimizer's overflow lines (``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale:
65536, reducing to 32768``).

Contract: a ``step=N, skipped=K, lr=[...]`` line is a record at step N (time: its leading timestamp) with
``lr`` (the first parameter group's) and ``amp/overflow`` = 1 when ``skipped`` grew since the previous such
line (DeepSpeed counts skipped steps cumulatively); the loss scale an OVERFLOW line reduced to is the next
record's ``loss_scale``. Streamed line by line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, Optional

from ..times import leading_timestamp
from .base import RawRecord, Source
from .megatron import head_matches

PROGRESS = re.compile(r"\bstep=(?P<step>\d+),\s*skipped=(?P<skipped>\d+),\s*lr=\[(?P<lr>[^\],]*)")
OVERFLOW = re.compile(r"OVERFLOW!.*reducing to (?P<scale>[\d.eE+-]+)")


class DeepSpeedLogSource(Source):
    """A DeepSpeed text log (see the module doc)."""

    format = "deepspeed"

    @staticmethod
    def detect(path: Path) -> bool:
        return head_matches(path, PROGRESS)

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        position = -1
        skipped: Optional[int] = None
        scale: Optional[str] = None
        with open(self.path, "rb") as fh:
            for number, data in enumerate(fh, 1):
                self._bytes(len(data))
                line = data.decode("utf-8", "replace")
                o = OVERFLOW.search(line)
                if o is not None:
                    scale = o.group("scale")
                    continue
                m = PROGRESS.search(line)
                if m is None:
                    continue
                stats.lines += 1
                position += 1
                now = int(m.group("skipped"))
                fields: Dict[str, str] = {
                    "lr": m.group("lr").strip(),
                    "overflow": "1" if skipped is not None and now > skipped else "0",
                }
                skipped = now
                if scale is not None:
                    fields["loss_scale"], scale = scale, None
                yield RawRecord(
                    number,
                    position,
                    fields,
                    native=True,
                    step=int(m.group("step")),
                    time_ns=leading_timestamp(line.lstrip(), 1970),
                )
