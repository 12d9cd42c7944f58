"""TensorBoard event files (``events.out.tfevents.*``, as ``torch.utils.tensorboard.SummaryWriter``,
Lightning's TensorBoardLogger, HF's TensorBoardCallback, Megatron's writer write them), read with the
``tensorboard`` package's own event reader (``LegacyEventFileLoader``: the parsed events, without converting
every value to a tensor; an optional dependency of the server: ``pip install tensorboard``).

Contract: an input is one event file or a run folder (its event files, read in name order: the names start
with the writer's start time). Scalars only -- ``simple_value`` and scalar tensors of the ``scalars``
plugin; images, histograms, text and hparams are skipped (counted). Consecutive events of the same step form
one record (a writer flushes a step's scalars together), timed at its first event's ``wall_time``; a step
seen again later (a restart) is a new record. ``add_scalars(main_tag, {key: v})``'s subfolders
(``<main_tag>_<key>``, events tagged ``main_tag``) are the run's: their scalars are ``main_tag/key``
(``add_scalars("grad_norm", per_layer)`` gives per-layer norms), merged with the run's by step. Memory: one
step's scalars at a time. The reader stops at a torn or damaged record (a job killed mid-write): what was
read is imported and the rest counted as malformed, with its byte offset. When the ``crc32c`` package is
installed the reader's record checksum uses it (the same CRC-32C, in C; the tensorboard stub's is pure
Python, ~1 µs a byte).
"""

from __future__ import annotations

import heapq
import itertools
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .base import MissingLibrary, RawRecord, Source

TFEVENTS = "tfevents"
RECORD_FRAMING = 16
"""A TFRecord's bytes besides its event: length (8), its CRC (4), the data's CRC (4)."""


def _event_files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and TFEVENTS in p.name)


def _loader() -> Any:
    try:
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
        from tensorboard.util import tensor_util
    except ImportError:
        raise MissingLibrary("TensorBoard event files", "tensorboard") from None
    try:
        import crc32c as fast  # type: ignore[import-not-found,unused-ignore]

        pywrap_tensorflow.crc32c = fast.crc32c  # same checksum, in C
    except ImportError:
        pass
    return LegacyEventFileLoader, tensor_util


class TensorBoardSource(Source):
    """A TensorBoard run folder or event file (see the module doc)."""

    format = "tensorboard"

    @staticmethod
    def detect(path: Path) -> bool:
        if path.is_file():
            return TFEVENTS in path.name
        return path.is_dir() and any(TFEVENTS in p.name for p in path.iterdir() if p.is_file())

    def size(self) -> int:
        folders = (
            [self.path] + [f for f, _ in add_scalars_children(self.path)]
            if self.path.is_dir()
            else [self.path]
        )
        return sum(p.stat().st_size for f in folders for p in _event_files(f))

    def raw(self) -> Iterator[RawRecord]:
        loader_cls, tensor_util = _loader()
        children = add_scalars_children(self.path) if self.path.is_dir() else []
        streams = [self._scalars(loader_cls, tensor_util, p, None) for p in _event_files(self.path)]
        if children:  # add_scalars: the parent's and its children's events, merged by step
            streams += [
                self._scalars(loader_cls, tensor_util, p, rename)
                for folder, rename in children
                for p in _event_files(folder)
            ]
            events: Iterator[Tuple[int, float, Dict[str, float]]] = heapq.merge(
                *streams, key=lambda e: (e[0], e[1])
            )
        else:
            events = itertools.chain(*streams)
        position = -1
        group: Dict[str, Any] = {}
        step = -1
        time_ns: Optional[int] = None
        for event_step, wall_time, values in events:
            if event_step != step and group:
                position += 1
                yield RawRecord(position + 1, position, group, native=True, step=step, time_ns=time_ns)
                group = {}
            if not group:
                step, time_ns = event_step, int(wall_time * 1e9)
            group.update(values)
        if group:
            position += 1
            yield RawRecord(position + 1, position, group, native=True, step=step, time_ns=time_ns)

    def _scalars(
        self, loader_cls: Any, tensor_util: Any, path: Path, rename: Optional[Tuple[str, str]]
    ) -> Iterator[Tuple[int, float, Dict[str, float]]]:
        """(step, wall time, scalars) of each event of one file that has scalars; ``rename``: an
        add_scalars child's (main tag, its key): the tag becomes ``main_tag/key``."""
        stats = self.stats
        done = 0
        for event in loader_cls(str(path)).Load():
            stats.lines += 1
            size = event.ByteSize() + RECORD_FRAMING
            done += size
            self._bytes(size)
            if not event.HasField("summary"):
                continue
            values: Dict[str, float] = {}
            for v in event.summary.value:
                tag = f"{v.tag}/{rename[1]}" if rename is not None and v.tag == rename[0] else v.tag
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    values[tag] = v.simple_value
                elif kind == "tensor" and v.metadata.plugin_data.plugin_name == "scalars":
                    try:
                        values[tag] = float(tensor_util.make_ndarray(v.tensor).item())
                    except (ValueError, TypeError):
                        stats.non_numeric[tag] += 1
                else:
                    stats.non_numeric[tag] += 1
            if values:
                yield event.step, event.wall_time, values
        left = path.stat().st_size - done
        if left > 0:  # the reader stops quietly at a torn or damaged record: say so
            stats.bad(
                stats.lines + 1,
                f"{path.name}: a torn or damaged record at byte {done}, {left} bytes not read",
            )


def _first_tag(folder: Path) -> Optional[str]:
    """The tag of the first scalar in ``folder``'s first event file (None: none in its first events)."""
    loader_cls, _ = _loader()
    for path in _event_files(folder)[:1]:
        for n, event in enumerate(loader_cls(str(path)).Load()):
            if event.HasField("summary") and event.summary.value:
                return str(event.summary.value[0].tag)
            if n > 16:
                break
    return None


def add_scalars_children(folder: Path) -> List[Tuple[Path, Tuple[str, str]]]:
    """The subfolders ``SummaryWriter.add_scalars(main_tag, {key: value})`` wrote beside ``folder``'s own
    event files (``<main_tag with / as _>_<key>``, events tagged ``main_tag``), with (main tag, key)."""
    if not any(TFEVENTS in p.name for p in folder.iterdir() if p.is_file()):
        return []
    try:
        _loader()
    except MissingLibrary:
        return []  # told when the run is read
    found: List[Tuple[Path, Tuple[str, str]]] = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        if not any(TFEVENTS in p.name for p in sub.iterdir() if p.is_file()):
            continue
        tag = _first_tag(sub)
        prefix = tag.replace("/", "_") + "_" if tag else ""
        if tag and sub.name.startswith(prefix) and len(sub.name) > len(prefix):
            found.append((sub, (tag, sub.name[len(prefix) :])))
    return found
