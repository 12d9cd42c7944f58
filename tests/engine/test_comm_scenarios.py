"""The communication scenarios of the corpus (``source="dist"`` in tests/scenarios/corpus.py): real
two-process ``torch.distributed`` jobs on the CPU (gloo), every rank recorded through the SDK
(tests/scenarios/dist.py → tests/scenarios/streams_dist/<name>/). Each must yield exactly its expected
incident kind, led by the rank the recording names, with evidence naming the rule that decided; replaying
the streams changes nothing; and the error-text classifier reads the real gloo / c10d texts of the rank logs.

Expected values come from the manifest (kind, lead rank) and from the recordings (scenario.json's ``facts``,
parsed from what each rank printed: which rank was SIGKILLed, lagged, got the inf sample, ran out of data,
which MASTER_PORT it used; torchrun's exit codes; the streams' own events), never from the pipeline.

The streams are judged as a runtime judges them: every event, then ``Pipeline.advance`` at
:data:`SETTLE_S` after the last event (the processor's clock; a rank SIGKILLed without a word is only known
to be lost once its silence outlasts ``rank_lost_grace_s``), under the benchmark's stall floor
(:data:`STALL_FLOOR_S`; each job is shorter than a minute, the default floor is 120 s).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, STREAMS_DIST, Scenario, of_source
from trainguard.core.events import from_wire_float
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_exception, classify_text
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Incident

Event = Dict[str, Any]

STALL_FLOOR_S = 5.0
"""The stall floor (``stall_min_s``) the corpus is judged with (bench/detection.py's default, as for the
CPU ``stall`` scenario): the hang runs ~37 s before its SIGKILL, far under the default 120 s floor."""
SETTINGS = DetectionSettings(stall_min_s=STALL_FLOOR_S)
SETTLE_S = 60.0
"""The processor's clock when the streams are judged, seconds after the last event: past
``rank_lost_grace_s`` (20 s) and 2.5 heartbeats, short of ``lost_after_s`` (300 s)."""
MAX_STREAM_BYTES = 150_000
MAX_WALL_S = 60.0

DIST: Tuple[Scenario, ...] = of_source("dist")
NAMES = tuple(s.name for s in DIST)
COMM = tuple(s.name for s in DIST if s.expected and s.expected[0] == "comm")
LEADS = tuple(s.name for s in DIST if s.lead_rank >= 0)

# ------------------------------------------------------------------------------------------------ helpers

def record(name: str) -> Dict[str, Any]:
    data: Dict[str, Any] = json.loads((STREAMS_DIST / name / "scenario.json").read_text())
    return data


def facts(name: str) -> Dict[str, Any]:
    found: Dict[str, Any] = record(name)["facts"]
    return found


def rank_events(name: str) -> Dict[int, List[Event]]:
    """Each rank's stream, as its file holds it."""
    out: Dict[int, List[Event]] = {}
    for path in sorted((STREAMS_DIST / name).glob("rank*.events.jsonl")):
        rank = int(re.fullmatch(r"rank(\d+)\.events\.jsonl", path.name).group(1))  # type: ignore[union-attr]
        with open(path, encoding="utf-8") as fh:
            out[rank] = [json.loads(line) for line in fh if line.strip()]
    return out


def rank_log(name: str, rank: int) -> str:
    return (STREAMS_DIST / name / f"rank{rank}.log").read_text(errors="replace")


def last_ns(events: Sequence[Event]) -> int:
    return max(int(e.get("time_unix_nano") or 0) for e in events)


def judge(events: Sequence[Event], settings: DetectionSettings = SETTINGS) -> Pipeline:
    pipeline = Pipeline(settings)
    pipeline.process(events)
    pipeline.advance(last_ns(events) + int(SETTLE_S * 1e9))
    return pipeline


def yielded(pipeline: Pipeline) -> List[Incident]:
    """The incidents a user is shown: every one not folded into another as its consequence."""
    return [i for i in pipeline.incidents() if not i.explained_by]


