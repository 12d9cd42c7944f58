"""A rank's generic report at the same moment as that rank's named error is the error's consequence
(correlate rule 9, ``_named_same_moment``), on four pasted logs of the wild corpus (tuned part;
``tests/fixtures/wild/<id>/source.txt`` names each thread) whose two incidents begin at the same instant
(log lines stamped to the second, or unstamped lines that take their neighbour's stamp):

* ``mem-illegal-address-watchdog-ray-1``: ``Fatal Python error: Aborted`` (out of memory *or* a CUDA error),
  then the watchdog's ``CUDA error: an illegal memory access was encountered`` on the same rank;
* ``mem-oom-fairseq-recover-overflow-1``: fairseq's ``attempting to recover from OOM``, then mp.spawn's bare
  ``Exception:``;
* ``comm-aborted-broadcast-object-rank2-wan-75-1``: ``NCCL communicator was aborted on rank 2``, then rank
  2's ``Timeout at NCCL work: 1``;
* ``comm-remote-error-broken-pipe-llamafactory-6849-1``: rank 5's watchdog teardown (``Some NCCL operations
  have failed or timed out``) beside its ``ncclRemoteError``.

Before the rule both incidents of each log stayed unexplained, of equal severity and first time, and which
one a user read first fell to the incidents' ids (a hash of the run id): the verdict changed with the run's
name. Now the generic one is explained by the named one, whatever the run is called.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"
CASES = {
    # case id: (the named error's kind, the generic report's kind)
    "mem-illegal-address-watchdog-ray-1": ("memory/cuda-error", "memory/oom-or-cuda-error"),
    "mem-oom-fairseq-recover-overflow-1": ("memory/oom", "process/exception"),
    "comm-aborted-broadcast-object-rank2-wan-75-1": ("comm/timeout", "comm/failure"),
    "comm-remote-error-broken-pipe-llamafactory-6849-1": ("comm/rank-lost", "comm/timeout"),
}
RUN_IDS = ("same-moment", "wild-x", "r0", "another-name-7")


def _imported(case_id: str, run_id: str) -> List[Dict[str, Any]]:
    """The run's incidents after ``trainguard replay``'s defaults (gateway, processor, pipeline in process)."""
    with tempfile.TemporaryDirectory(prefix="tg-same-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id=run_id, logs=[(0, WILD / case_id / "log.txt")]), backend).run()
            backend.finish()
            return backend.incidents(run_id)
        finally:
            backend.close()


def _kind(incident: Dict[str, Any]) -> str:
    return f"{incident['category']}/{incident['subtype']}"


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_the_generic_report_is_the_named_errors_consequence(case_id: str) -> None:
    named, generic = CASES[case_id]
    incidents = _imported(case_id, "same-moment")
    by_kind = {_kind(i): i for i in incidents}
    assert named in by_kind and not by_kind[named]["explained_by"]
    folded = [i for i in incidents if _kind(i) == generic and i["explained_by"]]
    assert [i["explained_by"] for i in folded] == [by_kind[named]["incident_id"]]
    assert not [i for i in incidents if _kind(i) == generic and not i["explained_by"]]


SEVERITY = {"critical": 0, "error": 1, "warning": 2, "info": 3}


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_what_a_user_reads_first_does_not_depend_on_the_run_id(case_id: str) -> None:
    """The top incident as ``trainguard replay`` prints it (no other one explains it, most severe first,
    earliest first among equals): the named error, under every run id."""
    tops = set()
    for run_id in RUN_IDS:
        own = [i for i in _imported(case_id, run_id) if not i["explained_by"]]
        own.sort(key=lambda i: (SEVERITY.get(str(i["severity"]), 9), int(i["first_ns"] or 0)))
        tops.add(_kind(own[0]))
    assert tops == {CASES[case_id][0]}


STAMPED_BEFORE = "[2024-03-01 10:00:00,123] [INFO] [launch.py:146:main] WORLD INFO DICT: {'localhost': [0, 1]}"


@pytest.mark.parametrize("case_id", ["comm-watchdog-terminate-accelerate-stuck-1",
                                     "comm-watchdog-interleaved-ppo-zero3-trl-1051-1"])
def test_a_generic_crash_of_the_same_instant_does_not_explain_the_ranks_named_timeout(
        case_id: str, tmp_path: Path) -> None:
    """A stamped launcher line before an unstamped paste gives all its lines one instant: the watchdog's
    timeout and the ``terminate called after throwing an instance of 'std::runtime_error'`` crash it ended in
    (a generic exception) begin together on one rank. The crash no longer explains the timeout (the earlier
    rule 1 took any cause of the same instant); rule 9 folds the crash into the timeout."""
    log = tmp_path / "log.txt"
    log.write_text(STAMPED_BEFORE + "\n" + (WILD / case_id / "log.txt").read_text(encoding="utf-8"),
                   encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="tg-same-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id="stamped", logs=[(0, log)]), backend).run()
            backend.finish()
            incidents = backend.incidents("stamped")
        finally:
            backend.close()
    own = [i for i in incidents if not i["explained_by"]]
    own.sort(key=lambda i: (SEVERITY.get(str(i["severity"]), 9), int(i["first_ns"] or 0)))
    assert _kind(own[0]) == "comm/timeout", [_kind(i) for i in own]
