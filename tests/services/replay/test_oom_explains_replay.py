"""A memory exhaustion explains the failures around it (correlate rule 7, ``oom_explains_s``), on two pasted
logs of the wild corpus (tuned part; ``tests/fixtures/wild/<id>/source.txt`` names each thread) in which the
out-of-memory report is printed *after* what it caused:

* ``comm-nccl-oom-alloc-1``: NCCL's proxy on device 0 loses its peer connection, then device 3's
  ``Cuda failure 'out of memory'`` / ``Failed to CUDA calloc`` (two processes' lines, in no time order);
* ``proc-dl-worker-exited-slurm-oom-kill-sjtu-1``: ``DataLoader worker (pid(s) N) exited unexpectedly``,
  then Slurm's ``Detected 1 oom-kill event(s)`` (printed when the step ends, after the kill).

Before the rule each log's lead was the consequence (comm/rank-lost, the worker's death: process/exception
then, process/exit since stop 48's reading of a worker that 'exited unexpectedly'). The window is
checked on the importer's own envelopes through the engine's pipeline under overridden settings, with
the report moved past it.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.replay import Importer, LocalBackend, ReplayOptions

from .kept_envelopes import envelopes, shown

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"
NCCL = "comm-nccl-oom-alloc-1"
SLURM = "proc-dl-worker-exited-slurm-oom-kill-sjtu-1"
Event = Dict[str, Any]


def _imported(case_id: str) -> List[Dict[str, Any]]:
    """The run's incidents after ``trainguard replay``'s defaults (gateway, processor, pipeline in process)."""
    with tempfile.TemporaryDirectory(prefix="tg-oom-") as tmp:
        backend = LocalBackend(Path(tmp))
        try:
            Importer(ReplayOptions(run_id="oom", logs=[(0, WILD / case_id / "log.txt")]), backend).run()
            backend.finish()
            return backend.incidents("oom")
        finally:
            backend.close()


def _envelopes(case_id: str) -> List[Event]:
    return envelopes(WILD / case_id / "log.txt", "oom")


def _report_later(events: Sequence[Event], text: str, seconds: float) -> List[Event]:
    """``events`` with the log envelope whose line contains ``text``, and everything after it, ``seconds``
    later (the same lines, the report printed that much after what came before it)."""
    out = copy.deepcopy(list(events))
    at = next(i for i, e in enumerate(out) if text in str(e.get("log", {}).get("message", "")))
    for e in out[at:]:
        e["time_unix_nano"] = int(e["time_unix_nano"]) + int(seconds * 1e9)
    return out


def test_an_nccl_allocation_failure_explains_the_peers_lost_connection() -> None:
    incidents = _imported(NCCL)
    (top,) = [i for i in incidents if not i["explained_by"]]
    assert (top["category"], top["subtype"]) == ("memory", "oom")
    (lost,) = [i for i in incidents if i["explained_by"]]
    assert (lost["category"], lost["subtype"]) == ("comm", "rank-lost")
    assert lost["explained_by"] == top["incident_id"]
    assert any(c.startswith("comm/rank-lost") for c in top["consequences"])


def test_the_oom_killers_report_explains_the_dataloader_worker_that_died() -> None:
    incidents = _imported(SLURM)
    (top,) = [i for i in incidents if not i["explained_by"]]
    assert (top["category"], top["subtype"]) == ("process", "killed")
    assert top["evidence"][0]["value"]["facts"]["killer"] == "oom-killer"
    (died,) = [i for i in incidents if i["explained_by"]]
    assert "DataLoader worker" in died["title"] and died["explained_by"] == top["incident_id"]


def test_the_window_decides_and_a_user_can_narrow_it() -> None:
    events = _envelopes(SLURM)
    assert shown(events, DetectionSettings()) == [("process", "killed")]
    # 0: only what follows the exhaustion -- the worker's death printed before the report stays its own
    assert shown(events, DetectionSettings(oom_explains_s=0)) == [("process", "exit"), ("process", "killed")]
    within = _report_later(events, "oom-kill event", 30)
    assert shown(within, DetectionSettings()) == [("process", "killed")]
    beyond = _report_later(events, "oom-kill event", 120)
    assert shown(beyond, DetectionSettings()) == [("process", "exit"), ("process", "killed")]


def test_a_comm_failure_long_before_the_allocation_failure_is_not_its_consequence() -> None:
    events = _envelopes(NCCL)
    assert shown(events, DetectionSettings()) == [("memory", "oom")]
    beyond = _report_later(events, "Cuda failure 'out of memory'", 120)
    assert sorted(shown(beyond, DetectionSettings())) == [("comm", "rank-lost"), ("memory", "oom")]
