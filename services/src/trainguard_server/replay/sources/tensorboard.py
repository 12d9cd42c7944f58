"""TensorBoard event files (``events.out.tfevents.*``, as ``torch.utils.tensorboard.SummaryWriter``,
Lightning's TensorBoardLogger, HF's TensorBoardCallback, Megatron's writer write them), read with the
``tensorboard`` package's own event reader (``LegacyEventFileLoader``: the parsed events, without converting
every value to a tensor; an optional dependency of the server: ``pip install tensorboard``).

Contract: an input is one event file or a run folder (its event files, read in name order: the names start
with the writer's start time). Scalars only -- ``simple_value`` and scalar tensors of the ``scalars``
plugin; images, histograms, text and hparams are skipped (counted). Consecutive events of the same step
form one record (a writer flushes a step's scalars together), timed at its first event's ``wall_time``; a
step seen again later (a restart) is a new record. Memory: one step's scalars at a time. When the
``crc32c`` package is installed the reader's record checksum uses it (the same CRC-32C, in C; the
tensorboard stub's is pure Python, ~1 µs a byte).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from .base import MissingLibrary, RawRecord, Source

TFEVENTS = "tfevents"


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
        return sum(p.stat().st_size for p in _event_files(self.path))

    def raw(self) -> Iterator[RawRecord]:
        loader_cls, tensor_util = _loader()
        stats = self.stats
        position = -1
        group: Dict[str, Any] = {}
        step = -1
        time_ns: Optional[int] = None
        for path in _event_files(self.path):
            done = 0
            loader = loader_cls(str(path))
            for event in loader.Load():
                stats.lines += 1
                size = event.ByteSize() + 16
                done += size
                self._bytes(size)
                if not event.HasField("summary"):
                    continue
                values: Dict[str, Any] = {}
                for v in event.summary.value:
                    kind = v.WhichOneof("value")
                    if kind == "simple_value":
                        values[v.tag] = v.simple_value
                    elif kind == "tensor" and v.metadata.plugin_data.plugin_name == "scalars":
                        try:
                            values[v.tag] = float(tensor_util.make_ndarray(v.tensor).item())
                        except (ValueError, TypeError):
                            stats.non_numeric[v.tag] += 1
                    else:
                        stats.non_numeric[v.tag] += 1
                if not values:
                    continue
                if event.step != step and group:
                    position += 1
                    yield RawRecord(position + 1, position, group, native=True, step=step, time_ns=time_ns)
                    group = {}
                if not group:
                    step, time_ns = event.step, int(event.wall_time * 1e9)
                group.update(values)
        if group:
            position += 1
            yield RawRecord(position + 1, position, group, native=True, step=step, time_ns=time_ns)
