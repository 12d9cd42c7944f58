"""Generated protobuf / gRPC code for the TrainGuard wire schema, version 1 (package ``trainguard.v1``).

Contents (all generated, never edit by hand):
  * ``events_pb2`` / ``events_pb2.pyi``: Envelope and its payloads (proto/trainguard/v1/events.proto);
  * ``ingest_pb2`` / ``ingest_pb2.pyi``: IngestRequest / IngestResponse / Rejection (ingest.proto);
  * ``ingest_pb2_grpc``: the IngestService client stub and server registration helpers.

Regenerate with ``python tools/gen_proto.py`` (grpcio-tools pinned in ``tools/requirements-proto.txt``);
``python tools/gen_proto.py --check`` proves the committed files are what the pinned generator produces.

This package imports nothing on purpose: protobuf and grpcio are optional extras (``trainguard[proto]``,
``trainguard[grpc]``), and ``import trainguard`` must work without them. Import the submodules explicitly
(``from trainguard.v1 import events_pb2``), or better use :mod:`trainguard.wire`, which converts between
these messages and the dict form the SDK uses.
"""
