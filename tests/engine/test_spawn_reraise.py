"""mp.spawn's parent re-raising a worker's failure from ``join`` (old torch's bare ``Exception: ``, newer
torch's ``ProcessRaisedException``) that reads as nothing more specific than a Python exception is the
launcher's report of the worker's failure (detectors/process.py ``SPAWN_RERAISE_RULE``): correlation folds it
into the worker's own error text, printed before or after it (correlate ``LAUNCHER_EXIT_RULES``,
``_own_error_after``). Frames and lines from cavalleria/cavaface#70 (tuned wild case
``mem-unspecified-launch-failure-after-spawn-exception-cavaface-70-1``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest

from trainguard_engine import correlate
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import process
from trainguard_engine.detectors.process import SPAWN_RERAISE_RULE, on_exception, on_log, spawn_reraise
from trainguard_engine.incidents import apply
from trainguard_engine.state import RankState, RunState

SPAWN_PY = "/usr/local/lib/python3.5/dist-packages/torch/multiprocessing/spawn.py"
FRAMES: List[Dict[str, Any]] = [
    {"filename": "train.py", "function": "<module>", "lineno": 367},
    {"filename": "train.py", "function": "main", "lineno": 44},
    {"filename": SPAWN_PY, "function": "spawn", "lineno": 171},
    {"filename": SPAWN_PY, "function": "join", "lineno": 118},
]
CUDA_LINE = ("  what():  CUDA error: unspecified launch failure (insert_events at "
             "/pytorch/c10/cuda/CUDACachingAllocator.cpp:764)")
TERMINATE = "terminate called after throwing an instance of 'c10::Error'"


def _spawn_exception(run: RunState, time_ns: int, *, exc_type: str = "Exception", message: str = "",
                     frames: Optional[List[Dict[str, Any]]] = None, handled: bool = False) -> None:
    rank = run.ranks.setdefault(0, RankState(rank=0))
    body = {"type": exc_type, "message": message, "frames": FRAMES if frames is None else frames,
            "handled": handled}
    finding = on_exception(run, rank, {"event_id": f"x{time_ns}"}, body, "fp-spawn", -1, time_ns,
                           DetectionSettings())
    if finding is not None:
        apply(run, finding, DetectionSettings())


def _cuda_error(run: RunState, time_ns: int) -> None:
    rank = run.ranks.setdefault(0, RankState(rank=0))
    finding = on_log(run, rank, {"event_id": f"l{time_ns}"}, {"message": f"{TERMINATE}\n{CUDA_LINE}"}, -1,
                     time_ns, DetectionSettings())
    assert finding is not None
    apply(run, finding, DetectionSettings())


def _own(run: RunState) -> List[str]:
    correlate.explain(run, DetectionSettings())
    return sorted(f"{st.record.category}/{st.record.subtype}" for st in run.incidents.values()
                  if not st.record.explained_by)


def test_the_rule_name_is_correlations() -> None:
    assert correlate.SPAWN_RERAISE_RULE == process.SPAWN_RERAISE_RULE
    assert SPAWN_RERAISE_RULE in correlate.LAUNCHER_EXIT_RULES


@pytest.mark.parametrize("frames, expected", [
    (FRAMES, True),
    ([{"filename": "C:\\Python37\\lib\\site-packages\\torch\\multiprocessing\\spawn.py", "function": "join"}],
     True),
    (FRAMES[:3], False),  # spawn() itself, not join: an argument error before any worker ran
    ([{"filename": "/app/my/multiprocessing/spawn2.py", "function": "join"}], False),
    ([{"filename": "/app/train.py", "function": "join"}], False),
    ([], False), ("join", False), (None, False),
])
def test_spawn_reraise_is_joins_frame_in_torchs_spawn_module(frames: Any, expected: bool) -> None:
    assert spawn_reraise(frames) is expected


def test_the_reraise_is_evidence_of_a_launcher_report() -> None:
    run = RunState(project="p", run_id="r")
    _spawn_exception(run, 1_000)
    (st,) = run.incidents.values()
    assert (st.record.category, st.record.subtype) == ("process", "exception")
    (ev,) = st.record.evidence
    assert isinstance(ev.value, dict) and ev.value["rule"] == SPAWN_RERAISE_RULE
    assert ev.value["confidence"] == 0.0 and ev.value["exc_type"] == "Exception"


@pytest.mark.parametrize("body", [
    {"frames": FRAMES[:3]},                                   # not join's
    {"handled": True},                                         # a handled exception (when configured)
    {"exc_type": "RuntimeError", "message": "CUDA error: an illegal memory access was encountered",
     "frames": FRAMES},                                        # reads as a named error: that error's incident
])
def test_other_exceptions_keep_their_plain_evidence(body: Dict[str, Any]) -> None:
    run = RunState(project="p", run_id="r")
    settings = DetectionSettings(incident_on_handled_exceptions=True)
    rank = run.ranks.setdefault(0, RankState(rank=0))
    finding = on_exception(run, rank, {"event_id": "x"}, {"type": body.get("exc_type", "Exception"),
                                                          "message": body.get("message", ""),
                                                          "frames": body.get("frames", FRAMES),
                                                          "handled": body.get("handled", False)},
                           "fp", -1, 1_000, settings)
    assert finding is not None
    for ev in finding.evidence:
        assert not (isinstance(ev.value, dict) and ev.value.get("rule") == SPAWN_RERAISE_RULE)


def test_the_workers_error_after_the_reraise_explains_it() -> None:
    run = RunState(project="p", run_id="r")
    _spawn_exception(run, 1_000)
    _cuda_error(run, 7_000)
    assert _own(run) == ["memory/cuda-error"]


def test_the_workers_error_before_the_reraise_explains_it() -> None:
    run = RunState(project="p", run_id="r")
    _cuda_error(run, 1_000)
    _spawn_exception(run, 7_000)
    assert _own(run) == ["memory/cuda-error"]


def test_a_reraise_alone_stays() -> None:
    run = RunState(project="p", run_id="r")
    _spawn_exception(run, 1_000)
    assert _own(run) == ["process/exception"]


def test_a_plain_exception_before_a_cuda_error_stays_its_own() -> None:
    # the same bare Exception raised by the model's own code (not join's frame) is no launcher report
    run = RunState(project="p", run_id="r")
    _spawn_exception(run, 1_000, frames=FRAMES[:2])
    _cuda_error(run, 7_000)
    assert _own(run) == ["memory/cuda-error", "process/exception"]


def test_two_reraises_do_not_explain_each_other() -> None:
    run = RunState(project="p", run_id="r")
    _spawn_exception(run, 1_000)
    rank = run.ranks[0]
    other = on_exception(run, rank, {"event_id": "y"}, {"type": "torch.multiprocessing.spawn."
                                                        "ProcessRaisedException", "message": "", "frames": FRAMES},
                         "fp-other", -1, 2_000, DetectionSettings())
    assert other is not None
    apply(run, other, DetectionSettings())
    assert _own(run) == ["process/exception", "process/exception"]
