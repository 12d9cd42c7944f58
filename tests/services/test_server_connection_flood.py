"""Clients holding connections open against a real ``trainguard serve``: descriptors, not bytes.

Every connection held open is a file descriptor of the server. Before: serve kept the usual soft limit of
1,024 open files, so a thousand idle connections (a slowloris, a crowd of workers whose proxies keep
connections alive) stopped it accepting any other -- an ingest waited 20 s for nothing -- and asyncio logged a
traceback for every failed accept: 125 MB of log in 30 s, a second way to fill the disk. Now serve raises its
soft limit to its hard limit (at most 65,536), and the failed accepts are one line per 10 s naming the limit
and the fix.
"""

from __future__ import annotations

import json
import resource
import socket
import time
import urllib.request
from pathlib import Path
from typing import List

from tests.services.e2e.serve_process import ServeProcess


def _hold(port: int, count: int) -> List[socket.socket]:
    """``count`` connections to ``port``, each with half a request sent (a slow client's)."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\n")
        held.append(sock)
    return held


def _ingest(server: ServeProcess, timeout: float) -> int:
    req = urllib.request.Request(server.http_url + "/v1/ingest", data=json.dumps({"events": []}).encode(),
                                 headers={"Authorization": f"Bearer {server.tokens['ingest']}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return int(resp.status)


def _soft_nofile(pid: int) -> int:
    return resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]


def test_serve_raises_its_open_files_limit_and_ingests_beside_a_thousand_idle_connections(
        tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # serve starts with a low soft limit (set in its process only: this one may hold hundreds of descriptors)
    server = ServeProcess(tmp_path / "data", nofile=256).start()
    held: List[socket.socket] = []
    try:
        assert server.proc is not None
        expected = hard if hard != resource.RLIM_INFINITY else 65536
        assert _soft_nofile(server.proc.pid) == min(65536, expected)  # before: 256
        held = _hold(server.http_port, 600)
        assert _ingest(server, timeout=5) == 200  # before: no answer (every descriptor held)
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_failed_accepts_are_one_line_per_ten_seconds(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "data").start()
    held: List[socket.socket] = []
    try:
        assert server.proc is not None
        resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, (128, 128))  # a limit it cannot raise
        held = _hold(server.http_port, 300)
        time.sleep(3)
    finally:
        for sock in held:
            sock.close()
        server.stop()
    log = "".join(server.output)
    lines = [line for line in log.splitlines() if "cannot accept" in line]
    assert 1 <= len(lines) <= 2, lines[:5]  # before: a 6-line traceback per failed accept, thousands a second
    assert "Traceback" not in log, log[-3000:]
    assert len(log.splitlines()) < 40, log[-3000:]
    assert ("cannot accept connections: [Errno 24] Too many open files -- this process holds its open-files "
            "limit (128 descriptors; connections held open count): new connections wait until some close; "
            "raise the limit (ulimit -n, LimitNOFILE=) or find the clients holding connections") in lines[0]
