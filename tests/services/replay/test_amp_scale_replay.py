"""A pasted DeepSpeed loss-scale collapse (wild corpus ``num-ds-overflow-1``, tuned part) imported with
``trainguard replay``'s importer: one memory/amp-overflow incident naming the run of reductions (the rule:
tests/engine/test_amp_scale_collapse.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

LOG = Path(__file__).resolve().parents[2] / "fixtures" / "wild" / "num-ds-overflow-1" / "log.txt"


def test_the_incident_names_the_run_of_reductions() -> None:
    """Gateway, processor and pipeline in process, on the whole log."""
    with tempfile.TemporaryDirectory(prefix="tg-amp-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id="amp", logs=[(0, LOG)]),
                     backend).run()
            backend.finish()
            incidents = backend.incidents("amp")
        finally:
            backend.close()
    assert [(i["category"], i["subtype"]) for i in incidents] == [("memory", "amp-overflow")]
    assert "loss scale down to 2 on rank 0, 5 reductions in a row" in incidents[0]["title"]
    facts = [e["value"]["facts"] for e in incidents[0]["evidence"]]
    assert {"scale": 2.0, "rank": 0, "reductions_in_a_row": 5} in facts
    # the halvings before the collapse are its evidence too: they opened it as an info notice (1088ee0), which
    # the collapse then took over and raised to the kind's severity
    assert facts[0] == {"scale": 32.0, "rank": 0} and incidents[0]["severity"] == "warning"
