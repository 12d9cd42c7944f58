"""A recorded subset of bench/replay_equivalence.py: five committed SDK streams of the scenario corpus, each
written in one dialect users have (TensorBoard, HF trainer_state.json, MLflow file store, W&B history
JSON lines, nested JSON lines -- with the real writers, framework names and units) and
imported with ``trainguard replay``; the incidents must be those the pipeline makes of the SDK stream,
kind and first step."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay_equivalence import SCENARIOS, read_events, replay_way, sdk_way
from trainguard_server.replay import LocalBackend

CASES = [
    ("vanishing", "tensorboard"),
    ("leak", "lightning-csv"),
    ("truncation", "hf-trainer"),
    ("nan_source", "mlflow"),
    ("oscillation", "wandb-history"),
    ("lora_break", "jsonl-nested"),
]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    local = LocalBackend(tmp_path_factory.mktemp("eq") / "data")
    yield local
    local.close()


@pytest.mark.parametrize("name,dialect", CASES)
def test_replay_of_the_users_files_finds_what_the_sdk_found(
    name: str, dialect: str, backend: LocalBackend, tmp_path: Path
) -> None:
    events = read_events(SCENARIOS / f"{name}.jsonl")
    sdk = sdk_way(events)
    assert sdk, f"{name}: the SDK stream has incidents to match"
    replay, records, said = replay_way(name, events, dialect, tmp_path, backend)
    assert records > 0 and "<-" in said
    assert replay == sdk, (said, replay, sdk)