def kinds(incidents: Sequence[Incident]) -> List[Tuple[str, str]]:
    return sorted((i.category, i.subtype) for i in incidents)


def the_incident(name: str) -> Incident:
    """The incident of the scenario's expected kind (exactly one)."""
    expected = BY_NAME[name].expected
    (found,) = [i for i in yielded(judge(BY_NAME[name].events())) if (i.category, i.subtype) == expected]
    return found


def exceptions(events: Sequence[Event]) -> List[Event]:
    return [e for e in events if "exception" in e]


def exits(events: Sequence[Event]) -> List[Event]:
    return [e for e in events if e.get("lifecycle", {}).get("phase") in ("EXIT", 2, "2")]


def losses(events: Sequence[Event]) -> Dict[int, float]:
    """step -> loss of one rank's stream."""
    out: Dict[int, float] = {}
    for e in events:
        for p in e.get("metrics", {}).get("points", []):
            if p["name"] == "loss":
                out[int(p.get("step") or e["step"])] = from_wire_float(p["value"])
    return out


def metric_steps(events: Sequence[Event]) -> List[int]:
    return [int(p.get("step") or e["step"]) for e in events for p in e.get("metrics", {}).get("points", [])]


def strip_prefix(text: str) -> str:
    return re.sub(r"^\[rank\d+\]:(?: )?", "", text, flags=re.MULTILINE)


# ------------------------------------------------------------------------------------ the recordings

def test_the_manifest_lists_the_six_dist_scenarios_and_each_is_recorded() -> None:
    assert set(NAMES) == {"dist_timeout", "dist_mismatch", "dist_rank_lost", "dist_init_failure",
                          "dist_nan_one_rank", "dist_hang"}
    assert sorted(p.name for p in STREAMS_DIST.iterdir() if p.is_dir()) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_recording_is_two_real_ranks_of_one_short_run(name: str) -> None:
    rec = record(name)
    assert rec["corpus_name"] == name and rec["backend"] == "gloo"
    assert rec["recorded_with"]["torch"].startswith("2.13.0")
    assert rec["wall_s"] < MAX_WALL_S
    assert rec["hung_killed"] == rec["hang_expected"] == (name == "dist_hang")
    streams = rank_events(name)
    assert sorted(streams) == [0, 1]
    run_ids = set()
    for rank, events in streams.items():
        assert (STREAMS_DIST / name / f"rank{rank}.events.jsonl").stat().st_size < MAX_STREAM_BYTES
        assert {e["rank"] for e in events} == {rank} and {e["world_size"] for e in events} == {2}
        run_ids |= {e["run_id"] for e in events}
        assert [e for e in events if e.get("lifecycle", {}).get("phase") in ("START", 1, "1")]
    assert len(run_ids) == 1  # the ranks' streams are one run
    assert len(BY_NAME[name].events()) == sum(len(v) for v in streams.values())


