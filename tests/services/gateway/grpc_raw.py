"""A hand-written HTTP/2 client that starts gRPC calls and sends their messages only partly -- what no gRPC
library sends, and what an attacker can: a call whose message stops one byte short is held by the server's
gRPC core, before any Python code of the server sees it.

Standard library only (sockets, no ``h2``): the connection preface, SETTINGS, HEADERS with literal (not
indexed, not Huffman-coded) HPACK fields, DATA within the peer's flow-control windows; PING and SETTINGS
acknowledged. Used by ``test_grpc_stalled_calls.py`` and ``bench/hostile_probe.py``."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
MAX_FRAME = 16_384


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out = bytearray([first | top])
    value -= top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack(headers: List[Tuple[str, str]]) -> bytes:
    """Each field as 'literal without indexing, new name', no Huffman coding."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _hpack_int(len(name), 7) + name.encode() + _hpack_int(len(value), 7) + value.encode()
    return bytes(out)


class StalledCalls:
    """One HTTP/2 connection to a gRPC server with ``calls`` calls of ``method`` open, each sending the gRPC
    frame of a ``message_bytes`` message but only ``message_bytes - short`` bytes of it (flow control
    permitting), then nothing. :meth:`sent` is what went out; :attr:`closed` says whether the server ended
    the connection (GOAWAY or close), :attr:`reset` which calls it ended (RST_STREAM or trailers)."""

    def __init__(self, host: str, port: int, calls: int, message_bytes: int, short: int = 1,
                 method: str = "/trainguard.v1.IngestService/Send", token: Optional[str] = None,
                 timeout: float = 30.0, no_message: bool = False) -> None:
        """``no_message``: each call ends its side right after its headers, with no message at all."""
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Condition()
        self.conn_window = 65_535
        self.initial_window = 65_535
        self.stream_window: Dict[int, int] = {}
        self.to_send: Dict[int, int] = {}
        self.sent_bytes = 0
        self.sent_on: Dict[int, int] = {}  # message bytes sent per call
        self.reset: List[int] = []
        #: the grpc-status each ended call's trailers gave (when sent as a literal, as gRPC's core does)
        self.status: Dict[int, int] = {}
        self.closed = False
        self.goaway = False
        self._write_lock = threading.Lock()
        # no HPACK dynamic table (so the trailers' grpc-status is a literal this client can read), a big window
        self.sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HIHI", 0x1, 0, 0x4, 2**31 - 1)))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", f"{host}:{port}"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        block = _hpack(headers)
        body_total = 5 + message_bytes - short
        for i in range(calls):
            stream = 1 + 2 * i
            with self.lock:
                self.stream_window[stream] = self.initial_window
                if not no_message:
                    self.to_send[stream] = body_total
            self._write(_frame(HEADERS, END_HEADERS | (END_STREAM if no_message else 0), stream, block))
        self.prefix = b"\x00" + struct.pack(">I", message_bytes)

    def _write(self, data: bytes) -> None:
        with self._write_lock:
            self.sock.sendall(data)

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(65_536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    kind, flags = buf[3], buf[4]
                    stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    payload, buf = buf[9:9 + length], buf[9 + length:]
                    self._on_frame(kind, flags, stream, payload)
        except OSError:
            pass
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        with self.lock:
            if kind == SETTINGS and not flags & ACK:
                for k in range(0, len(payload), 6):
                    ident, value = struct.unpack(">HI", payload[k:k + 6])
                    if ident == 0x4:
                        for s in self.stream_window:
                            self.stream_window[s] += value - self.initial_window
                        self.initial_window = value
                self._write(_frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self._write(_frame(PING, ACK, 0, payload))
            elif kind == WINDOW_UPDATE:
                inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if stream == 0:
                    self.conn_window += inc
                elif stream in self.stream_window:
                    self.stream_window[stream] += inc
            elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM):
                if kind == HEADERS and (m := re.search(rb"grpc-status.([0-9]+)", payload, re.S)):
                    self.status[stream] = int(m.group(1))
                self.reset.append(stream)
                self.to_send.pop(stream, None)
            elif kind == GOAWAY:
                self.goaway = True
            self.lock.notify_all()

    def pump(self, quiet_s: float = 2.0, deadline_s: float = 60.0) -> int:
        """Send what the windows allow until every call is one byte short or nothing could be sent for
        ``quiet_s``; the bytes of message sent in all."""
        chunk = b"\x00" * MAX_FRAME
        last_progress = time.monotonic()
        end = last_progress + deadline_s
        offset: Dict[int, int] = {}
        while time.monotonic() < end:
            work: List[Tuple[int, int]] = []
            with self.lock:
                if self.closed:
                    break
                for stream, left in list(self.to_send.items()):
                    n = min(left, self.stream_window[stream], self.conn_window, MAX_FRAME)
                    if n > 0:
                        self.stream_window[stream] -= n
                        self.conn_window -= n
                        self.to_send[stream] = left - n
                        if not self.to_send[stream]:
                            del self.to_send[stream]
                        work.append((stream, n))
                if not work:
                    if not self.to_send or time.monotonic() - last_progress > quiet_s:
                        break
                    self.lock.wait(0.05)
                    continue
            for stream, n in work:
                at = offset.get(stream, 0)
                head = self.prefix[at:at + n]  # the gRPC frame's 5-byte header first, then zeros
                offset[stream] = at + n
                data = head + chunk[:n - len(head)]
                try:
                    self._write(_frame(DATA, 0, stream, data))
                except OSError:
                    return self.sent_bytes
                self.sent_bytes += n
                self.sent_on[stream] = self.sent_on.get(stream, 0) + n
            last_progress = time.monotonic()
        return self.sent_bytes

    def held_bytes(self) -> int:
        """The message bytes sent on calls the server has not ended: what it holds for them now."""
        with self.lock:
            ended = set(self.reset)
            return sum(n for stream, n in self.sent_on.items() if stream not in ended)

    def close(self) -> None:
        """End the connection (shutdown first: a bare close while the reader thread is in recv sends no FIN)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
