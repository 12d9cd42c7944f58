"""HF Trainer's printed logs: the dict it prints per ``logging_steps`` (``PrinterCallback``'s ``print(logs)``
with ``disable_tqdm``, ``ProgressCallback``'s ``tqdm.write(str(logs))`` otherwise)::

    {'loss': 0.6931, 'grad_norm': 1.2345, 'learning_rate': 5e-05, 'epoch': 0.5}

Contract: a line that is a Python dict literal of numbers (``ast.literal_eval``; ``nan``/``inf`` as the
Trainer prints them) with a ``loss`` or ``eval_*`` key is a record; the end-of-training summary
(``train_runtime``) is left out, as in ``trainer_state.json``. The lines carry no step: records are numbered
by position (0, 1, ...) unless a ``step`` key is present -- ``--map``/``--step-field`` cannot recover
``logging_steps``; prefer ``trainer_state.json`` when the output dir has one. Streamed line by line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Dict, Iterator

from .base import RawRecord, Source
from .megatron import head_matches

DICT_LINE = re.compile(r"^\{'(?:loss|eval_[a-z_]+|grad_norm|learning_rate|train_runtime)': ", re.MULTILINE)
_NON_FINITE = re.compile(r"(?<![\w'])(nan|inf|-inf)(?![\w'])")
SUMMARY_FIELD = "train_runtime"


class HfLogSource(Source):
    """HF Trainer stdout/stderr with its printed log dicts (see the module doc)."""

    format = "hf-log"

    @staticmethod
    def detect(path: Path) -> bool:
        return head_matches(path, DICT_LINE)

    def raw(self) -> Iterator[RawRecord]:
        stats = self.stats
        position = -1
        with open(self.path, "rb") as fh:
            for number, data in enumerate(fh, 1):
                self._bytes(len(data))
                line = data.decode("utf-8", "replace").strip()
                if not DICT_LINE.match(line) or not line.endswith("}"):
                    continue
                stats.lines += 1
                position += 1
                try:
                    parsed: Any = ast.literal_eval(_NON_FINITE.sub(r"'\1'", line))
                except (ValueError, SyntaxError) as exc:
                    stats.bad(number, f"not a dict literal ({exc.__class__.__name__})")
                    continue
                if not isinstance(parsed, dict):
                    continue
                if SUMMARY_FIELD in parsed:
                    for name in parsed:
                        self.recognizer.note_ignored(name, "end-of-training summary (HF log)")
                    continue
                fields: Dict[str, Any] = {str(k): v for k, v in parsed.items()}
                yield RawRecord(number, position, fields)
