"""``trainguard replay`` end to end on real files and real components: metrics JSON-lines written from the
recorded SDK streams, the stderr of a real crashing training, imported into a data directory (in-process
gateway + processor) and into a ``trainguard serve`` subprocess over HTTP and gRPC. What the backend finds
must be what it finds for the live stream of the same training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Sequence, Tuple

import pytest

from tests.services.e2e.serve_process import ServeProcess
from trainguard.core.events import from_wire_float
from trainguard.core.tracebacks import parse_traceback_text
from trainguard_engine.extract import batch_points
from trainguard_engine.pipeline import Pipeline
from trainguard_server.cli import main
from trainguard_server.storage.sqlite import open_sqlite_stores

REPO = Path(__file__).resolve().parents[3]
STREAMS = REPO / "tests" / "fixtures" / "streams"
SCENARIO_STREAMS = REPO / "tests" / "scenarios" / "streams"
TORCHRUN_LOG = REPO / "tests" / "fixtures" / "tracebacks" / "torchrun_two_ranks.txt"
AS_USERS_LOG = {"loss": "loss", "grad/global_norm": "grad_norm", "lr": "lr"}  # what a user's logger writes


def _stream(name: str) -> List[Dict[str, Any]]:
    with open(STREAMS / f"{name}.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _exit_code(events: Sequence[Mapping[str, Any]]) -> int:
    return next(int(e["lifecycle"].get("exit_code", 0)) for e in events
                if "lifecycle" in e and e["lifecycle"]["phase"] == "EXIT")


def _fingerprint(events: Sequence[Mapping[str, Any]]) -> str:
    return next(str(e["exception"]["fingerprint"]) for e in events if "exception" in e)


def _per_step(events: Sequence[Mapping[str, Any]], names: Mapping[str, str]) -> List[Dict[str, Any]]:
    """One object per step with the stream's values under the names a user's own logger would use."""
    rows: Dict[int, Dict[str, Any]] = {}
    for event in events:
        for point in event.get("metrics", {}).get("points", []):
            if point["name"] in names:
                rows.setdefault(int(event["step"]), {})[names[point["name"]]] = from_wire_float(point["value"])
    return [{"step": step, **rows[step]} for step in sorted(rows)]


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")  # NaN / Infinity literals, as Python loggers write them
    return path


def _kinds(incidents: Sequence[Mapping[str, Any]], *categories: str) -> List[Tuple[Any, ...]]:
    """What to compare between a live and a replayed run: the incidents of ``categories``."""
    return sorted((i["category"], i["subtype"], i["first_step"], i["lead_rank"], i["fingerprint"])
                  for i in incidents if i["category"] in categories)


def _live(events: Sequence[Mapping[str, Any]]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """What the pipeline makes of the live SDK stream."""
    pipeline = Pipeline()
    pipeline.process(events)
    return pipeline.runs()[0].to_dict(), [i.to_dict() for i in pipeline.incidents()]


def _replay(capsys: pytest.CaptureFixture[str], *args: Any) -> Tuple[int, str]:
    code = main(["replay", "--quiet", *map(str, args)])
    return code, capsys.readouterr().out


def _stored(data: Path, run_id: str) -> Dict[str, Any]:
    stores = open_sqlite_stores(data)
    try:
        run = stores.incidents.get_run("default", run_id)
        return {"run": run.to_dict() if run else None,
                "incidents": [i.to_dict() for i in stores.incidents.list_incidents("default", run_id=run_id).items],
                "clusters": [c.to_dict() for c in stores.incidents.list_clusters("default").items],
                "events": [e.event_id for e in stores.events.list_for_run("default", run_id, limit=1000).items],
                "metrics": stores.metrics.names("default", run_id)}
    finally:
        stores.close()


@pytest.fixture(scope="module")
def crash_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stderr of the demo's crashing training run without any SDK endpoint: a real crash log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, "-m", "trainguard_server.demo.trainings", "crashing", "--steps", "20"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    path = tmp_path_factory.mktemp("crash") / "train.log"
    path.write_text(proc.stderr, encoding="utf-8")
    return path


@pytest.fixture
def crash_metrics(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "metrics.jsonl", _per_step(_stream("crashing"), AS_USERS_LOG))


def test_diverging_metrics_are_classified_as_the_live_stream(tmp_path: Path, capsys: Any) -> None:
    events = _stream("diverging")
    metrics = _write_jsonl(tmp_path / "metrics.jsonl", _per_step(events, AS_USERS_LOG))
    live_run, live_incidents = _live(events)
    assert {(i["category"], i["subtype"]) for i in live_incidents} & {("gradient", "explosion"),
                                                                        ("loss", "non_finite")}
    data = tmp_path / "data"
    code, out = _replay(capsys, "--data-dir", data, "--run-id", "diverging", "--metrics", metrics,
                        "--exit-code", _exit_code(events))
    assert code == 0, out
    stored = _stored(data, "diverging")
    assert _kinds(stored["incidents"], "gradient", "loss") == _kinds(live_incidents, "gradient", "loss")
    assert stored["run"]["status"] == live_run["status"] and stored["run"]["last_step"] == live_run["last_step"]
    assert {"loss", "grad/global_norm", "opt/lr"} == set(stored["metrics"])  # renamed automatically
    first = next(i for i in live_incidents if i["category"] in ("gradient", "loss"))
    assert f"{first['category']}/{first['subtype']} from step {first['first_step']}" in out


def test_crash_log_gets_the_sdk_fingerprint_and_reimporting_changes_nothing(
        tmp_path: Path, capsys: Any, crash_log: Path, crash_metrics: Path) -> None:
    events = _stream("crashing")
    _, live_incidents = _live(events)
    data = tmp_path / "data"
    seen = []
    for _ in range(2):
        code, out = _replay(capsys, "--data-dir", data, "--run-id", "crashing", "--metrics", crash_metrics,
                            "--log", crash_log, "--exit-code", 1)
        assert code == 0, out
        seen.append(_stored(data, "crashing"))
    first, second = seen
    assert first == second  # same run, incidents (ids, counts), clusters, events
    (incident,) = [i for i in first["incidents"] if i["fingerprint"]]
    assert incident["fingerprint"] == _fingerprint(events)
    assert _kinds(first["incidents"], "process", "memory") == _kinds(live_incidents, "process", "memory")
    (cluster,) = first["clusters"]
    assert cluster["fingerprint"] == _fingerprint(events) and cluster["count"] == 1
    assert first["run"]["status"] == "failed" and first["run"]["exit_codes"] == {"0": 1}
    assert f"fingerprint {_fingerprint(events)}" in out


def test_per_rank_files_and_a_torchrun_log(tmp_path: Path, capsys: Any, crash_log: Path,
                                           crash_metrics: Path) -> None:
    data = tmp_path / "data"
    code, out = _replay(capsys, "--data-dir", data, "--run-id", "two-ranks", "--metrics-rank", f"0={crash_metrics}",
                        "--metrics-rank", f"1={crash_metrics}", "--log-rank", f"1={crash_log}",
                        "--exit-code", 0, "--exit-code-rank", "1=1")
    assert code == 0, out
    stored = _stored(data, "two-ranks")
    assert stored["run"]["ranks"] == [0, 1] and stored["run"]["exit_codes"] == {"0": 0, "1": 1}
    (incident,) = [i for i in stored["incidents"] if i["fingerprint"]]
    assert (incident["category"], incident["subtype"]) == ("process", "exception")
    assert incident["lead_rank"] == 1 and incident["ranks"] == [1] and incident["first_step"] == 9
    assert incident["fingerprint"] == _fingerprint(_stream("crashing"))
    # one launcher log for both ranks: [rankN]: prefixes route the lines, exit codes are inferred
    code, out = _replay(capsys, "--data-dir", data, "--run-id", "torchrun", "--log", TORCHRUN_LOG)
    assert code == 0, out
    stored = _stored(data, "torchrun")
    assert stored["run"]["ranks"] == [0, 1] and stored["run"]["exit_codes"] == {"0": 1, "1": 1}
    assert "rank 0: 1 (inferred), rank 1: 1 (inferred)" in out
    rank0 = next(e for e in parse_traceback_text(TORCHRUN_LOG.read_text()) if e.stream == "rank0")
    (shapes,) = [i for i in stored["incidents"] if i["fingerprint"] == rank0.fingerprint().hash]
    assert shapes["ranks"] == [0, 1]  # the same failure on both ranks is one incident


def test_malformed_lines_nan_literals_and_field_mapping(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([
        '{"iteration": 0, "train/loss": 2.0, "grad_norm": {"total": 1.0, "enc": 0.5}, "learning_rate": 0.1, '
        '"val": {"ppl": 7.0}, "phase": "train"}',
        '{"iteration": 1, "train/loss": 1.5, "grad_norm": {"total": 1.1, "enc": 0.6}, "learning_rate": 0.1, '
        '"val": {"ppl": 6.0}, "phase": "train"}',
        "this is not json",
        '{"iteration": 2, "train/loss": ',
        '{"iteration": 3, "train/loss": NaN, "grad_norm": {"total": Infinity, "enc": "nan"}, '
        '"learning_rate": 0.1, "val": {"ppl": "inf"}, "phase": "train"}',
    ]) + "\n")
    data = tmp_path / "data"
    code, out = _replay(capsys, "--data-dir", data, "--run-id", "mapped", "--metrics", path,
                        "--map", "val/ppl=eval/perplexity")
    assert code == 0, out
    assert "3 records" in out and "2 malformed lines skipped" in out
    assert "line 3: not JSON" in out and "line 4: not JSON" in out
    assert "ignored 'phase': not a number (3 values)" in out
    stored = _stored(data, "mapped")
    # {"grad_norm": {"total": ...}}: the global norm (issue 19), its other keys per-layer norms
    assert stored["metrics"] == ["eval/perplexity", "grad/global_norm", "grad/layer/enc", "loss", "opt/lr"]
    assert stored["run"]["last_step"] == 3
    stores = open_sqlite_stores(data)
    try:
        series = stores.metrics.series("default", "mapped", ["loss", "grad/layer/enc"])
    finally:
        stores.close()
    assert [b.nonfinite for b in series["loss"][0]] == [0, 0, 1]
    assert [b.nonfinite for b in series["grad/layer/enc"][0]] == [0, 0, 1]
    assert any(i["first_step"] == 3 for i in stored["incidents"])  # the NaN loss was seen
    code, out = _replay(capsys, "--data-dir", data, "--run-id", "as-is", "--metrics", path, "--no-auto-map")
    assert code == 0, out
    assert _stored(data, "as-is")["metrics"] == ["grad_norm/enc", "grad_norm/total", "learning_rate",
                                                 "train/loss", "val/ppl"]


def _asctime(ns: int) -> str:
    """``logging``'s default asctime: local time, milliseconds (truncated) after a comma."""
    stamp = datetime.fromtimestamp(ns / 1e9)
    return stamp.strftime("%Y-%m-%d %H:%M:%S") + f",{stamp.microsecond // 1000:03d}"


