"""perf/throughput-regression and a host whose CPU is oversubscribed (stop 41, ``regression_runqueue_share``),
on real recordings of bench/unseen's tuning set tuning41 (``tests/fixtures/tuning41``, the SDK's stream
unedited), replayed one envelope at a time.

Both ran on this project's shared 2-core VM at load 6-12 (other engineers' jobs beside them). The healthy
GRU regressor (plain loop, AdamW + OneCycle) had two processes spinning on both cores from step 80 for 25 s
and the host's load after that: its step went from ~12 ms to 0.3-2 s and its training thread waited for a
core 0.64-0.91 of each step (8-step medians) -- before stop 41 an open WARNING regression to its end, the
training itself healthy. The residual MLP regressor gets a synchronous 0.3 s "upload" after every step from
step 150 to its end: a regression of the job's own, waiting for a core only 0.03-0.32 of its step in the
upload's first 70 steps.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict, List

from tests.engine.test_unseen_streams import _incidents
from trainguard_engine.catalogue import DetectionSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tuning41"
NEIGHBOURS = FIXTURES / "plain_gru_adamw_onecycle_neighbour_ok.jsonl.gz"
UPLOAD = FIXTURES / "plain_resmlp_rmsprop_sustained_upload.jsonl.gz"
REGRESSION = "perf/throughput-regression"
OFF = DetectionSettings(regression_runqueue_share=0.0)


def test_a_healthy_run_slowed_by_a_busy_host_keeps_no_regression_open() -> None:
    found = _incidents(NEIGHBOURS)
    assert REGRESSION not in found or found[REGRESSION].status == "resolved", found


def test_without_the_contention_rule_the_busy_host_is_a_regression_open_to_the_end() -> None:
    found = _incidents(NEIGHBOURS, OFF)
    assert found[REGRESSION].status != "resolved"


def test_a_run_that_slowed_in_its_own_work_is_still_a_regression() -> None:
    found = _incidents(UPLOAD)
    regression = found[REGRESSION]
    assert 140 <= regression.first_step <= 160, regression.first_step  # the upload began at step 151
    texts = [t.what for t in regression.timeline]
    assert any("Throughput regression" in t for t in texts), texts


def test_without_the_run_queue_delay_nothing_changes(tmp_path: Path) -> None:
    """A stream without time/runqueue_s (not Linux, an older SDK) is judged as before the rule."""
    events: List[Dict[str, Any]] = []
    with gzip.open(NEIGHBOURS, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            event = json.loads(line)
            points = (event.get("metrics") or {}).get("points")
            if points:
                event["metrics"]["points"] = [p for p in points if p.get("name") != "time/runqueue_s"]
            events.append(event)
    stripped = tmp_path / "no_runqueue.jsonl"
    stripped.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    assert _incidents(stripped)[REGRESSION].status == _incidents(NEIGHBOURS, OFF)[REGRESSION].status
