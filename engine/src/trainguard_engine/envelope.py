"""The envelope as the pipeline reads it (:class:`ReadEnvelope`), in its own module.

Left pure Python when the engine is compiled (engine/native_build.py): the processor's native reader
(trainguard_server.processor._fastread) builds these objects itself through the class's ``__slots__``
member descriptors, which a compiled class has not. ``trainguard_engine.pipeline`` imports it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass
class ReadEnvelope:
    """An envelope as the pipeline reads it (``pipeline._parse``): its payload ``kind`` and ``body`` (the
    payload's mapping), its header fields typed (absent ones as proto3 defaults, ``world_size`` at least
    1, ``run_id`` never empty) and ``raw``, the envelope's JSON mapping. A runtime that decoded an envelope
    from the wire itself may hand :meth:`Pipeline.process` this in place of the dict (the processor does
    for plain metric batches: ``trainguard_server.processor.decode.read_request``); the pipeline then reads
    nothing from ``raw``: it must hold exactly what :func:`_parse` would read from ``raw``."""

    __slots__ = ("body", "event_id", "host", "kind", "pid", "project", "rank", "raw", "run_id", "run_name",
                 "step", "time_ns", "trace_id", "world_size")
    raw: Mapping[str, Any]
    kind: str
    body: Mapping[str, Any]
    event_id: str
    project: str
    run_id: str
    rank: int
    step: int
    time_ns: int
    host: str
    pid: int
    world_size: int
    run_name: str
    trace_id: str