def _as_user_files(events: Sequence[Mapping[str, Any]], folder: Path) -> Tuple[Path, Path]:
    """What a user without the SDK has of a recorded run (as bench/detection.py's replay way writes it): a
    metrics JSON-lines file, one object per step with its ``time.time()`` (µs), and a ``logging`` log, a
    progress line per step at the step's time (ms) and the traceback as Python prints it, without a stamp."""
    steps: Dict[int, Dict[str, Any]] = {}
    lines: List[Tuple[int, int, str]] = []
    for event in events:
        t = int(event["time_unix_nano"])
        if "metrics" in event:
            for name, step, value in batch_points(event["metrics"], int(event.get("step") or 0)):
                if step not in steps:
                    steps[step] = {"step": step, "time": round(t / 1e9, 6)}
                    lines.append((t, len(lines), f"{_asctime(t)} INFO train: step {step}"))
                steps[step][name] = value
        elif "exception" in event:
            lines.append((t, len(lines), event["exception"]["traceback"].rstrip("\n")))
    log = folder / "train.log"
    log.write_text("".join(text + "\n" for _, _, text in sorted(lines)), encoding="utf-8")
    return _write_jsonl(folder / "metrics.jsonl", list(steps.values())), log


def test_a_traceback_in_the_millisecond_of_the_last_step_belongs_to_that_step(tmp_path: Path, capsys: Any) -> None:
    """The crash scenario dies ~1.5 ms after logging step 92 (µs metrics time). Its log's progress line
    for step 92 is stamped with that millisecond, truncated, and the traceback after it takes the same
    stamp -- earlier than step 92's metrics time. The traceback must still come after step 92's record:
    the exception is step 92's, as the SDK reported it live, not step 91's."""
    with open(SCENARIO_STREAMS / "crash.jsonl", encoding="utf-8") as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    _, live_incidents = _live(events)
    (live,) = [i for i in live_incidents if (i["category"], i["subtype"]) == ("process", "exception")]
    assert live["first_step"] == 92
    metrics, log = _as_user_files(events, tmp_path)
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["step"] == 92
    stamp = int(datetime.strptime(_asctime(int(last["time"] * 1e9)), "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1e3)
    assert stamp * 10**6 < round(last["time"] * 1e6) * 10**3  # the precondition: the stamp sorts first
    data = tmp_path / "data"
    seen = []
    for _ in range(2):
        code, out = _replay(capsys, "--data-dir", data, "--run-id", "crash", "--metrics", metrics, "--log", log,
                            "--exit-code", 1)
        assert code == 0, out
        seen.append(_stored(data, "crash"))
    assert seen[0] == seen[1]  # re-importing is still idempotent
    (incident,) = [i for i in seen[0]["incidents"] if (i["category"], i["subtype"]) == ("process", "exception")]
    assert incident["first_step"] == live["first_step"] == 92
    assert incident["fingerprint"] == live["fingerprint"]
    assert "process/exception from step 92" in out
    stores = open_sqlite_stores(data)
    try:
        stored = stores.events.list_for_run("default", "crash", limit=1000).items
    finally:
        stores.close()
    (exception,) = [e for e in stored if e.kind == "exception"]
    assert exception.step == 92
    # sent no earlier than step 92's record and within the millisecond its stamp names (modulo the whole
    # days an old recording is shifted by)
    after_92 = (exception.time_ns - round(last["time"] * 1e6) * 10**3) % (86400 * 10**9)
    assert 0 <= after_92 < (stamp + 1) * 10**6 - round(last["time"] * 1e6) * 10**3


def test_nothing_importable_exits_non_zero(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text("not json\n{\"step\": \n")
    code, out = _replay(capsys, "--data-dir", tmp_path / "data", "--run-id", "broken", "--metrics", path)
    assert code == 1 and "nothing to import" in out and "0 sent" in out
    assert main(["replay", "--run-id", "x", "--data-dir", str(tmp_path / "data")]) == 2  # no input files


def test_old_timestamps_are_shifted_into_the_window_keeping_their_spacing(tmp_path: Path, capsys: Any) -> None:
    start = datetime.now(timezone.utc) - timedelta(days=90)
    rows = [{"step": s, "timestamp": (start + timedelta(seconds=10 * s)).isoformat(), "loss": 1.0 / (s + 1)}
            for s in range(30)]
    path = _write_jsonl(tmp_path / "old.jsonl", rows)
    data = tmp_path / "data"
    code, out = _replay(capsys, "--data-dir", data, "--run-id", "old", "--metrics", path)
    assert code == 0, out
    assert "shifted by +89 days" in out or "shifted by +90 days" in out
    run = _stored(data, "old")["run"]
    now = time.time_ns()
    assert now - 2 * 86400 * 10**9 < run["started_ns"] < now
    assert run["step_time_s"] == pytest.approx(10.0, rel=0.01)
    assert run["status"] == "finished"
    # hours-old history read at once is not a silent run: no progress/lost while it is imported
    assert not [i for i in _stored(data, "old")["incidents"] if i["category"] == "progress"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path / "srv").start()
    yield proc
    proc.stop()


def _cli(*args: Any) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return subprocess.run([sys.executable, "-m", "trainguard_server", "replay", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def test_endpoint_mode_over_http_and_grpc(server: ServeProcess, crash_log: Path, crash_metrics: Path) -> None:
    tokens = server.tokens
    fingerprint = _fingerprint(_stream("crashing"))
    proc = _cli("--endpoint", server.http_url, "--token", tokens["ingest"], "--read-token", tokens["read"],
                "--run-id", "over-http", "--metrics", crash_metrics, "--log", crash_log, "--exit-code", 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "process/exception from step 9" in proc.stdout and f"fingerprint {fingerprint}" in proc.stdout
    incidents = server.get("/api/v1/runs/over-http/incidents")["items"]
    assert [(i["category"], i["subtype"], i["fingerprint"]) for i in incidents] == [
        ("process", "exception", fingerprint)]
    # the same files again, over gRPC: nothing new in the backend
    proc = _cli("--endpoint", f"grpc://{server.grpc_target}", "--api", server.http_url, "--token",
                tokens["ingest"], "--read-token", tokens["read"], "--run-id", "over-http",
                "--metrics", crash_metrics, "--log", crash_log, "--exit-code", 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert server.get("/api/v1/runs/over-http/incidents")["items"] == incidents
    (cluster,) = server.pages("/api/v1/clusters")
    assert cluster["fingerprint"] == fingerprint and cluster["count"] == 1
    # a refused token stops the import and says why
    proc = _cli("--endpoint", server.http_url, "--token", "nope", "--run-id", "x", "--metrics", crash_metrics)
    assert proc.returncode == 1 and "401" in proc.stdout