def test_what_the_ranks_really_did() -> None:
    """The recordings are the failures they claim to be (from the logs, torchrun and the streams)."""
    # timeout: rank 1 lagged (alive, no exception) and was SIGTERMed by torchrun; rank 0 raised and exited 1
    f, s = facts("dist_timeout"), rank_events("dist_timeout")
    (lagging,) = f["lagging_ranks"]
    (waiting,) = set(s) - {lagging}
    assert f["exit_codes"] == {str(lagging): -15, str(waiting): 1}
    assert not exceptions(s[lagging]) and exceptions(s[waiting])
    assert exits(s[lagging])[0]["lifecycle"]["signal"] == 15
    # rank lost: the killed rank sent no exit (SIGKILL) and nothing after its last step
    f, s = facts("dist_rank_lost"), rank_events("dist_rank_lost")
    (killed,) = f["killed_ranks"]
    assert f["exit_codes"][str(killed)] == -9
    assert not exits(s[killed]) and not exceptions(s[killed])
    (survivor,) = set(s) - {killed}
    assert exceptions(s[survivor]) and last_ns(s[killed]) < int(exceptions(s[survivor])[0]["time_unix_nano"])
    # mismatch: the ranks passed different numels to the same all_reduce, and both raised
    f, s = facts("dist_mismatch"), rank_events("dist_mismatch")
    assert len(set(f["all_reduce_numel"].values())) == 2
    assert all(len(exceptions(events)) == 1 for events in s.values())
    # init failure: the ranks were given different MASTER_PORTs, both raised before any step
    f, s = facts("dist_init_failure"), rank_events("dist_init_failure")
    assert len(set(f["master_ports"].values())) == 2
    assert all(exceptions(events) and not metric_steps(events) for events in s.values())
    # NaN on one rank: only its batch had the inf; both finished (exit 0)
    f, s = facts("dist_nan_one_rank"), rank_events("dist_nan_one_rank")
    assert len(f["inf_ranks"]) == 1 and record("dist_nan_one_rank")["launcher_exit_code"] == 0
    assert all(e["lifecycle"]["exit_code"] == 0 for events in s.values() for e in exits(events))
    # hang: uneven shards, nobody raised or exited, both kept heartbeating after their last step
    f, s = facts("dist_hang"), rank_events("dist_hang")
    assert f["out_of_data_ranks"] and f["extra_batch_ranks"]
    assert len(set(f["shard_batches"].values())) == 2
    for events in s.values():
        assert not exceptions(events) and not exits(events)
        assert max(metric_steps(events)) == min(f["shard_batches"].values()) - 1
        last_step_ns = max(int(e["time_unix_nano"]) for e in events if "metrics" in e)
        beats = [int(e["time_unix_nano"]) for e in events if "heartbeat" in e]
        assert (max(beats) - last_step_ns) / 1e9 > 6 * STALL_FLOOR_S


# ------------------------------------------------------------------------------ through the pipeline

def test_print_what_the_pipeline_says(capsys: pytest.CaptureFixture[str]) -> None:
    lines = ["", f"{'scenario':<18} {'expected':<21} yielded (category/subtype lead ranks: title)"]
    for s in DIST:
        incidents = yielded(judge(s.events()))
        said = "; ".join(f"{i.category}/{i.subtype} lead {i.lead_rank} {i.ranks}: {i.title}" for i in incidents)
        lines.append(f"{s.name:<18} {s.label + (f' lead {s.lead_rank}' if s.lead_rank >= 0 else ''):<21} "
                     f"{said or '-'}")
    with capsys.disabled():
        print("\n".join(lines))
    assert all(yielded(judge(s.events())) for s in DIST)  # every scenario is an anomaly


@pytest.mark.parametrize("name", NAMES)
def test_each_scenario_yields_exactly_its_expected_kind(name: str) -> None:
    assert kinds(yielded(judge(BY_NAME[name].events()))) == [BY_NAME[name].expected]


@pytest.mark.parametrize("name", NAMES)
def test_the_expected_kind_is_among_what_is_yielded(name: str) -> None:
    """The weaker form of the above, which holds today for every scenario."""
    assert BY_NAME[name].expected in kinds(yielded(judge(BY_NAME[name].events())))


@pytest.mark.parametrize("name", LEADS)
def test_the_manifest_lead_rank_is_the_rank_the_recording_names(name: str) -> None:
    scenario, f, s = BY_NAME[name], facts(name), rank_events(name)
    if name == "dist_rank_lost":
        assert f["killed_ranks"] == [scenario.lead_rank]
    elif name == "dist_nan_one_rank":
        assert f["inf_ranks"] == [scenario.lead_rank]
        step = f["inf_steps"][str(scenario.lead_rank)]
        # its loss went non-finite at that step, while every other rank's was still finite
        assert not math.isfinite(losses(s[scenario.lead_rank])[step])
        assert all(math.isfinite(losses(s[r])[step]) for r in s if r != scenario.lead_rank)
    else:  # pragma: no cover - a new scenario with a lead rank needs its own check here
        pytest.fail(f"no check of {name}'s lead rank against its recording")


