"""gRPC ingest: ``trainguard.v1.IngestService`` (``Send``, client-streaming ``Stream``) over a Gateway.

Contract (docs/wire-format.md):

* auth from the ``authorization: Bearer <token>`` metadata: none / unknown / revoked → ``UNAUTHENTICATED``;
  a read token → ``PERMISSION_DENIED``;
* a message that is not a serialized ``IngestRequest`` → ``INVALID_ARGUMENT`` with the reason (the server
  built by :func:`build_grpc_server` hands the servicer raw bytes, so it can say why, salvage the good
  envelopes of a request whose framing is intact, and queue the received bytes as they are);
* more than ``max_batch_events`` events, or a message over ``max_batch_bytes`` (gRPC's own
  ``max_receive_message_length``: "SERVER: Received message larger than max (N vs. M)", or for a gzip
  message that inflates past it, "Decompressed message larger than max") → ``RESOURCE_EXHAUSTED`` whose
  message says "larger than max", which the SDK answers by splitting the batch;
* queue full → ``RESOURCE_EXHAUSTED`` with trailing metadata ``retry-after: <seconds>``; queue failing →
  ``UNAVAILABLE`` with ``retry-after``;
* otherwise ``IngestResponse`` with per-item results. ``Stream`` authenticates once, ingests each message
  as it arrives (each durably queued before the next is read), de-duplicates across the stream (at least
  its last ``STREAM_SEEN_LIMIT`` ids), indexes rejections by position across the stream, and answers one
  summary at half-close. A failure mid-stream ends the call with its status; messages before it stay
  queued (a retried stream is safe: idempotent by event_id).
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any, Dict, Iterator, Optional, Set, Tuple, Union

import grpc

from trainguard.v1 import ingest_pb2, ingest_pb2_grpc

from .ingest import (
    Backpressure,
    Batch,
    Gateway,
    GatewayError,
    IngestResult,
    InvalidRequest,
    PermissionDenied,
    RequestTooLarge,
    Unauthenticated,
    Unavailable,
    batch_from_protobuf,
    bearer_token,
    retry_after_header,
)

__all__ = ["SERVICE", "STREAM_SEEN_LIMIT", "IngestServicer", "build_grpc_server"]

log = logging.getLogger(__name__)

SERVICE = "trainguard.v1.IngestService"
#: a Stream remembers at least this many recent event ids for its duplicate count (then starts afresh)
STREAM_SEEN_LIMIT = 100_000

_CODES: Dict[type, grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED, PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Backpressure: grpc.StatusCode.RESOURCE_EXHAUSTED, Unavailable: grpc.StatusCode.UNAVAILABLE,
}

RequestLike = Union[bytes, ingest_pb2.IngestRequest]


def _token(context: Any) -> Optional[str]:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return bearer_token(value if isinstance(value, str) else value.decode("latin-1"))
    return None


def _batch(request: RequestLike) -> Batch:
    if isinstance(request, (bytes, bytearray, memoryview)):
        return batch_from_protobuf(bytes(request))
    return Batch(request)  # registered with the generated deserializer: already parsed


def _abort(context: Any, exc: GatewayError) -> None:
    """End the call with the status for ``exc`` (raises, as ``context.abort`` does)."""
    code = next((c for cls, c in _CODES.items() if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)
    if isinstance(exc, (Backpressure, Unavailable)):
        context.set_trailing_metadata((("retry-after", retry_after_header(exc.retry_after)),))
    context.abort(code, str(exc))


class IngestServicer(ingest_pb2_grpc.IngestServiceServicer):
    """``IngestService`` over ``gateway``. Requests may be raw bytes (see :func:`build_grpc_server`) or
    ``IngestRequest`` messages (registered with the generated ``add_IngestServiceServicer_to_server``)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def Send(self, request: RequestLike, context: Any) -> ingest_pb2.IngestResponse:
        try:
            auth = self.gateway.authenticate(_token(context))
            result = self.gateway.ingest_batch(auth, _batch(request))
        except GatewayError as exc:
            _abort(context, exc)
            raise  # not reached: abort raises
        except Exception as exc:
            log.exception("ingest Send failed")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            raise
        return result.to_proto()

    def Stream(self, request_iterator: Iterator[RequestLike], context: Any) -> ingest_pb2.IngestResponse:
        total = IngestResult()
        seen: Set[str] = set()
        offset = 0
        try:
            auth = self.gateway.authenticate(_token(context))
            for request in request_iterator:
                batch = _batch(request)
                total.merge(self.gateway.ingest_batch(auth, batch, index_offset=offset, seen=seen))
                offset += batch.count
                if len(seen) > STREAM_SEEN_LIMIT:  # bounded memory on a long stream; stores dedupe anyway
                    seen.clear()
        except GatewayError as exc:
            if offset and not isinstance(exc, (Unauthenticated, PermissionDenied)):
                exc = type(exc)(*_with_note(exc, offset, total.accepted))
            _abort(context, exc)
            raise
        except Exception as exc:
            log.exception("ingest Stream failed")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            raise
        return total.to_proto()


def _with_note(exc: GatewayError, offset: int, accepted: int) -> tuple[Any, ...]:
    """``exc``'s constructor arguments with a note on what the stream had already queued."""
    message = (f"{exc} (after {offset} events of this stream; {accepted} of them were queued, "
               f"re-sending them is safe)")
    retry_after = getattr(exc, "retry_after", None)
    return (message,) if retry_after is None else (message, retry_after)


def build_grpc_server(gateway: Gateway, host: str, port: int, max_message_bytes: int,
                      workers: int = 8) -> Tuple[grpc.Server, int]:
    """``(server, bound port)``: a not yet started ``grpc.Server`` serving ``IngestService`` on ``host:port``
    (port 0: any free port). Call ``.start()`` on it, and ``.stop(grace)`` to end.

    The servicer receives each message as raw bytes (no deserializer): it parses them itself, which gives
    precise INVALID_ARGUMENT messages and lets the gateway queue the bytes as received. Messages over
    ``max_message_bytes`` (after gzip decompression) are refused by gRPC with RESOURCE_EXHAUSTED
    "Received message larger than max (N vs. M)" before they reach Python.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc-ingest"),
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max(max_message_bytes, 4 * 1024 * 1024)),
                 ("grpc.so_reuseport", 0)])
    servicer = IngestServicer(gateway)
    serialize = ingest_pb2.IngestResponse.SerializeToString
    handlers = {
        "Send": grpc.unary_unary_rpc_method_handler(servicer.Send, request_deserializer=None,
                                                    response_serializer=serialize),
        "Stream": grpc.stream_unary_rpc_method_handler(servicer.Stream, request_deserializer=None,
                                                       response_serializer=serialize),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63: faster method lookup
        server.add_registered_method_handlers(SERVICE, handlers)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises instead of returning 0 on some versions
        bound = 0
    if not bound:
        raise OSError(f"cannot bind gRPC ingest to {host}:{port}")
    return server, bound
