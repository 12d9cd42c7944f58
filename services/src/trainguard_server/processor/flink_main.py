"""Run the Flink job (``python -m trainguard_server.processor.flink_main``) in the Flink venv.

* ``--records FILE``: a bounded source: FILE holds queue record values (serialized IngestRequest
  batches), each as a 4-byte big-endian length and the bytes (:func:`write_records` writes it). The job runs
  on a local mini-cluster and ends when the records are processed; results go to a ``FileSink`` in
  ``--out DIR`` as JSON lines (part files). This is what the conformance test and ``bench/`` run. As the
  Kafka graph reads a topic, it reads with one reader per slot (``--parallelism``), each a part of the
  runs in their order (:func:`partition_records`), and decodes chained to its reader: with one reader
  for every slot, the slot that held it decoded every record besides its share of the runs (issue 20).
* ``--kafka BOOTSTRAP``: the production graph: Flink's Kafka connector reads the gateway's topic
  (``--topic``, committed offsets of ``--group-id``, record values as byte arrays) and writes the JSON
  upserts to ``--results-topic`` (at-least-once: upserts are idempotent); runs tick on processing time
  every ``--tick-s``. The connector jars come from ``--jars`` (``.venv-flink/jars``, tools/flink_jars.py).

The mini-cluster's Python workers are this interpreter (``python.executable``) with the caller's
``PYTHONPATH`` (the SDK's wire schema, the engine ``trainguard_engine`` and this package must be importable).
They run as one process per slot, as on a real cluster, not in PyFlink's default "loopback" mode for a
local mini-cluster, where every slot's Python functions run in this client process under one GIL
(parallelism 2 was no faster than 1 there: bench/scale.py, issue 20).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence

from .embedded import GC_GEN0_THRESHOLD

PYTHON_WORKER_MODE = "_python_worker_execution_mode"
"""PyFlink's switch between "loopback" (a local mini-cluster's Python functions in the client process, its
default there) and "process" (a Python worker process per slot, as on a cluster): see the module doc."""


BOUNDED_JVM_ARGS = "-XX:TieredStopAtLevel=1"
"""The JVM of a ``--records`` job (a local mini-cluster living seconds to minutes) compiles with C1 only: on
16 SDK-shaped runs C2 spent ~6 s of CPU compiling (~half the JVM's CPU, on a 2-core machine beside the
Python workers) for code that moves bytes; C1 alone cut the job's CPU by ~30 %, start-up included
(bench/scale.py, issue 20). ``JVM_ARGS`` set by the caller wins (``JVM_ARGS=""``: the JVM's default). A
long-running cluster (``--kafka``) keeps its own JVM options."""


BUNDLE_SIZE = 100_000
"""``python.fn-execution.bundle.size`` of the job (``--bundle-size``): how many elements a Python operator
takes before the JVM ends its bundle. Flink 2.3's default, 1,000, ended a run-stage bundle every 1,000
records, and each end is a synchronous round trip in which the worker writes back the state of every key
it touched -- with 16 live runs on a slot, 16 pipelines pickled per 1,000 records, while the JVM waited (at
parallelism 2: 696 picklings and 30 CPU seconds in the busy span, against 60 and 16 at 100,000; issue 20,
stop 32). Bundles still end on ``python.fn-execution.bundle.time``'s timer, at each checkpoint and at the
end of the input; what is in flight to a worker stays bounded by its data channel (Beam's queue of 5 chunks
of ~1 MB), not by the bundle, so memory does not grow with it. Bundles are invisible to the results and to
exactly-once (a checkpoint ends the bundle first)."""


GC_GEN0_ENV = "TRAINGUARD_PROCESSOR_GC_GEN0_THRESHOLD"
"""``trainguard serve``'s setting (config.py ``processor_gc_gen0_threshold``): the job's default for
``--gc-gen0-threshold`` too, so one deployment's value reaches the Flink workers that run its pipelines."""


def gc_gen0_default() -> int:
    """``--gc-gen0-threshold``'s default: :data:`GC_GEN0_ENV` when set, else ``GC_GEN0_THRESHOLD``."""
    raw = os.environ.get(GC_GEN0_ENV, "").strip()
    if not raw:
        return GC_GEN0_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{GC_GEN0_ENV}={raw!r}: not an integer") from None
    if value < 0:
        raise SystemExit(f"{GC_GEN0_ENV}={raw!r}: must be >= 0")
    return value


def write_records(path: Path, values: Iterable[bytes]) -> int:
    """Write record values in the ``--records`` format; returns how many."""
    count = 0
    with open(path, "wb") as fh:
        for value in values:
            fh.write(struct.pack(">I", len(value)))
            fh.write(value)
            count += 1
    return count


def write_lines(path: Path, values: Iterable[bytes]) -> None:
    """Write record values as base64 text lines (what the bounded job's file source reads)."""
    with open(path, "w", encoding="ascii") as fh:
        for value in values:
            fh.write(base64.b64encode(value).decode("ascii"))
            fh.write("\n")


def partition_records(values: Sequence[bytes], parts: int) -> List[List[bytes]]:
    """``values`` (serialized IngestRequests) as ``parts`` lists for the bounded job's ``parts`` readers, as
    the gateway's topic is partitioned: every run's envelopes in one part, in their order (a record of
    several runs is split into one IngestRequest per run, as the job's decode splits it), each part in
    the order of ``values``. Runs go to parts largest first, each to the part with the fewest records so
    far, so the readers -- and the decoding chained to them -- share the stream evenly (hashing 16 runs
    onto 2 parts left one with 60 %). Values that are not IngestRequests, or hold no envelope, are
    dropped (the job would drop them). Import PyFlink-free: the job's decode runs here too."""
    from .flink_stages import decode_record

    keyed = [decode_record(value) for value in values]
    sizes: Dict[str, int] = {}
    for pieces in keyed:
        for key, _ in pieces:
            sizes[key] = sizes.get(key, 0) + 1
    loads = [0] * max(1, parts)
    owner: Dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        owner[key] = loads.index(min(loads))
        loads[owner[key]] += sizes[key]
    out: List[List[bytes]] = [[] for _ in loads]
    for pieces in keyed:
        for key, raw in pieces:
            out[owner[key]].append(raw)
    return out


def read_records(path: Path) -> List[bytes]:
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (size,) = struct.unpack_from(">I", data, pos)
        out.append(data[pos + 4:pos + 4 + size])
        pos += 4 + size
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without PyFlink: deploy files are checked against it)."""
    parser = argparse.ArgumentParser(prog="python -m trainguard_server.processor.flink_main",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, help="bounded source: a records file")
    parser.add_argument("--out", type=Path, help="with --records: the results folder (JSON-line part files)")
    parser.add_argument("--kafka", help="bootstrap servers: the gateway's topic in, the results topic out")
    parser.add_argument("--topic", default=os.environ.get("TRAINGUARD_KAFKA_TOPIC", "trainguard.ingest"))
    parser.add_argument("--results-topic", default="trainguard.results")
    parser.add_argument("--group-id", default="trainguard-flink")
    parser.add_argument("--client-config", default=os.environ.get("TRAINGUARD_KAFKA_CLIENT_CONFIG") or "{}",
                        help="JSON object of Kafka client properties for the source and the sink")
    parser.add_argument("--tick-s", type=float, default=1.0, help="--kafka: processing-time tick of a run")
    parser.add_argument("--jars", type=Path, default=Path(sys.prefix) / "jars",
                        help="folder of connector jars put on the job's classpath (tools/flink_jars.py)")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--overrides", default=os.environ.get("TRAINGUARD_DETECTION_OVERRIDES", "{}"))
    parser.add_argument("--settle-s", type=float, default=None)
    parser.add_argument("--gc-gen0-threshold", type=int, default=gc_gen0_default(),
                        help="young-generation collection threshold of the workers that run pipelines "
                             "(default: TRAINGUARD_PROCESSOR_GC_GEN0_THRESHOLD, serve's setting, else "
                             f"{GC_GEN0_THRESHOLD}: processor/embedded.py GC_GEN0_THRESHOLD; 0: the "
                             "interpreter's kept)")
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--bundle-size", type=int, default=BUNDLE_SIZE,
                        help="python.fn-execution.bundle.size: elements per Python bundle (see BUNDLE_SIZE)")
    parser.add_argument("--checkpoint-dir", default=os.environ.get("TRAINGUARD_FLINK_CHECKPOINT_DIR"),
                        help="where checkpoints are written (a path or URI); default: for --records a "
                             "temporary folder, removed when the job ends; for --kafka the cluster's "
                             "configuration (execution.checkpointing.dir)")
    parser.add_argument("--restart-attempts", type=int, default=None,
                        help="restarts before the job fails (default: 3 for --records; for --kafka the "
                             "cluster's configuration; applies with --checkpoint-dir or --records)")
    return parser


def checkpoint_config(config: Any, checkpoint_dir: str, restart_attempts: int | None) -> None:
    """Checkpoints go to files under ``checkpoint_dir``, not to the JobManager's memory: the mini-cluster's
    default (``JobManagerCheckpointStorage``) refuses a subtask's state over 5 MiB, and a failed checkpoint
    fails the job, which restores and grows past the limit again -- a restart loop that never ends (issue
    20: parallelism 1 on 16 runs; bench/scale.py saw PyFlink's worker fail re-registering state
    serializers). ``restart_attempts``: a bounded job fails after that many restarts instead of looping."""
    uri = checkpoint_dir if "://" in checkpoint_dir else Path(checkpoint_dir).resolve().as_uri()
    config.set_string("execution.checkpointing.storage", "filesystem")
    config.set_string("execution.checkpointing.dir", uri)
    if restart_attempts is not None:
        config.set_string("restart-strategy.type", "fixed-delay")
        config.set_string("restart-strategy.fixed-delay.attempts", str(restart_attempts))
        config.set_string("restart-strategy.fixed-delay.delay", "1 s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if bool(ns.records) == bool(ns.kafka):
        parser.error("give --records FILE --out DIR, or --kafka BOOTSTRAP")

    from pyflink.common import Configuration, Encoder
    from pyflink.datastream import RuntimeExecutionMode, StreamExecutionEnvironment

    from .flink_job import SETTLE_S, build_job

    os.environ.setdefault(PYTHON_WORKER_MODE, "process")  # read by the environment's constructor below
    if ns.records:  # the mini-cluster's JVM starts below (pyflink_gateway_server reads JVM_ARGS)
        os.environ.setdefault("JVM_ARGS", BOUNDED_JVM_ARGS)
    config = Configuration()
    # --kafka without --checkpoint-dir: the cluster's own configuration (Helm's flinkConfiguration) decides
    scratch = Path(tempfile.mkdtemp(prefix="trainguard-flink-")) if ns.records else None
    if ns.checkpoint_dir or scratch:
        checkpoint_config(config, str(ns.checkpoint_dir or (scratch and scratch / "checkpoints")),
                          ns.restart_attempts if ns.restart_attempts is not None or ns.kafka else 3)
    config.set_string("python.fn-execution.bundle.size", str(ns.bundle_size))
    config.set_string("python.executable", sys.executable)
    config.set_string("python.client.executable", sys.executable)
    jars = sorted(ns.jars.glob("*.jar")) if ns.jars.is_dir() else []
    if jars:
        config.set_string("pipeline.jars", ";".join(j.resolve().as_uri() for j in jars))
    env = StreamExecutionEnvironment.get_execution_environment(config)
    env.set_runtime_mode(RuntimeExecutionMode.STREAMING)
    env.set_parallelism(ns.parallelism)
    env.enable_checkpointing(ns.checkpoint_ms)
    overrides = json.loads(ns.overrides)
    settle = SETTLE_S if ns.settle_s is None else ns.settle_s
    if ns.records:
        from pyflink.common import WatermarkStrategy
        from pyflink.datastream.connectors.file_system import (
            FileSink,
            FileSource,
            OutputFileConfig,
            StreamFormat,
        )

        if ns.out is None:
            parser.error("--records needs --out")
        assert scratch is not None
        lines = scratch / "records"
        lines.mkdir()
        for i, part in enumerate(partition_records(read_records(ns.records), ns.parallelism)):
            write_lines(lines / f"part-{i:04d}.b64", part)
        # the JVM reads them itself, as a Kafka source would (no transfer of every record from this process):
        # one reader per slot, each file whole and in order (a text file is one split), as Kafka partitions
        records = (env.from_source(FileSource.for_record_stream_format(StreamFormat.text_line_format(),
                                                                      str(lines)).build(),
                                   WatermarkStrategy.no_watermarks(), "records")
                   .set_parallelism(ns.parallelism))
        sink = (FileSink.for_row_format(str(ns.out), Encoder.simple_string_encoder())
                .with_output_file_config(OutputFileConfig.builder().with_part_suffix(".jsonl").build())
                .build())
        build_job(records, sink, source_parallelism=ns.parallelism, overrides=overrides, settle_s=settle,
                  gc_gen0_threshold=ns.gc_gen0_threshold)
        try:
            env.execute("trainguard (bounded)")
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        return 0
    return run_kafka(env, ns, overrides, settle)


def run_kafka(env: Any, ns: argparse.Namespace, overrides: dict, settle: float) -> int:
    """The production graph: the gateway's topic in, the results topic out (Flink's Kafka connector)."""
    from pyflink.common import Types, WatermarkStrategy
    from pyflink.common.serialization import SimpleStringSchema
    from pyflink.datastream.connectors.base import DeliveryGuarantee
    from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink, KafkaSource
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import load_java_class

    from .flink_job import build_job

    client = json.loads(ns.client_config)
    builder = (KafkaSource.builder().set_bootstrap_servers(ns.kafka).set_topics(ns.topic)
               .set_group_id(ns.group_id))
    # two settings through the JVM: PyFlink's wrappers name the SQL connector's shaded Kafka classes, and
    # it has no value-only byte-array schema (record values are serialized IngestRequests)
    jvm = get_gateway().jvm
    builder._j_builder.setStartingOffsets(
        jvm.org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer.committedOffsets(
            jvm.org.apache.kafka.clients.consumer.OffsetResetStrategy.EARLIEST))
    schemas = jvm.org.apache.flink.connector.kafka.source.reader.deserializer
    builder._j_builder.setDeserializer(schemas.KafkaRecordDeserializationSchema.valueOnly(
        load_java_class("org.apache.kafka.common.serialization.ByteArrayDeserializer")))
    for key, value in client.items():
        builder.set_property(str(key), str(value))
    records = env.from_source(builder.build(), WatermarkStrategy.no_watermarks(), "gateway topic",
                              type_info=Types.PRIMITIVE_ARRAY(Types.BYTE()))
    sink_builder = (KafkaSink.builder().set_bootstrap_servers(ns.kafka)
                    .set_record_serializer(KafkaRecordSerializationSchema.builder()
                                           .set_topic(ns.results_topic)
                                           .set_value_serialization_schema(SimpleStringSchema()).build())
                    .set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE))  # upserts: idempotent
    for key, value in client.items():
        sink_builder.set_property(str(key), str(value))
    build_job(records, sink_builder.build(), source_parallelism=ns.parallelism, overrides=overrides,
              settle_s=settle, processing_time_s=ns.tick_s, gc_gen0_threshold=ns.gc_gen0_threshold)
    env.execute("trainguard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