@pytest.mark.parametrize("name", LEADS)
def test_the_incident_is_led_by_the_scenarios_lead_rank(name: str) -> None:
    incident = the_incident(name)
    assert incident.lead_rank == BY_NAME[name].lead_rank
    assert sorted(incident.ranks) == sorted(rank_events(name))  # every rank took part


@pytest.mark.parametrize("name", COMM)
def test_comm_evidence_names_the_classifier_rule_of_each_ranks_own_log(name: str) -> None:
    """Every rank that raised is evidence on the incident, with the rule the classifier gives for that
    rank's log (its own stderr: an independent text of the same failure) and that rank's exit."""
    incident = the_incident(name)
    for rank, events in rank_events(name).items():
        if not exceptions(events):
            continue
        from_log = classify_text(rank_log(name, rank))
        assert from_log is not None and from_log.kind == BY_NAME[name].label
        mine = [e for e in incident.evidence if e.rank == rank and e.rule == "exception.uncaught"]
        assert mine, (rank, [(e.rank, e.rule) for e in incident.evidence])
        assert isinstance(mine[0].value, dict) and mine[0].value["rule"] == from_log.rule
        assert [e for e in incident.evidence if e.rank == rank and e.rule == "exit.code"]


def test_rank_lost_evidence_names_the_silent_rank() -> None:
    (killed,) = facts("dist_rank_lost")["killed_ranks"]
    incident = the_incident("dist_rank_lost")
    silent = [e for e in incident.evidence if e.rule == "correlation.silent_peer"]
    assert [e.rank for e in silent] == [killed]
    assert silent[0].value > SETTINGS.rank_lost_grace_s
    # the killed rank's last event is where the incident begins
    assert incident.first_ns == last_ns(rank_events("dist_rank_lost")[killed])


def test_timeout_evidence_carries_the_process_group_timeout() -> None:
    incident = the_incident("dist_timeout")
    ms = [e.value["facts"].get("timeout_ms") for e in incident.evidence
          if e.rule == "exception.uncaught" and isinstance(e.value, dict)]
    assert ms == [int(record("dist_timeout")["pg_timeout_s"] * 1000)]


def test_timeout_names_the_lagging_rank_and_folds_the_stall_and_the_sigterm_into_it() -> None:
    (lagging,) = facts("dist_timeout")["lagging_ranks"]
    incident = the_incident("dist_timeout")
    assert lagging in incident.ranks and incident.lead_rank == lagging
    assert [e.rank for e in incident.evidence if e.rule == "correlation.lagging_rank"] == [lagging]
    assert "one rank slower or stuck" in incident.hypotheses[0]["cause"]
    # the stall before the timeout and the launcher's SIGTERM of the lagging rank are this incident's
    folded = [i for i in judge(BY_NAME["dist_timeout"].events()).incidents() if i.explained_by]
    assert {(i.category, i.subtype) for i in folded} <= {("progress", "stalled"), ("process", "terminated")}
    assert all(i.explained_by == incident.incident_id and i.status == "resolved" for i in folded)
    assert any(c.startswith("process/terminated on rank") for c in incident.consequences)
    assert re.search(rf"lagging rank\(?s?\)?:? {lagging}\b", f"{incident.title} {incident.summary}", re.I)


def test_mismatch_evidence_names_the_shapes_each_rank_passed() -> None:
    numel = {int(r): n for r, n in facts("dist_mismatch")["all_reduce_numel"].items()}
    incident = the_incident("dist_mismatch")
    for ev in incident.evidence:
        if ev.rule != "exception.uncaught":
            continue
        assert isinstance(ev.value, dict)
        collectives = {c["rank"]: c for c in ev.value["facts"]["collectives"]}
        assert {r: c["tensor_shape"] for r, c in collectives.items()} == {r: [n] for r, n in numel.items()}
    assert all(str(n) in incident.title for n in numel.values())


