"""Detection on the committed subset of the varied-training corpus (``tests/scenarios/streams_varied``,
exported by ``bench/corpus/export.py``: per label the first runs of each half by id, whatever the engine
says about them). The full 320-run corpus runs from ``bench/corpus``; here CI judges real recorded SDK
streams of plain loops, the HF Trainer and Lightning without training anything.

Three things are checked: the label rule still gives every run the label it was exported with (the
ground truth did not move); the engine's verdict on every run is the one recorded in ``verdicts.json``
(a regression baseline: a deliberate detection change re-exports it with ``python -m bench.corpus.export
--verdicts-only``, and the diff shows which runs changed); and the subset's figures hold their floors
(healthy runs end with no WARNING-or-worse incident open, the anomalous ones get the right category).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict

import pytest

from bench.corpus import evaluate, labels, manifest
from bench.corpus.trainings import clip_for

SUBSET = Path(__file__).resolve().parents[1] / "scenarios" / "streams_varied"
RECORDED: Dict[str, Dict[str, Any]] = json.loads((SUBSET / "verdicts.json").read_text(encoding="utf-8"))


def _run(run_id: str) -> Dict[str, Any]:
    doc = json.loads(gzip.decompress((SUBSET / f"{run_id}.truth.json.gz").read_bytes()))
    spec = manifest.RunSpec.from_dict(doc["spec"])
    return {"spec": spec, "truth": doc["truth"],
            "events": evaluate.read_events(SUBSET / f"{run_id}.jsonl.gz")}


@pytest.fixture(scope="module")
def outcomes() -> Dict[str, evaluate.Outcome]:
    settings = evaluate.DetectionSettings()
    out = {}
    for run_id in sorted(RECORDED):
        run = _run(run_id)
        out[run_id] = evaluate.outcome_of(run["spec"], run["truth"], run["events"], settings)
    return out


def test_the_subset_covers_every_framework_and_most_labels() -> None:
    assert {r["framework"] for r in RECORDED.values()} == {"plain", "hf", "lightning"}
    assert {r["split"] for r in RECORDED.values()} == {"dev", "test"}
    assert len({r["label"] for r in RECORDED.values()}) >= 9
    assert sum(1 for r in RECORDED.values() if r["label"] == labels.HEALTHY) >= 10


@pytest.mark.parametrize("run_id", sorted(RECORDED))
def test_the_label_rule_still_gives_the_exported_label(run_id: str) -> None:
    run = _run(run_id)
    assert labels.label(run["spec"], run["truth"], clip_for(run["spec"])) == RECORDED[run_id]["label"]


@pytest.mark.parametrize("run_id", sorted(RECORDED))
def test_the_verdict_is_the_recorded_one(run_id: str, outcomes: Dict[str, evaluate.Outcome]) -> None:
    got = outcomes[run_id]
    want = RECORDED[run_id]
    assert (got.verdict, got.open_alerts) == (want["verdict"], want["open_alerts"]), (
        f"{run_id} ({want['cause']}, {want['framework']}): the engine's verdict changed; re-export with "
        "`python -m bench.corpus.export --verdicts-only` if that is deliberate")


def test_the_subset_figures_hold_their_floors(outcomes: Dict[str, evaluate.Outcome]) -> None:
    healthy = [o for o in outcomes.values() if o.healthy]
    anomalous = [o for o in outcomes.values() if not o.healthy and o.label != labels.UNMANIFESTED]
    assert healthy and all(not o.open_alerts for o in healthy)
    right = sum(o.right_category for o in anomalous)
    assert right >= 0.8 * len(anomalous), f"{right}/{len(anomalous)} right category"  # 27/32 when exported
