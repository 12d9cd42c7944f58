"""A W&B run folder (``wandb/offline-run-*/`` or ``wandb/run-*/``): its ``run-<id>.wandb`` transaction log as
W&B's offline mode writes it, or an exported ``files/wandb-history.jsonl`` (``_step``, ``_timestamp``).

The ``.wandb`` file is W&B's record log: a 7-byte header (``:W&B``, 0xBEE1, version 0) then LevelDB-log
framing (32 KiB blocks of chunks: CRC-32C, length, type full/first/middle/last), each record a
``wandb.proto.wandb_internal_pb2.Record`` -- decoded with the ``wandb`` package's own protobuf classes (an
optional dependency: ``pip install wandb``). ``history`` records are the metrics: their items (``key`` or
``nested_key`` joined with ``/``; ``value_json``) with ``_step`` and ``_timestamp``; of the system stats
(sampled by time, every 15 s by default) the process RSS (``proc.memory.rssMB``, MiB) is a record of its
own at the latest history step, at its sample time; config and console output are skipped; the ``exit``
record gives the exit code. Streamed record by record; a torn tail (a crashed writer) ends the read,
counted as malformed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from .base import MissingLibrary, RawRecord, Source
from .jsonl import JsonlSource

HEADER = b":W&B"
HEADER_LEN = 7
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
HISTORY_JSONL = "files/wandb-history.jsonl"
STATS_RSS = "proc.memory.rssMB"
RSS_FIELD = "proc.memory.rss_mib"
"""W&B's system stats say ``rssMB`` for the process RSS in MiB (psutil's bytes / 2**20): imported as
``mem/rss``, at the latest history step before the sample."""


def _wandb_file(path: Path) -> Optional[Path]:
    if path.is_file() and path.suffix == ".wandb":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.wandb"))
        return found[0] if found else None
    return None


def records(path: Path) -> Iterator[bytes]:
    """The records of a ``.wandb`` file (raises ValueError on a bad header; stops at a torn tail)."""
    with open(path, "rb") as fh:
        head = fh.read(HEADER_LEN)
        if len(head) < HEADER_LEN or head[:4] != HEADER:
            raise ValueError("not a W&B transaction log (bad header)")
        offset = HEADER_LEN
        pending = b""
        while True:
            left = BLOCK - offset % BLOCK
            if left < CHUNK_HEADER:
                fh.read(left)
                offset += left
            head = fh.read(CHUNK_HEADER)
            if len(head) < CHUNK_HEADER:
                return
            _crc, length, kind = struct.unpack("<IHB", head)
            data = fh.read(length)
            offset += CHUNK_HEADER + length
            if len(data) < length:
                raise EOFError("torn record at the end")
            if kind == FULL:
                yield data
            elif kind == FIRST:
                pending = data
            elif kind == MIDDLE:
                pending += data
            elif kind == LAST:
                yield pending + data
                pending = b""
            elif kind == 0 and length == 0:
                continue  # zero padding
            else:
                raise EOFError(f"unknown chunk type {kind}")


class WandbRunSource(Source):
    """One W&B run folder or ``.wandb`` file (see the module doc)."""

    format = "wandb"
    _exit: Optional[int] = None

    def exit_code(self) -> Optional[int]:
        """The run's exit record (``wandb.finish(exit_code=...)``; the process's code when W&B saw it)."""
        return self._exit

    @staticmethod
    def detect(path: Path) -> bool:
        return _wandb_file(path) is not None or (path.is_dir() and (path / HISTORY_JSONL).is_file())

    def size(self) -> int:
        found = _wandb_file(self.path)
        if found is None:
            return (self.path / HISTORY_JSONL).stat().st_size
        return found.stat().st_size

    def raw(self) -> Iterator[RawRecord]:
        found = _wandb_file(self.path)
        if found is None:
            inner = JsonlSource(self.path / HISTORY_JSONL, self.recognizer, self.options, key=self.key)
            inner.stats = self.stats
            yield from inner.raw()
            return
        try:
            from wandb.proto import wandb_internal_pb2 as pb  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            raise MissingLibrary("W&B .wandb files", "wandb") from None
        stats = self.stats
        position = -1
        index = 0
        last_step = -1
        try:
            for data in records(found):
                index += 1
                self._bytes(len(data) + CHUNK_HEADER)
                record = pb.Record()  # type: ignore[attr-defined,unused-ignore]
                try:
                    record.ParseFromString(data)
                except Exception as exc:  # protobuf's DecodeError: a damaged record
                    stats.bad(index, f"record {index}: not a W&B record ({exc})")
                    continue
                kind = record.WhichOneof("record_type")
                if kind == "exit":
                    self._exit = int(record.exit.exit_code)
                if kind == "stats" and last_step >= 0:
                    rss = {i.key: i.value_json for i in record.stats.item}.get(STATS_RSS)
                    if rss:
                        stats.lines += 1
                        position += 1
                        ts = record.stats.timestamp
                        yield RawRecord(
                            index,
                            position,
                            {RSS_FIELD: rss},
                            native=True,
                            step=last_step,
                            time_ns=ts.seconds * 10**9 + ts.nanos,
                        )
                    continue
                if kind != "history":
                    continue
                stats.lines += 1
                position += 1
                fields: Dict[str, Any] = {}
                for item in record.history.item:
                    key = "/".join(item.nested_key) if item.nested_key else item.key
                    try:
                        fields[key] = json.loads(item.value_json) if item.value_json else None
                    except ValueError:
                        stats.non_numeric[key] += 1
                if "_step" not in fields and record.history.HasField("step"):
                    fields["_step"] = record.history.step.num
                step_value = fields.get("_step")
                if isinstance(step_value, int) and not isinstance(step_value, bool):
                    last_step = step_value
                yield RawRecord(index, position, fields)
        except (ValueError, EOFError) as exc:
            stats.bad(index + 1, f"record {index + 1}: {exc}")
