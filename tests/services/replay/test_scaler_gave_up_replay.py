"""The loss scaler's own fatal error explains the exit that follows it, through ``trainguard replay``'s
defaults (correlate ``SCALER_GAVE_UP_RULE``, ``_scaler_gave_up_before``). DeepSpeed's ``Current loss scale
already at minimum - cannot decrease scale anymore. Exiting run.`` and fairseq's ``FloatingPointError: Minimum
loss scale reached`` are raised by the scaler: the process ends because of them, so a launcher's report that
the worker exited (DeepSpeed's ``Killing subprocess`` / ``exits with return code = 1``) is their consequence.
Before, the exit report stood as an incident of its own and, more severe than the memory/amp-overflow one,
was what a user read first (bench/wild/stress.py's ``ds_around`` variant of six tuned pastes). An overflow
notice or a collapsing scale (the run goes on skipping steps) explains no exit.

Also: a launcher's line that names another rank (``--local_rank=3``) but is printed on rank 0's stream left
rank 0's last-error pointer on the routed line's slot, so rank 0's exit opened a stray ``process/exception``
incident beside the cause; it now joins the cause (``route``). The pastes are tuned-part logs
(``tests/fixtures/wild/<id>/source.txt``), each line verbatim; the launcher lines are stress.py's."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from bench.wild import judge, stress
from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"
GAVE_UP = ["num-ds-min-scale-exception-firefly-1", "num-fairseq-min-scale-1"]
COLLAPSE = "num-ds-overflow-1"
OOM = ["Traceback (most recent call last):",
       '  File "train.py", line 10, in <module>',
       "    loss.backward()",
       "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total "
       "capacity; 70.00 GiB already allocated)"]


def _lines(case_id: str) -> List[str]:
    return (WILD / case_id / "log.txt").read_text(encoding="utf-8").splitlines()


def _imported(tmp_path: Path, lines: List[str]) -> List[Dict[str, Any]]:
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="tg-scaler-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id="scaler", logs=[(0, path)]), backend).run()
            backend.finish()
            return backend.incidents("scaler")
        finally:
            backend.close()


def _shown(incidents: List[Dict[str, Any]]) -> List[str]:
    return [f"{i['category']}/{i['subtype']}" for i in judge.ordered(incidents)]


@pytest.mark.parametrize("case_id", GAVE_UP)
def test_the_scalers_fatal_error_explains_the_launchers_exit_report(tmp_path: Path, case_id: str) -> None:
    incidents = _imported(tmp_path, stress.ds_around(_lines(case_id)))
    assert _shown(incidents) == ["memory/amp-overflow"]
    (amp,) = [i for i in incidents if i["category"] == "memory"]
    rules = {ev["value"].get("rule") for ev in amp["evidence"] if isinstance(ev.get("value"), dict)}
    assert {"numeric.loss-scale-minimum", "launcher.signal", "deepspeed.launcher-teardown"} <= rules


@pytest.mark.parametrize("case_id", GAVE_UP)
def test_the_scalers_fatal_error_alone_is_unchanged(tmp_path: Path, case_id: str) -> None:
    assert _shown(_imported(tmp_path, _lines(case_id))) == ["memory/amp-overflow"]


def test_a_collapsing_scale_explains_no_exit(tmp_path: Path) -> None:
    # overflow notices (the run goes on skipping steps), then a worker exits: the exit stays its own incident
    shown = _shown(_imported(tmp_path, stress.ds_around(_lines(COLLAPSE))))
    assert "process/exit" in shown and "memory/amp-overflow" in shown


def test_an_exit_report_naming_another_rank_leaves_no_stray_exit_incident(tmp_path: Path) -> None:
    # rank 0's OOM, then DeepSpeed's lines about --local_rank=3 printed on rank 0's stream: rank 0's exit code
    # joins the OOM (before: a process/exception incident made of the exit code alone)
    incidents = _imported(tmp_path, stress.ds_around(OOM))
    assert _shown(incidents) == ["memory/oom"]
    assert all(i["category"] != "process" or i.get("explained_by") for i in incidents)