def test_init_failure_evidence_names_the_unreachable_store_and_the_waiting_host() -> None:
    ports = {int(r): p for r, p in facts("dist_init_failure")["master_ports"].items()}
    host_rank = 0  # env:// rendezvous: rank 0 hosts the TCPStore on its MASTER_PORT
    (client,) = [r for r in ports if r != host_rank]
    incident = the_incident("dist_init_failure")
    by_rank = {e.rank: e.value for e in incident.evidence
               if e.rule == "exception.uncaught" and isinstance(e.value, dict)}
    assert by_rank[client]["facts"]["port"] == ports[client]  # the port where nothing listened
    assert by_rank[host_rank]["facts"]["joined"] == 1 and by_rank[host_rank]["facts"]["world_size"] == 2
    assert incident.first_step <= 0  # before any training step


def test_nan_one_rank_evidence_is_the_first_non_finite_loss_on_the_inf_rank() -> None:
    (inf_rank,) = facts("dist_nan_one_rank")["inf_ranks"]
    step = facts("dist_nan_one_rank")["inf_steps"][str(inf_rank)]
    incident = the_incident("dist_nan_one_rank")
    assert incident.first_step == step
    loss_ev = {e.rank: e.step for e in incident.evidence if e.rule == "loss.non_finite"}
    assert loss_ev[inf_rank] == step and min(loss_ev.values()) == step
    assert all(s > step for r, s in loss_ev.items() if r != inf_rank)  # the others' loss followed later
    assert not [i for i in yielded(judge(BY_NAME["dist_nan_one_rank"].events())) if i.category == "comm"]


def test_hang_is_a_stall_of_both_ranks_past_the_threshold() -> None:
    f, streams = facts("dist_hang"), rank_events("dist_hang")
    incident = the_incident("dist_hang")
    assert sorted(incident.ranks) == sorted(streams)
    assert incident.first_step == min(f["shard_batches"].values()) - 1  # the last step both completed
    stalled = {e.rank: e for e in incident.evidence if e.rule == "progress.stalled"}
    assert sorted(stalled) == sorted(streams)
    for rank, ev in stalled.items():
        assert ev.threshold == STALL_FLOOR_S < ev.value
        # the evidence is the stream's own silence: last heartbeat minus last step, give or take a beat
        events = streams[rank]
        silent = (max(int(e["time_unix_nano"]) for e in events if "heartbeat" in e)
                  - max(int(e["time_unix_nano"]) for e in events if "metrics" in e)) / 1e9
        assert abs(ev.value - silent) < 1.5
    # with the default 120 s floor this 40 s recording is (rightly) not a stall yet
    default = judge(BY_NAME["dist_hang"].events(), DetectionSettings())
    assert not [i for i in default.incidents() if i.category == "progress"]


# ------------------------------------------------------------------------------- streaming properties

