"""Fuzz: schemathesis against the OpenAPI that a real ``trainguard serve`` serves (issue 18, Must show).

``trainguard serve`` runs as a subprocess on 127.0.0.1 over a fresh data dir, seeded with a run (a NaN loss,
a CUDA OOM: an incident, a cluster) and a baseline, so that the path parameters schemathesis draws often
name things that exist (its dictionaries, half the time) and the 200 answers are checked too, not only the
404s. The schemathesis CLI (PyPI) then runs every phase -- examples, coverage (boundary and negative
values), fuzzing, stateful (links it infers between operations) -- on all operations of ``/openapi.json``
twice:

* **with tokens**: the read token on the query API, the ingest token on ``POST /v1/ingest``;
* **without a token**: whatever ``authorization`` header schemathesis generates (usually none).

Checks: ``not_a_server_error`` (no 5xx), ``status_code_conformance`` (every status is documented for its
operation), ``content_type_conformance`` and ``response_schema_conformance`` (bodies validate against the
documented schema). Figures, printed: requests sent (counted in schemathesis's HAR log of every exchange),
5xx answers among them (from that log, independent of the checks), schema violations (the failures of the
three conformance checks); all must be 0. Bounds: ``max_examples`` per operation and phase
(:data:`MAX_EXAMPLES`: 15 under the default ``ci`` profile, 50 under ``TRAINGUARD_FUZZ_PROFILE=full``, scaled
by ``TRAINGUARD_FUZZ_SCALE``: tests/fuzz/budget.py), a live stream reads one
event, each request at most 10 s, each run at most :data:`RUN_TIMEOUT_S` (about 25 s here; a hunt at a
larger scale needs pytest's ``--timeout 0``). One schemathesis worker: with two worker threads, CPython 3.11.7
now and then raised "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905) while
hypothesis parsed a lambda's source in both threads -- a 'Runtime Error' of the run, 2 of 4 runs at 15 examples;
one worker is no slower here (the GIL). A seed is drawn per run and printed (``TRAINGUARD_FUZZ_SEED``
fixes it); a failure prints schemathesis's report with a ``curl`` line that reproduces it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional
from urllib.parse import urlsplit

import httpx
import pytest

from tests.fuzz.budget import examples, scale
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

MAX_EXAMPLES = examples(50, ci=15)  # per operation and phase (full / ci profile: tests/fuzz/budget.py)
RUN_TIMEOUT_S = round(80 * max(1.0, scale()))  # per schemathesis run: the file stays under 3 minutes
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance")
SERVER_ERRORS = ("ServerError", "ContentTypeServerError")  # schemathesis's failure types for a 5xx
RUN = "fuzz-run"
BASELINE = "fuzz-baseline"
SEED_ENV = "TRAINGUARD_FUZZ_SEED"
OPEN_PATHS = ("/healthz", "/readyz", "/metrics")  # the operations that need no token


@dataclass
class Seeded:
    """``trainguard serve`` with its tokens and the ids of what was ingested before the fuzzing."""

    server: ServeProcess
    read: str
    ingest: str
    incident_id: str
    fingerprint: str


@dataclass
class Figures:
    """One schemathesis run: what it tried and what it found."""

    mode: str
    requests: int
    test_cases: int
    operations: int
    server_errors: int
    schema_violations: int
    statuses: Dict[int, int]
    open_paths_ok: int  # 2xx answers of the operations that need no token (/healthz, /readyz, /metrics)
    failures: List[Dict[str, Any]]
    errors: List[Any]
    exit_code: int
    seed: int
    seconds: float

    def line(self) -> str:
        return (f"schemathesis {self.mode}: {self.requests} requests ({self.test_cases} test cases over "
                f"{self.operations} operations), 5xx: {self.server_errors}, schema violations: "
                f"{self.schema_violations}, seed {self.seed}, {self.seconds:.0f} s; statuses "
                f"{dict(sorted(self.statuses.items()))}")


def _envelope(step: int, **payload: Any) -> Dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "run_id": RUN, "step": step, "time_unix_nano": time.time_ns(),
            **payload}


def _seed(server: ServeProcess) -> Seeded:
    """A run with tags, a loss that turns NaN and a CUDA OOM (-> an incident and a cluster), a baseline."""
    tokens = server.tokens
    read = {"Authorization": f"Bearer {tokens['read']}"}
    events = [_envelope(-1, lifecycle={"phase": "START", "tags": {"team": "fuzz", "sweep": "a"}})]
    events += [_envelope(s, metrics={"points": [{"name": "loss", "value": 2.0 / (s + 1) if s < 20 else "NaN"},
                                                {"name": "opt/lr", "value": 1e-3}]}) for s in range(25)]
    events.append(_envelope(25, severity="CRITICAL", exception={
        "type": "torch.OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
        "frames": [{"filename": "train.py", "function": "step", "lineno": 12, "in_app": True}]}))
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        r = client.post("/v1/ingest", json={"events": events},
                        headers={"Authorization": f"Bearer {tokens['ingest']}"})
        assert r.status_code == 200 and r.json()["accepted"] == len(events), r.text

        def incident() -> Optional[Dict[str, Any]]:
            items = client.get("/api/v1/incidents", headers=read).json()["items"]
            return next((i for i in items if i.get("fingerprint")), None)
        found = poll(incident, timeout=60)
        assert found, "the seeded run opened no incident with a fingerprint"
        r = client.put(f"/api/v1/baselines/{BASELINE}", json={"runs": [RUN], "description": "fuzz"},
                       headers=read)
        assert r.status_code == 200, r.text
    return Seeded(server, tokens["read"], tokens["ingest"], found["incident_id"], found["fingerprint"])


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    server = ServeProcess(tmp_path_factory.mktemp("serve") / "data").start()
    try:
        yield _seed(server)
    finally:
        server.stop()


def _toml(value: Any) -> str:
    return json.dumps(value)  # a JSON string or number is a valid TOML basic string / number


def _config(seeded: Seeded, with_tokens: bool) -> str:
    """schemathesis.toml: tokens (or none), the dictionaries of seeded ids, a bounded live stream."""
    lines: List[str] = []
    if with_tokens:
        lines.append(f"headers = {{ Authorization = {_toml('Bearer ' + seeded.read)} }}")
    dictionaries = {"runs": RUN, "incidents": seeded.incident_id, "fingerprints": seeded.fingerprint,
                    "baselines": BASELINE}
    for name, value in dictionaries.items():
        lines += [f"[dictionaries.{name}]", f"values = [{_toml(value)}]"]
    lines.append("[parameters]")
    for parameter, name in (("path.run_id", "runs"), ("path.incident_id", "incidents"),
                            ("path.fingerprint", "fingerprints"), ("path.name", "baselines"),
                            ("query.run_id", "runs")):
        lines.append(f'"{parameter}" = {{ dictionary = "{name}", probability = 0.5 }}')
    if with_tokens:
        lines += ["[[operations]]", 'include-path = "/v1/ingest"',
                  f"headers = {{ Authorization = {_toml('Bearer ' + seeded.ingest)} }}"]
    # a live stream never ends by itself: read its first event and close it
    lines += ["[[operations]]", 'include-path-regex = "/stream$"', "max-stream-events = 1", "request-timeout = 5"]
    return "\n".join(lines) + "\n"


def _schemathesis(seeded: Seeded, with_tokens: bool, workdir: Path) -> Figures:
    """Run the schemathesis CLI once (in ``workdir``: its cache and reports go there) and read its reports."""
    mode = "with tokens" if with_tokens else "without a token"
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**31))
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(_config(seeded, with_tokens))
    reports = workdir / "reports"
    cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
           "--config-file", str(config), "--no-color", "run", f"{seeded.server.http_url}/openapi.json",
           "--checks", ",".join(CHECKS), "--max-examples", str(MAX_EXAMPLES), "--workers", "1",
           "--seed", str(seed), "--request-timeout", "10", "--report", "json,har", "--report-dir", str(reports),
           "--report-json-path", str(reports / "run.json"), "--report-har-path", str(reports / "exchanges.har")]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    assert (reports / "run.json").exists(), f"schemathesis {mode} wrote no report:\n{done.stdout}\n{done.stderr}"
    report = json.loads((reports / "run.json").read_text())
    entries = json.loads((reports / "exchanges.har").read_text())["log"]["entries"]
    failures = report["failures"]
    figures = Figures(
        mode=mode, requests=len(entries), test_cases=report["test_cases"]["generated"],
        operations=report["operations"]["tested"],
        server_errors=sum(1 for e in entries if e["response"]["status"] >= 500),
        schema_violations=sum(f["count"] for f in failures if f["type"] not in SERVER_ERRORS),
        statuses=dict(Counter(e["response"]["status"] for e in entries)),
        open_paths_ok=sum(1 for e in entries if 200 <= e["response"]["status"] < 300
                          and urlsplit(e["request"]["url"]).path in OPEN_PATHS),
        failures=failures, errors=report["errors"], exit_code=done.returncode, seed=seed, seconds=seconds)
    print("\n" + figures.line())
    if figures.failures or figures.errors or figures.exit_code:
        print(done.stdout[-20000:], done.stderr[-5000:])
    return figures


def _check(figures: Figures, total_operations: int) -> None:
    assert figures.server_errors == 0, figures.line()
    assert figures.schema_violations == 0, (figures.line(), figures.failures)
    assert not figures.failures and not figures.errors, (figures.failures, figures.errors)
    assert figures.exit_code == 0, figures.line()
    assert figures.operations == total_operations, f"{figures.operations} of {total_operations} operations tested"
    assert figures.requests >= total_operations * 5, figures.line()  # it really ran


@pytest.fixture(scope="module")
def operation_count(seeded: Seeded) -> int:
    spec = httpx.get(f"{seeded.server.http_url}/openapi.json", timeout=30).json()
    return sum(1 for item in spec["paths"].values() for method in item
               if method in ("get", "put", "post", "delete", "patch"))


def _ok(figures: Figures) -> int:
    return sum(n for status, n in figures.statuses.items() if 200 <= status < 300)


def test_schemathesis_with_tokens(seeded: Seeded, operation_count: int, tmp_path: Path) -> None:
    figures = _schemathesis(seeded, True, tmp_path / "with-tokens")
    _check(figures, operation_count)
    # the seeded ids and the tokens let it past auth and 404s to the routes' real work
    assert _ok(figures) - figures.open_paths_ok >= 2 * operation_count, figures.line()


def test_schemathesis_without_a_token(seeded: Seeded, operation_count: int, tmp_path: Path) -> None:
    figures = _schemathesis(seeded, False, tmp_path / "without-token")
    _check(figures, operation_count)
    # whatever Authorization header it made up, only the open operations answered 2xx
    assert _ok(figures) == figures.open_paths_ok, figures.line()
    assert figures.statuses.get(401, 0) > 0, figures.line()
