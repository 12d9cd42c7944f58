"""A CUDA device fault explains its peers' watchdog timeouts printed before it (correlate rule 7,
``device_fault_explains_s``): stress variants of TUNED pastes of the wild corpus (issue 17; each thread is
named in ``tests/fixtures/wild/<id>/source.txt``), built here and never added to the corpus.

A user who pastes one rank's output after another's puts a peer's ``Watchdog caught collective operation
timeout`` before the faulting rank's ``CUDA error``: the pasted order is no time order. Before the rule the
timeout led (its first line came first); one rank's illegal address or launch failure is what its peers
waited on. A failure of the faulting rank alone (NCCL's own ``unhandled cuda error`` with its ``Cuda
failure`` line, ``comm-nccl-unhandled-cuda-invalid-argument-wsl-111187-1``) is not explained this way.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

from .kept_envelopes import envelopes, shown

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"
PEER_TIMEOUT = (
    "[rank5]:[E ProcessGroupNCCL.cpp:563] [Rank 5] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1201, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800431 "
    "milliseconds before timing out.\n"
    "[rank5]:[E ProcessGroupNCCL.cpp:577] [Rank 5] Some NCCL operations have failed or timed out. Due to the "
    "asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.\n")
TUNED = ("mem-unspecified-launch-mmdet-1", "mem-xid-48-dbe-syslog-1", "mem-unspecified-launch-ctc-loss-crnn-1")
Event = Dict[str, Any]


def _variant(tmp: Path, case_id: str) -> Path:
    """The tuned paste with another rank's watchdog timeout pasted before it."""
    path = tmp / f"{case_id}.log"
    path.write_text(PEER_TIMEOUT + (WILD / case_id / "log.txt").read_text(encoding="utf-8"), encoding="utf-8")
    return path


def _top(path: Path) -> Tuple[Tuple[str, str], List[Tuple[str, str]]]:
    """The leading kind (incidents no other explains, the earliest first among them) and the explained."""
    with tempfile.TemporaryDirectory(prefix="tg-fault-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id="fault", logs=[(0, path)]), backend).run()
            backend.finish()
            incidents = backend.incidents("fault")
        finally:
            backend.close()
    own = [(i["category"], i["subtype"]) for i in incidents if not i["explained_by"]]
    return own[0] if len(own) == 1 else ("", ""), [(i["category"], i["subtype"]) for i in incidents
                                                   if i["explained_by"]]


@pytest.mark.parametrize("case_id", TUNED)
def test_a_peers_timeout_pasted_before_the_cuda_error_is_its_consequence(case_id: str, tmp_path: Path) -> None:
    top, explained = _top(_variant(tmp_path, case_id))
    assert top == ("memory", "cuda-error")
    assert ("comm", "timeout") in explained


def test_the_window_is_a_setting_and_the_faulting_ranks_own_failure_stays(tmp_path: Path) -> None:
    events = envelopes(_variant(tmp_path, TUNED[0]), "fault")
    assert shown(events, DetectionSettings()) == [("memory", "cuda-error")]
    # 0: only what follows the fault -- the peer's timeout printed before it stays its own incident
    assert ("comm", "timeout") in shown(events, DetectionSettings(device_fault_explains_s=0))
    # NCCL's unhandled cuda error and its Cuda failure line, one rank's: its comm/failure is not explained
    assert _top(WILD / "comm-nccl-unhandled-cuda-invalid-argument-wsl-111187-1" / "log.txt")[1] == []
