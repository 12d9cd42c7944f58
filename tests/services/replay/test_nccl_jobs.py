"""Real NCCL failures on two H200 GPUs (issue 9), recorded with the SDK attached and committed under
tests/fixtures/nccl/ (README there: the command, versions and what each rank did). Each job is judged as
TrainGuard receives it -- the SDK streams plus what the agent / ``trainguard replay`` reads from the ranks'
output and torchrun's exit codes (tests/support/recorded_jobs.py) -- through the pure pipeline, with the
processor's clock a minute after the last event (tests/engine/test_comm_scenarios.py's ``judge``).

Expected values come from the recordings (what each rank printed it did, torchrun's summary, the NCCL
lines themselves), never from the pipeline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.engine.test_comm_scenarios import judge, kinds, yielded
from tests.support.recorded_jobs import agent_view, facts, record, sdk_events
from trainguard_engine.classify import classify_text
from trainguard_engine.records import Incident

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nccl"

EXPECTED: Dict[str, Tuple[str, str]] = {
    "timeout": ("comm", "timeout"),             # run 1: rank 1 sleeps before the all_reduce
    "mismatch": ("comm", "mismatch"),           # run 2: numel 1024 vs 2048, NCCL's own behaviour
    "mismatch_detail": ("comm", "mismatch"),    # run 2 under TORCH_DISTRIBUTED_DEBUG=DETAIL
    "rank_lost": ("comm", "rank-lost"),         # run 3: rank 1 SIGKILLs itself
    "nan_one_rank": ("gradient", "nan-source"),  # run 4: an inf in rank 1's batch
    "hang": ("progress", "stalled"),            # uneven shards: both ranks wait forever (PG timeout 600 s)
}

_WATCHDOG_LINE = re.compile(r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\("
                            r"SeqNum=(\d+), OpType=(\w+), NumelIn=(\d+)")


def folder(name: str) -> Path:
    return FIXTURES / name


def the_incidents(name: str, tmp_path: Path) -> List[Incident]:
    return yielded(judge(agent_view(folder(name), tmp_path)))


def watchdog_reports(name: str) -> Dict[int, Tuple[int, str, int]]:
    """rank -> (SeqNum, OpType, NumelIn) of the first watchdog timeout line in its log."""
    out: Dict[int, Tuple[int, str, int]] = {}
    for path in sorted(folder(name).glob("rank*.log")):
        for m in _WATCHDOG_LINE.finditer(path.read_text(errors="replace")):
            out.setdefault(int(m.group(1)), (int(m.group(2)), m.group(3), int(m.group(4))))
    return out


# ------------------------------------------------------------------------------------------ recordings

def test_the_recordings_are_two_rank_nccl_jobs_on_gpus() -> None:
    env = json.loads((FIXTURES / "env.json").read_text())
    assert env["backend"] == "nccl" and len(env["gpus"]) >= 2 and all("H200" in g for g in env["gpus"])
    assert env["nccl"] and "+cu" in env["torch"]
    assert env["safety_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                 "NVSHMEM_DISABLE_NVLS": "1"}
    for name in EXPECTED:
        events = sdk_events(folder(name))
        assert {e["rank"] for e in events} == {0, 1}, name
        assert len({e["run_id"] for e in events}) == 1, name
        assert {e["world_size"] for e in events} == {2}, name
        assert record(folder(name))["backend"] == "nccl"


# ------------------------------------------------------------------------------------------ verdicts

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_job_yields_exactly_its_kind(name: str, tmp_path: Path) -> None:
    assert kinds(the_incidents(name, tmp_path)) == [EXPECTED[name]]


def test_watchdog_timeout_names_the_lagging_rank(tmp_path: Path) -> None:
    lagging = facts(folder("timeout"))["lagging_ranks"]
    reports = watchdog_reports("timeout")
    assert lagging == [1] and list(reports) == [0]  # rank 0's watchdog fired; rank 1 was asleep
    (incident,) = the_incidents("timeout", tmp_path)
    assert incident.lead_rank == lagging[0]
    seq, op, _numel = reports[0]
    assert f"{op} SeqNum {seq}" in incident.title
    rules = {(ev.rule, ev.rank) for ev in incident.evidence}
    assert ("correlation.lagging_rank", 1) in rules and ("log.text", 0) in rules
    assert ("exception.fatal", 0) in rules  # the SIGABRT that followed is that timeout's, not an OOM


def test_size_mismatch_seen_by_nccl_is_a_mismatch_not_a_timeout(tmp_path: Path) -> None:
    reports = watchdog_reports("mismatch")
    numel = facts(folder("mismatch"))["all_reduce_numel"]
    assert numel == {"0": 1024, "1": 2048}
    assert len(reports) == 2 and reports[0][0] != reports[1][0]  # stuck in different collectives
    (incident,) = the_incidents("mismatch", tmp_path)
    for rank, (seq, op, count) in reports.items():
        assert re.search(rf"rank {rank} (timed out )?in {op} #{seq} \({count:,} elements\)", incident.title)
    assert any(ev.rule == "correlation.desync" for ev in incident.evidence)
    assert sorted(incident.ranks) == [0, 1]


def test_mismatch_under_detail_debug_is_read_from_both_ranks(tmp_path: Path) -> None:
    (incident,) = the_incidents("mismatch_detail", tmp_path)
    assert "1024 vs 2048" in incident.title
    assert sorted(incident.ranks) == [0, 1]


def test_killed_rank_leads_with_the_survivors_errors_as_consequences(tmp_path: Path) -> None:
    killed = facts(folder("rank_lost"))["killed_ranks"]
    assert killed == [1]
    survivors = sorted(watchdog_reports("rank_lost"))
    assert survivors == [0]
    (incident,) = the_incidents("rank_lost", tmp_path)
    assert incident.lead_rank == killed[0]
    assert any(c.startswith("comm/timeout on rank 0") for c in incident.consequences)


def test_one_ranks_nan_is_a_gradient_incident_led_by_that_rank(tmp_path: Path) -> None:
    found = facts(folder("nan_one_rank"))
    assert found["inf_ranks"] == [1]
    (incident,) = the_incidents("nan_one_rank", tmp_path)
    assert incident.lead_rank == 1 and incident.first_step == found["inf_steps"]["1"]
    assert sorted(incident.ranks) == [0, 1]  # rank 0's gradients went NaN through DDP's all-reduce


def test_hang_is_a_stall_of_both_ranks(tmp_path: Path) -> None:
    (incident,) = the_incidents("hang", tmp_path)
    assert sorted(incident.ranks) == [0, 1]


# ------------------------------------------------------------------------------------------ what only logs say

def test_sdk_streams_alone_cannot_name_a_watchdog_timeout() -> None:
    """The watchdog aborts the process from its C++ thread: no Python exception, no EXIT. Without the
    agent's view of the output, the SDK shows only the stall it caused."""
    events = sdk_events(folder("timeout"))
    assert not any("exception" in e for e in events)
    assert ("comm", "timeout") not in kinds(yielded(judge(events)))


@pytest.mark.parametrize("name,rank,kind", [
    ("timeout", 0, ("comm", "timeout")),
    ("mismatch", 1, ("comm", "timeout")),      # each rank alone sees only its own timeout
    ("mismatch_detail", 0, ("comm", "mismatch")),
    ("mismatch_detail", 1, ("comm", "mismatch")),
    ("rank_lost", 0, ("comm", "timeout")),
])
def test_classifier_reads_the_real_nccl_logs(name: str, rank: int, kind: Tuple[str, str]) -> None:
    found = classify_text((folder(name) / f"rank{rank}.log").read_text(errors="replace"))
    assert found is not None and (found.category, found.subtype) == kind
