"""Where the agent forwards: the platform's gateway, over HTTP (protobuf bodies) or gRPC.

Contract of :class:`Upstream` (``open_upstream(url, token)``): ``send(raw, timeout)`` delivers one serialized
``trainguard.v1.IngestRequest`` exactly as the local gateway queued it (no re-encoding) and returns the
gateway's :class:`~trainguard.transport.base.SendResult` once it acknowledged the request; any other outcome
raises :class:`~trainguard.transport.base.TransportError` with the SDK transports' meaning of
``retryable`` / ``retry_after`` / ``status`` ("413" or gRPC "larger than max": split the request).
URLs: ``http(s)://host:port[/prefix]`` or ``grpc(s)://host:port``.
"""

from __future__ import annotations

from typing import Any, Optional

import grpc

from trainguard.transport.base import SendResult, TransportError
from trainguard.transport.clock import SENT_AT_HEADER, sent_at
from trainguard.transport.grpc import channel_options, rpc_error_to_transport_error, split_target
from trainguard.transport.http import HttpTransport
from trainguard.v1 import ingest_pb2

from .. import __version__

USER_AGENT = f"trainguard-agent/{__version__}"
PROTOBUF = "application/x-protobuf"
SEND_METHOD = "/trainguard.v1.IngestService/Send"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def _result(response: Any) -> SendResult:
    return SendResult(accepted=response.accepted, duplicates=response.duplicates,
                      rejected=[{"index": r.index, "event_id": r.event_id, "code": r.code,
                                 "message": r.message} for r in response.rejected])


class Upstream:
    """Delivers serialized IngestRequests to one gateway (used from the forwarder thread only)."""

    url: str = ""

    def send(self, raw: bytes, timeout: float) -> SendResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections; idempotent."""


class HttpUpstream(Upstream):
    def __init__(self, url: str, token: Optional[str]) -> None:
        self.url = url
        self._http = HttpTransport(url, token, USER_AGENT)

    def send(self, raw: bytes, timeout: float) -> SendResult:
        data = self._http.exchange(raw, timeout, PROTOBUF)
        response = ingest_pb2.IngestResponse()
        try:
            response.ParseFromString(data)
        except Exception as exc:  # a proxy answering 200 with something else: try again later
            raise TransportError(f"unreadable ingest response ({len(data)} bytes): {exc}", retryable=True,
                                 status="bad_response") from None
        return _result(response)

    def close(self) -> None:
        self._http.close()


class GrpcUpstream(Upstream):
    def __init__(self, url: str, token: Optional[str]) -> None:
        self.url = url
        target, secure = split_target(url, False)
        options = channel_options(MAX_MESSAGE_BYTES, USER_AGENT)
        self._channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(), options) if secure
                         else grpc.insecure_channel(target, options))
        # request_serializer=None: the bytes go out as queued
        self._send = self._channel.unary_unary(SEND_METHOD, request_serializer=None,
                                               response_deserializer=ingest_pb2.IngestResponse.FromString)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def send(self, raw: bytes, timeout: float) -> SendResult:
        try:
            metadata = (*self._metadata, (SENT_AT_HEADER, sent_at()))  # relayed as this host stamped them
            return _result(self._send(raw, timeout=timeout, metadata=metadata, wait_for_ready=False))
        except grpc.RpcError as err:
            raise rpc_error_to_transport_error(err) from None

    def close(self) -> None:
        try:
            self._channel.close()
        except Exception:
            pass


def open_upstream(url: str, token: Optional[str]) -> Upstream:
    """The upstream for ``url`` (``http(s)://`` or ``grpc(s)://``); ValueError for anything else."""
    lowered = url.lower()
    if lowered.startswith(("http://", "https://")):
        return HttpUpstream(url, token)
    if lowered.startswith(("grpc://", "grpcs://")):
        return GrpcUpstream(url, token)
    raise ValueError(f"upstream must be http(s)://host:port or grpc(s)://host:port, not {url!r}")
