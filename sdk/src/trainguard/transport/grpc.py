"""gRPC transport: each batch is one ``IngestService.Send`` call (needs ``pip install 'trainguard[grpc]'``).

Contract (see :class:`trainguard.transport.base.Transport`):
  * envelope dicts are converted with :func:`trainguard.wire.prepare_batch`; an event that does not fit the
    schema is not sent and comes back in ``SendResult.rejected`` (code ``invalid_field``), next to the
    server's own per-item rejections, all indexed by position in the batch given to :meth:`send`;
  * a batch larger than ``max_message_bytes`` is sent as several calls within the one ``timeout``; a single
    event over the limit is rejected locally (code ``too_large``);
  * each call's ``IngestResponse`` must acknowledge every event of that call (``accepted + duplicates +
    len(rejected)`` equals the events sent, rejected indexes are positions in the call); otherwise the
    send fails with a retryable ``"bad_ack"`` (:func:`~.base.check_ack`), the batch is not delivered;
  * status mapping: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN (and
    CANCELLED, DATA_LOSS) are retryable, honouring a ``retry-after`` metadata value in seconds; the server
    saying the message is too large (RESOURCE_EXHAUSTED "... larger than max ...") is not retryable and
    carries status ``"413"``, which the worker answers by splitting the batch; INVALID_ARGUMENT,
    UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, UNIMPLEMENTED, FAILED_PRECONDITION (and ALREADY_EXISTS,
    OUT_OF_RANGE) are not. ``TransportError.status`` is the code's name (``"UNAUTHENTICATED"``);
  * the whole send is bounded by its ``timeout`` (each call's deadline is what is left of it: connecting
    included); :meth:`abort` cancels the call in flight from another thread (a retryable TransportError
    with status ``"aborted"``);
  * the channel is created lazily on the first send, and re-created in a forked child (the parent's
    channel is dropped there, never closed or used); :meth:`close` releases it and is idempotent;
  * a host clock at least ``clock_skew_s`` off the backend's (the ``date`` trailing metadata of its
    answers, an HTTP date) is corrected in the events sent, and the events an answer refused as
    ``out_of_range`` when it first showed the offset are sent again, corrected (clock.py, as over HTTP).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

# gRPC's C core deadlocks in a forked child (DataLoader workers, os.fork) unless its fork support is on;
# it must be set before grpc is first imported (a user's explicit setting wins).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "1")

try:
    import grpc

    from .. import wire
    from ..v1 import ingest_pb2, ingest_pb2_grpc
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("trainguard.transport.grpc needs grpcio and protobuf, optional dependencies: "
                      "pip install 'trainguard[grpc]'") from exc

from ..version import SDK_NAME, __version__
from .base import SendResult, Transport, TransportError, check_ack, parse_retry_after
from .clock import CLOCK_SKEW_CORRECT_S, SENT_AT_HEADER, ServerClock, send_corrected, sent_at

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_ELEMENT_OVERHEAD = 6  # tag + length varint of one Envelope inside IngestRequest.events

_RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DATA_LOSS,
})
# Everything else (INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, UNIMPLEMENTED,
# FAILED_PRECONDITION, ALREADY_EXISTS, OUT_OF_RANGE) means re-sending the same batch fails again.


def channel_options(max_message_bytes: int, user_agent: str) -> List[Tuple[str, Any]]:
    """Channel options of a sender with its own retry loop: message limits, user agent, and a short
    reconnect backoff (gRPC's default grows to 120 s; the caller backs off itself, and should find the
    server as soon as it is back)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.primary_user_agent", user_agent),
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 5000)]


def split_target(target: str, secure: bool) -> Tuple[str, bool]:
    """``host:port`` and the effective ``secure`` flag for ``target``.

    Accepts a bare ``host:port`` or a ``grpc://`` / ``grpcs://`` / ``http://`` / ``https://`` URL; a
    ``grpcs`` or ``https`` scheme implies TLS.
    """
    for scheme, tls in (("grpcs://", True), ("https://", True), ("grpc://", False), ("http://", False)):
        if target.lower().startswith(scheme):
            return target[len(scheme):].rstrip("/"), secure or tls
    return target, secure


