"""Memory and disk stay bounded when the backend is gone, and every event is accounted for."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tests.sdk.scripting import run_python


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_one_million_events_with_the_server_down_stay_bounded(tmp_path: Path) -> None:
    code = f"""
        import json, resource, gc
        import trainguard
        def rss_mb():
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * resource.getpagesize() / 2**20
        trainguard.init(endpoint="http://127.0.0.1:{_closed_port()}", project="p",
                        spool_dir={str(tmp_path)!r}, spool_max_bytes=16 * 2**20, heartbeat_interval=0,
                        flush_interval=0.05, backoff_initial=0.05, backoff_max=0.2, capture_exit=False)
        client = trainguard.get_client()
        for step in range(20_000):  # warm up: allocator pools, spool files, backoff
            trainguard.log(step=step, loss=0.5, lr=1e-4)
        trainguard.flush(2)
        gc.collect()
        before = rss_mb()
        peak = before
        for step in range(1_000_000):
            trainguard.log(step=step, loss=0.5, lr=1e-4)
            if step % 50_000 == 0:
                peak = max(peak, rss_mb())
        peak = max(peak, rss_mb())
        trainguard.flush(2)
        stats = client.stats
        figures = {{"before": before, "peak": peak, "queue": client.pending(),
                   "spooled": stats.spooled, "queue_full": stats.dropped["queue_full"],
                   "spool_full": stats.dropped["spool_full"], "sent": stats.sent}}
        trainguard.shutdown(timeout=1)
        figures["after_shutdown"] = client.accounting()
        print(json.dumps(figures))
    """
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    # bounded: the queue holds at most max_queue_events (10k) small tuples; the rest is dropped/spooled
    assert figures["peak"] - figures["before"] < 48, figures
    assert figures["queue"] <= 10_000
    assert figures["sent"] == 0
    # accounted: every event produced (1 start + 20k warm-up + 1M) is in the spool, evicted from it
    # (spool_full), dropped at the full queue, or still queued
    assert figures["spooled"] + figures["spool_full"] + figures["queue_full"] + figures["queue"] == 1_020_001, \
        figures
    # and after shutdown, exactly: sent + spooled + dropped == logged, nothing left unsettled
    assert figures["after_shutdown"]["logged"] == 1_020_001, figures
    assert figures["after_shutdown"]["queued"] == 0, figures
    spool_bytes = sum(p.stat().st_size for p in tmp_path.rglob("*.json"))
    assert spool_bytes <= 16 * 2**20


def test_a_full_disk_for_the_spool_never_raises_and_is_counted(tmp_path: Path) -> None:
    code = f"""
        import resource, signal, json
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a "disk" that fills after 4 KiB/file
        import trainguard
        trainguard.init(endpoint="http://127.0.0.1:{_closed_port()}", project="p",
                        spool_dir={str(tmp_path)!r}, heartbeat_interval=0, flush_interval=0.05,
                        backoff_initial=0.05, capture_exit=False)
        for step in range(3000):
            trainguard.log(step=step, loss=1.0)
        trainguard.flush(2)
        client = trainguard.get_client()
        print(json.dumps(dict(client.stats.dropped)))
        trainguard.shutdown(timeout=1)
        print("still running")
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "still running"
    dropped = json.loads(lines[-2])
    assert dropped["spool_error"] > 0
    assert result.stderr.count("spool write failed") == 1  # warned once
