"""Review F5 of stop 45 (security.md H46): a reader connection that cannot be opened because this process is
at its open-files limit is :class:`TooManyOpenFiles` (HTTP 503, retryable) -- even when the descriptors are
free again by the time they are counted.

SQLite says only 'unable to open database file' for a failed open(2); H46 inferred EMFILE by opening /dev/null
three times AFTER the failure. During the very burst H46 is about, other requests' 503s close their sockets in
between, the count finds descriptors free, and the error became the permissions one ('check that this user owns
it') -> HTTP 500 with the server's path. A reader opens a file the writer holds open already, so its failed
open is short descriptors whatever the count finds. Real EMFILE here: the soft RLIMIT_NOFILE is lowered to what
the process holds and restored after."""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

from trainguard_server.storage import sqlite as sqlite_module
from trainguard_server.storage.base import OutOfFiles
from trainguard_server.storage.sqlite import Database, StoreOpenError

SCHEMA = "CREATE TABLE IF NOT EXISTS t (x INTEGER);"


def _reader_in_new_thread(db: Database) -> Dict[str, Any]:
    got: Dict[str, Any] = {}

    def read() -> None:
        try:
            got["value"] = db.reader().execute("SELECT count(*) FROM t").fetchone()[0]
        except Exception as exc:  # what the request's handler would meet
            got["error"] = exc

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(30)
    return got


def _at_the_limit(fill: List[int]) -> None:
    """Open /dev/null until EMFILE (the descriptors a burst of connections holds)."""
    while True:
        try:
            fill.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return


@pytest.mark.parametrize("freed_before_the_count", [True, False])
def test_a_reader_opened_out_of_descriptors_is_too_many_open_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, freed_before_the_count: bool) -> None:
    db = Database(tmp_path / "x.db", SCHEMA)
    real_count: Callable[[], Optional[str]] = sqlite_module._out_of_descriptors
    fill: List[int] = []

    def count_after_others_closed() -> Optional[str]:
        if freed_before_the_count:  # the burst's other requests close their sockets meanwhile
            while fill:
                os.close(fill.pop())
        return real_count()

    monkeypatch.setattr(sqlite_module, "_out_of_descriptors", count_after_others_closed)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = len(os.listdir("/proc/self/fd"))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + 16, hard))
        _at_the_limit(fill)
        got = _reader_in_new_thread(db)
    finally:
        for fd in fill:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    error = got.get("error")
    assert isinstance(error, OutOfFiles), got  # before, when freed: StoreOpenError 'check that this user owns it'
    assert isinstance(error, StoreOpenError) and "owns it" not in str(error)
    assert str(tmp_path) not in error.reason  # what a client is told names no server path
    # either way the client's 503 names the cause and the operator's knob (the fresh CI of stop 46 met the
    # freed branch in tests/services/test_server_open_files.py, whose answer lacked both)
    assert "too many open files" in error.reason and "RLIMIT_NOFILE" in error.reason, error.reason
    assert _reader_in_new_thread(db) == {"value": 0}  # descriptors back: the next request reads
    db.close()