class GrpcTransport(Transport):
    """Sends batches to ``IngestService.Send`` at ``target`` with ``authorization: Bearer <token>``."""

    name = "grpc"

    def __init__(self, target: str, token: Optional[str], *, secure: bool = False, compression: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 clock_skew_s: float = CLOCK_SKEW_CORRECT_S) -> None:
        self.target, self.secure = split_target(target, secure)
        if not self.target:
            raise ValueError(f"empty gRPC target: {target!r}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes too small: {max_message_bytes}")
        self.compression = compression
        self.max_message_bytes = max_message_bytes
        self._metadata: Tuple[Tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: Optional[grpc.Channel] = None
        self._stub: Any = None
        self._pid = 0
        self._in_flight: Any = None  # the grpc.Future of the call in progress, for abort()
        self._aborted = False
        self.clock = ServerClock(clock_skew_s)

    def __repr__(self) -> str:
        return (f"GrpcTransport(target={self.target!r}, secure={self.secure}, "
                f"token={'set' if self._metadata else None})")

    # ------------------------------------------------------------------------------------------ channel
    def _get_stub(self) -> Any:
        pid = os.getpid()
        if self._stub is not None and self._pid != pid:
            # Inherited through fork(): the channel's threads and sockets belong to the parent. Dropping
            # our reference (without closing) is the only safe thing to do with it in the child.
            self._channel = self._stub = None
        if self._stub is None:
            options = channel_options(self.max_message_bytes, f"{SDK_NAME}/{__version__}")
            compression = grpc.Compression.Gzip if self.compression else grpc.Compression.NoCompression
            if self.secure:
                self._channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(), options,
                                                    compression)
            else:
                self._channel = grpc.insecure_channel(self.target, options, compression)
            self._stub = ingest_pb2_grpc.IngestServiceStub(self._channel)
            self._pid = pid
        return self._stub

    def abort(self) -> None:
        """Cancel the call in flight (if any); the send raises TransportError(status="aborted")."""
        self._aborted = True
        future = self._in_flight
        if future is not None:
            future.cancel()

    def close(self) -> None:
        """Close the channel (only if this process created it). Safe to call twice."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None and self._pid == os.getpid():
            try:
                channel.close()
            except Exception:  # closing must never fail the caller (shutdown paths)
                pass

    # --------------------------------------------------------------------------------------------- send
    def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
        """Deliver ``events`` within ``timeout`` seconds; see the module docstring for the contract."""
        return send_corrected(self.clock, events, timeout, self._send_once)

    def _send_once(self, events: Sequence[Dict[str, Any]], timeout: float,
                   clock_offset_ns: int) -> SendResult:
        deadline = time.monotonic() + timeout
        self._aborted = False
        batch = wire.prepare_batch(events)
        result = SendResult(rejected=list(batch.rejected))
        chunks, too_large = self._chunks(batch.request, batch.indices)
        result.rejected += too_large
        for request, indices in chunks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError("grpc DEADLINE_EXCEEDED: send timeout spent before the last chunk",
                                     retryable=True, status="DEADLINE_EXCEEDED")
            response = self._call(request, remaining, clock_offset_ns)
            check_ack(response.accepted, response.duplicates, [r.index for r in response.rejected],
                      len(indices))
            result.accepted += response.accepted
            result.duplicates += response.duplicates
            for r in response.rejected:
                index = indices[r.index] if 0 <= r.index < len(indices) else r.index
                result.rejected.append({"index": index, "event_id": r.event_id, "code": r.code,
                                        "message": r.message})
        if len(result.rejected) > 1:
            result.rejected.sort(key=lambda r: int(r["index"]))
        return result

    def _call(self, request: Any, timeout: float, clock_offset_ns: int) -> Any:
        try:
            metadata = (*self._metadata, (SENT_AT_HEADER, sent_at(clock_offset_ns)))
            future = self._get_stub().Send.future(request, timeout=timeout, metadata=metadata,
                                                  wait_for_ready=False)
            self._in_flight = future
            if self._aborted:  # abort() came before the call existed
                future.cancel()
            response = future.result()
            self.clock.observe(_metadata_value(future, "date"), time.time_ns())
            return response
        except grpc.FutureCancelledError:
            raise TransportError("grpc call aborted", retryable=True, status="aborted") from None
        except grpc.RpcError as err:
            self.clock.observe(_metadata_value(err, "date"), time.time_ns())
            if self._aborted:
                raise TransportError("grpc call aborted", retryable=True, status="aborted") from None
            raise rpc_error_to_transport_error(err) from None
        except Exception as exc:  # e.g. "Cannot invoke RPC on closed channel": start afresh next time
            self.close()
            raise TransportError(f"grpc client error: {type(exc).__name__}: {exc}", retryable=True,
                                 status="CLIENT_ERROR") from None
        finally:
            self._in_flight = None

    def _chunks(self, request: Any, indices: List[int]
                ) -> Tuple[List[Tuple[Any, List[int]]], List[Dict[str, Any]]]:
        """``request`` split into calls under ``max_message_bytes``, and the events too big for any."""
        if not indices:
            return [], []
        limit = self.max_message_bytes
        if request.ByteSize() <= limit:
            return [(request, indices)], []
        chunks: List[Tuple[Any, List[int]]] = []
        rejected: List[Dict[str, Any]] = []
        for envelopes, chunk_indices, oversize in _split(request.events, indices, limit):
            if oversize is not None:
                envelope, index, size = oversize
                rejected.append({"index": index, "event_id": envelope.event_id, "code": "too_large",
                                 "message": f"event is {size} bytes, over the {limit}-byte message limit"})
            else:
                chunks.append((ingest_pb2.IngestRequest(events=envelopes), chunk_indices))
        return chunks, rejected


def _split(envelopes: Sequence[Any], indices: List[int], limit: int
           ) -> Iterator[Tuple[List[Any], List[int], Optional[Tuple[Any, int, int]]]]:
    """Greedy runs of consecutive envelopes under ``limit`` bytes; oversize ones on their own."""
    run: List[Any] = []
    run_indices: List[int] = []
    size = 0
    for envelope, index in zip(envelopes, indices):
        item = envelope.ByteSize() + _ELEMENT_OVERHEAD
        if item > limit:
            yield [], [], (envelope, index, item)
            continue
        if run and size + item > limit:
            yield run, run_indices, None
            run, run_indices, size = [], [], 0
        run.append(envelope)
        run_indices.append(index)
        size += item
    if run:
        yield run, run_indices, None


def _metadata_value(call: Any, key: str) -> Optional[str]:
    for getter in ("trailing_metadata", "initial_metadata"):
        try:
            metadata = getattr(call, getter)() or ()
        except Exception:  # not a grpc.Call, or the call never started
            continue
        for item in metadata:
            k, v = (item.key, item.value) if hasattr(item, "key") else item
            if k.lower() == key:
                return v.decode("ascii", "replace") if isinstance(v, bytes) else str(v)
    return None


def rpc_error_to_transport_error(err: grpc.RpcError) -> TransportError:
    """The TransportError for a failed call (status name, retryability, server-requested delay)."""
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else None
    details_fn = getattr(err, "details", None)
    details = (details_fn() if callable(details_fn) else None) or str(err)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    message = f"grpc {name}: {details}"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details.lower():
        # the server's max_receive_message_length: re-sending the same batch can never succeed
        return TransportError(message + " (batch too large for the server)", retryable=False, status="413")
    if code is None or code in _RETRYABLE:
        return TransportError(message, retryable=True, status=name,
                              retry_after=parse_retry_after(_metadata_value(err, "retry-after")))
    return TransportError(message, retryable=False, status=name)