@pytest.mark.parametrize("name", NAMES)
def test_replaying_the_streams_changes_nothing(name: str) -> None:
    events = BY_NAME[name].events()
    pipeline = judge(events)
    before, runs = pipeline.incidents(), pipeline.runs()
    assert pipeline.process(events).is_empty()
    assert pipeline.advance(last_ns(events) + int(SETTLE_S * 1e9)).is_empty()
    assert pipeline.incidents() == before and pipeline.runs() == runs
    twice = judge([*events, *events])  # each envelope delivered twice in one go
    assert twice.incidents() == before


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_restore_mid_stream_gives_the_same_incidents(name: str) -> None:
    events = BY_NAME[name].events()
    straight = judge(events)
    for cut in (len(events) // 3, 2 * len(events) // 3):
        first = Pipeline(SETTINGS)
        first.process(events[:cut])
        resumed = Pipeline.restore(first.snapshot(), SETTINGS)
        resumed.process(events[cut:])
        resumed.advance(last_ns(events) + int(SETTLE_S * 1e9))
        assert resumed.incidents() == straight.incidents()


# --------------------------------------------------------------------- the classifier on the real texts

@pytest.mark.parametrize("name", COMM)
def test_the_classifier_reads_each_ranks_real_log(name: str) -> None:
    """A rank that raised: its log classifies as the scenario's kind, confidently enough to open an
    incident from a log record, quoting a real line of it; so does the exception its SDK captured. A rank
    that did not raise (the lagging rank, the SIGKILLed rank) has no error text in its log."""
    expected = BY_NAME[name].label
    for rank, events in rank_events(name).items():
        text = rank_log(name, rank)
        found = classify_text(text)
        if not exceptions(events):
            # nothing that opens an incident: the vocabulary fallback (classify/vocab.py) may read a bare
            # word of the harness's own line ('capture[rank1] SIGKILL to self') below log_min_confidence
            assert found is None or (found.rule.startswith("vocab.")
                                     and found.confidence < SETTINGS.log_min_confidence), (rank, found)
            continue
        assert found is not None and found.kind == expected
        assert found.confidence >= SETTINGS.log_min_confidence
        assert any(line in strip_prefix(text) for line in found.lines)
        (exc,) = exceptions(events)
        body = exc["exception"]
        from_sdk = classify_exception(body["type"], body["message"])
        assert (from_sdk.kind, from_sdk.rule) == (found.kind, found.rule)


@pytest.mark.parametrize("name", [n for n in NAMES if (STREAMS_DIST / n / "launcher.log").exists()
                                  and "Root Cause" in (STREAMS_DIST / n / "launcher.log").read_text()])
def test_the_classifier_reads_torchruns_summary(name: str) -> None:
    """torchrun's ChildFailedError summary: the root-cause rank and exit it printed, and the failed ranks
    (the ranks scenario.json's per-rank exit codes list)."""
    text = (STREAMS_DIST / name / "launcher.log").read_text(errors="replace")
    found = classify_text(text)
    assert found is not None and found.rule == "torchrun.child-failed"
    root = re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n){0,2}?\s*rank\s*: (\d+)", text)
    assert root is not None and found.facts["root_cause_rank"] == int(root.group(1))
    assert sorted(found.facts["failed_ranks"]) == sorted(int(r) for r in facts(name)["exit_codes"])
    exit_code = facts(name)["exit_codes"][root.group(1)]
    if exit_code == -9:  # the SIGKILLed rank is torchrun's root cause: the kill, not a comm error
        assert found.kind == "process/killed"
    else:
        assert found.kind == BY_NAME[name].label


def test_a_rank_the_launcher_reports_killed_is_the_lost_rank_in_either_order() -> None:
    """Without the SDK's silence (a replay, or an agent reporting the launcher's exit codes), the killed
    rank's exit (torchrun's -9 for it, in scenario.json) arrives as an EXIT with signal 9: the peers'
    collective failure is still comm/rank-lost led by it, with the kill folded in -- whether the exit is
    seen before or after the peer's error."""
    (killed,) = facts("dist_rank_lost")["killed_ranks"]
    assert record("dist_rank_lost")["facts"]["exit_codes"][str(killed)] == -9
    per_rank = rank_events("dist_rank_lost")
    template = exits(per_rank[1 - killed])[0]
    peer_exit_ns = int(template["time_unix_nano"])
    for at in (peer_exit_ns + 1_000_000, last_ns(per_rank[killed]) + 1_000_000):
        exit_event = {**copy.deepcopy(template), "rank": killed, "event_id": f"killed-{at}",
                      "time_unix_nano": at, "pid": per_rank[killed][0]["pid"]}
        exit_event["lifecycle"] = {"phase": "EXIT", "exit_code": 137, "signal": 9, "reason": "signal"}
        events = sorted([*BY_NAME["dist_rank_lost"].events(), exit_event], key=lambda e: e["time_unix_nano"])
        pipeline = Pipeline(SETTINGS)
        pipeline.process(events)  # no advance(): the silence rule is not what decides here
        (incident,) = yielded(pipeline)
        assert (incident.category, incident.subtype, incident.lead_rank) == ("comm", "rank-lost", killed)
        assert sorted(incident.ranks) == sorted(per_rank)
        assert any(e.rule == "exit.code" and e.rank == killed for e in incident.evidence)
        assert [r.status for r in pipeline.runs()] == ["failed"]
