"""The agent's parts on their own: the watchdog (pure), the output capture, the file follower, the
pipeline's reading of a hang report, and the forwarder's handling of upstream answers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

from tests.support.waiting import poll
from trainguard.transport.base import SendResult, TransportError
from trainguard_engine.pipeline import Pipeline
from trainguard_server.agent.capture import OutputCapture
from trainguard_server.agent.events import EventBuilder, agent_identity
from trainguard_server.agent.relay import Forwarder
from trainguard_server.agent.sources import FileFollower
from trainguard_server.agent.upstream import Upstream
from trainguard_server.agent.watchdog import HangPolicy, ProgressWatch
from trainguard_server.gateway.ingest import join_events, split_events
from trainguard_server.queue.sqlite import SqliteQueue

S = 1_000_000_000


def test_watchdog_scales_with_the_cadence_and_fires_once_per_episode() -> None:
    watch = ProgressWatch(HangPolicy(factor=10, floor_s=5, ceiling_s=100))
    watch.started(S)
    assert watch.check(100 * S) is None and watch.check(102 * S) is not None  # no cadence yet: the ceiling
    watch = ProgressWatch(HangPolicy(factor=10, floor_s=5, ceiling_s=100))
    watch.started(S)
    for i in range(1, 21):  # a line every 2 s (the wait for the first line is not a gap)
        watch.line(30 * S + i * 2 * S)
    assert watch.interval_s() == 2.0 and watch.threshold_s() == 20.0
    last = 30 * S + 40 * S
    assert watch.check(last + 19 * S) is None
    hang = watch.check(last + 21 * S)
    assert hang is not None and hang.since_ns == last and abs(hang.quiet_s - 21) < 1e-9
    assert watch.check(last + 50 * S) is None  # one report per episode
    ended = watch.line(last + 60 * S)
    assert ended is hang and watch.check(last + 61 * S) is None


def test_watchdog_prefers_the_sdk_step_time_and_ignores_heartbeat_without_progress() -> None:
    watch = ProgressWatch(HangPolicy(factor=3, floor_s=1, ceiling_s=600))
    watch.started(S)
    for step in range(5):
        watch.step(step, (step + 1) * 4 * S)
    assert abs(watch.interval_s() - 4.0) < 1e-6 and watch.threshold_s() == 12.0
    assert watch.step(4, 30 * S) is None and watch.last_progress_ns == 20 * S  # same step: not progress


def _builder() -> EventBuilder:
    return EventBuilder(agent_identity({"TRAINGUARD_RUN_ID": "unit", "RANK": "3", "WORLD_SIZE": "4"}))


def test_capture_sends_tracebacks_warnings_and_recognised_error_text_only() -> None:
    sent: List[Dict[str, Any]] = []
    capture = OutputCapture("stderr", 3, _builder(), sent.extend)
    lines = ["step 1 loss 0.5", "WARNING: lr schedule ends early",
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
             "capacity of 79.11 GiB of which 1.00 GiB is free.",
             "Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
             "    main()", "ValueError: bad config", "step 2 loss 0.4"]
    cleaned = [capture.line(number, line + "\n", number * S) for number, line in enumerate(lines, 1)]
    capture.close()
    kinds = [(e.get("log") or {}).get("message", "")[:20] if "log" in e else "exception" for e in sent]
    assert kinds == ["WARNING: lr schedule", "torch.OutOfMemoryErr", "exception"], kinds
    assert all(e["rank"] == 3 and e["run_id"] == "unit" for e in sent)
    exc = sent[-1]["exception"]
    assert exc["type"] == "ValueError" and exc["mechanism"] == "log" and exc["fingerprint"]
    assert cleaned[-2:] == ["ValueError: bad config", "step 2 loss 0.4"]  # what the agent keeps as its tail


def test_capture_routes_torchrun_prefixes_and_sends_the_launcher_summary_as_text() -> None:
    sent: List[Dict[str, Any]] = []
    capture = OutputCapture("stderr", 0, _builder(), sent.extend)
    text = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "w.py", line 9, in <module>',
            "[rank1]:     step()", "[rank1]: RuntimeError: boom",
            "Traceback (most recent call last):", '  File "run.py", line 1, in <module>',
            "    main()", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "============================================================"]
    for number, line in enumerate(text, 1):
        capture.line(number, line, number)
    capture.close()
    exceptions = [e for e in sent if "exception" in e]
    assert [(e["rank"], e["exception"]["type"]) for e in exceptions] == [(1, "RuntimeError")]
    summary = [e for e in sent if "log" in e and "ChildFailedError" in e["log"]["message"]]
    assert len(summary) == 1 and summary[0]["log"]["level"] == "ERROR"


def test_file_follower_reads_appends_truncation_and_rotation(tmp_path: Path) -> None:
    got: List[tuple] = []
    follower = FileFollower([str(tmp_path / "*.log")], lambda key, n, t: got.append((key, n, t)),
                            partial_after_s=0.2)
    path = tmp_path / "train.log"
    path.write_text("a\nb\n")
    follower.poll()
    with open(path, "a") as fh:
        fh.write("c\npartial")
    follower.poll()
    assert [t for _, _, t in got] == ["a", "b", "c"]
    assert poll(lambda: (follower.poll(), [t for _, _, t in got][-1] == "partial")[1], timeout=5)
    first_key = got[0][0]
    path.write_text("x\n")  # truncated
    follower.poll()
    assert got[-1][1:] == (1, "x")
    os.rename(path, tmp_path / "train.log.1")  # rotated: a new file at the path
    path.write_text("new\n")
    follower.poll()
    follower.poll()
    assert got[-1][1:] == (1, "new") and got[-1][0] != first_key


def test_pipeline_reads_the_agents_hang_report_as_a_stall_and_its_end() -> None:
    builder = _builder()
    from trainguard_server.agent.watchdog import Hang

    hang = Hang(since_ns=100 * S, decided_ns=400 * S, threshold_s=240.0, interval_s=24.0, how="clamp(...)",
                last_step=41)
    report = builder.hang(hang, 1, ["step 41 loss 0.1"], "Thread 7 (idle): \"MainThread\"\n    wait (x.py:3)",
                          "py-spy")
    start = builder.start([], 99 * S, {})
    pipe = Pipeline()
    pipe.process([start, report])
    (stall,) = [i for i in pipe.incidents() if i.subtype == "stalled"]
    assert stall.lead_rank == 3 and stall.first_ns == 100 * S
    (evidence,) = [e for e in stall.evidence if e.rule == "agent.hang"]
    assert evidence.value == 300.0 and evidence.threshold == 240.0 and "wait (x.py:3)" in evidence.description
    pipe.process([builder.resumed(hang, 1, 500 * S, 42)])
    assert next(i for i in pipe.incidents() if i.subtype == "stalled").status == "resolved"


class _Scripted(Upstream):
    url = "scripted"

    def __init__(self, answers: List[Any]) -> None:
        self.answers = answers
        self.sent: List[bytes] = []

    def send(self, raw: bytes, timeout: float) -> SendResult:
        self.sent.append(raw)
        answer = self.answers.pop(0) if self.answers else SendResult(accepted=len(split_events(raw)))
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_forwarder_retries_holds_on_auth_and_splits_too_large(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / "q.db")
    parts = [_envelope(i) for i in range(4)]
    queue.publish("run", [join_events(parts[:2]), join_events(parts[2:])])
    upstream = _Scripted([TransportError("down", retryable=True, status="connection"),
                          TransportError("HTTP 401: invalid token", retryable=False, status="401"),
                          TransportError("HTTP 413: too large", retryable=False, status="413")])
    forwarder = Forwarder(queue, upstream, max_backoff_s=0.05)
    forwarder.start()
    try:
        assert forwarder.drain(10)
    finally:
        forwarder.stop()
    assert forwarder.stats.upstream_accepted == 4 and forwarder.stats.dropped_events == 0
    assert forwarder.stats.retries == 2  # connection refused, then the 401: both retried, nothing dropped
    assert [len(split_events(r)) for r in upstream.sent] == [4, 4, 4, 2, 2]  # joined, then split in halves
    assert queue.depth() == 0


def _envelope(i: int) -> bytes:
    from trainguard.v1 import events_pb2

    env = events_pb2.Envelope(event_id=f"{i:032x}", run_id="run", time_unix_nano=1)
    env.log.message = f"line {i}"
    return env.SerializeToString()


def test_bad_agent_environment_is_the_agents_error_only(monkeypatch: Any, capsys: Any) -> None:
    from trainguard_server.cli import build_parser, main

    monkeypatch.setenv("TRAINGUARD_AGENT_HANG_FACTOR", "ten")
    build_parser().parse_args(["serve"])  # other commands are not affected by the agent's environment
    code = main(["agent", "--upstream", "http://127.0.0.1:1", "--token", "t", "--log-file", "x.log"])
    assert code == 2
    assert "TRAINGUARD_AGENT_HANG_FACTOR='ten' is not a number" in capsys.readouterr().err
    monkeypatch.setenv("TRAINGUARD_AGENT_HANG_FACTOR", "4")
    monkeypatch.setenv("TRAINGUARD_AGENT_LOG_LEVEL", "loud")
    assert main(["agent", "--upstream", "http://127.0.0.1:1", "--token", "t", "--log-file", "x.log"]) == 2
    assert "TRAINGUARD_AGENT_LOG_LEVEL='LOUD' is not one of" in capsys.readouterr().err
