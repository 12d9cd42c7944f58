#!/usr/bin/env python3
"""Does ``trainguard replay`` of a run's files in the formats users have find what the SDK found live?

For each run -- the recorded SDK streams of the scenario corpus (``tests/scenarios/streams/*.jsonl``) and of
the varied corpus's trainings (``bench/corpus/out/<id>.jsonl``, recorded by ``python -m bench.corpus.record``;
``--record`` records the ones missing) -- two ways:

* **sdk**: the stream the SDK sent, through the engine's pipeline (``Pipeline().process``: what the
  backend makes of the live run);
* **replay**: what a user without the SDK has of the same training, written with the real libraries in one
  of six **dialects** (rotating over the runs) -- the same values per step, under the names and units that
  framework's users write (``DIALECTS``: e.g. TensorBoard ``train/grad_norm``, ``grad_norm/<layer>``,
  ``rss_mib``, ``step_time_ms``; Lightning ``CSVLogger`` ``grad_2.0_norm/<p>``, ``lr-AdamW``, a boolean clip
  flag; HF ``trainer_state.json`` ``log_history`` without times; an MLflow file store; a W&B
  ``wandb-history.jsonl`` with nested per-layer norms; a JSON-lines file with nested objects) -- plus the
  run's log as it would have printed it (its tracebacks) and its exit code, imported with
  ``trainguard replay``'s in-process API (``Importer`` + ``LocalBackend``, a temporary data directory).
  Fields a framework writes twice (the user's own ``lr`` beside the SDK's ``opt/lr``) are written once.
  Memory-snapshot and heartbeat events have no file equivalent and are not written.

Printed: a table per run (way, incidents as ``category/subtype@first step``), whether the kinds are the
same, and the totals. ``python bench/replay_equivalence.py [--corpus N] [--only NAME,...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard_engine.extract import batch_points  # noqa: E402
from trainguard_engine.pipeline import Pipeline  # noqa: E402
from trainguard_server.replay import Importer, LocalBackend, ReplayOptions, wait_for_run  # noqa: E402
from trainguard_server.replay.signals import Recognizer  # noqa: E402

SCENARIOS = REPO / "tests" / "scenarios" / "streams"
CORPUS_OUT = REPO / "bench" / "corpus" / "out"
Event = Dict[str, Any]
Steps = Dict[int, Dict[str, float]]

# --------------------------------------------------------------------------------------------- dialects
# TrainGuard name -> (the dialect's field name, unit factor: written = value / factor, boolean?)
Rename = Dict[str, Tuple[str, float, bool]]
_BASE: Rename = {
    "grad/clip_threshold": ("max_grad_norm", 1.0, False),
    "amp/scale": ("loss_scale", 1.0, False),
    "amp/overflow": ("found_inf", 1.0, True),
    "lora/grad_mean_A": ("lora_A_grad_mean", 1.0, False),
    "lora/grad_mean_B": ("lora_B_grad_mean", 1.0, False),
    "lora/params": ("lora_trainable_params", 1.0, False),
    "lora/no_grad_params": ("lora_frozen_params", 1.0, False),
    "seq/pad_attended_frac": ("pad_attended_frac", 1.0, False),
    "seq/mask_mismatch_frac": ("mask_mismatch_frac", 1.0, False),
    "seq/eos_missing_frac": ("missing_eos_frac", 1.0, False),
    "seq/labels_on_pad_frac": ("labels_on_pad_frac", 1.0, False),
    "mem/fragmentation": ("memory_fragmentation", 1.0, False),
}
DIALECTS: Dict[str, Tuple[Rename, str]] = {
    "tensorboard": (
        {
            **_BASE,
            "loss": ("train/loss", 1.0, False),
            "grad/global_norm": ("train/grad_norm", 1.0, False),
            "opt/lr": ("train/learning_rate", 1.0, False),
            "grad/layer/": ("grad_norm/", 1.0, False),
            "grad/clip_triggered": ("grad_clipped", 1.0, True),
            "time/step_s": ("step_time_ms", 1e-3, False),
            "mem/rss": ("rss_mib", 2.0**20, False),
            "mem/allocated": ("gpu_mem_allocated_mib", 2.0**20, False),
            "mem/reserved": ("memory_reserved_mib", 2.0**20, False),
            "mem/max_allocated": ("peak_memory_mib", 2.0**20, False),
            "seq/truncated_frac": ("truncated_pct", 0.01, False),
        },
        "SummaryWriter, HF-style names, MiB, ms, percent",
    ),
    "lightning-csv": (
        {
            **_BASE,
            "loss": ("train_loss_step", 1.0, False),
            "grad/global_norm": ("grad_2.0_norm_total", 1.0, False),
            "opt/lr": ("lr-AdamW", 1.0, False),
            "grad/layer/": ("grad_2.0_norm/", 1.0, False),
            "grad/clip_triggered": ("clipped", 1.0, True),
            "time/step_s": ("batch_time", 1.0, False),
            "mem/rss": ("process_memory_mb", 1e6, False),
            "mem/allocated": ("memory_allocated_gb", 1e9, False),
            "seq/truncated_frac": ("truncated_frac", 1.0, False),
            "amp/scale": ("grad_scale", 1.0, False),
        },
        "CSVLogger.log_metrics, no times (step times from batch_time), MB, booleans",
    ),
    "hf-trainer": (
        {
            **_BASE,
            "loss": ("loss", 1.0, False),
            "grad/global_norm": ("grad_norm", 1.0, False),
            "opt/lr": ("learning_rate", 1.0, False),
            "grad/layer/": ("layer_grad_norm/", 1.0, False),
            "grad/clip_triggered": ("clip_triggered", 1.0, True),
            "time/step_s": ("step_time", 1.0, False),
            "mem/rss": ("cpu_mem_gb", 1e9, False),
            "seq/truncated_frac": ("truncation_rate", 1.0, False),
        },
        "trainer_state.json log_history, no times, GB",
    ),
    "mlflow": (
        {
            **_BASE,
            "loss": ("loss", 1.0, False),
            "grad/global_norm": ("global_grad_norm", 1.0, False),
            "opt/lr": ("lr", 1.0, False),
            "grad/layer/": ("grad_norms/", 1.0, False),
            "grad/clip_triggered": ("was_clipped", 1.0, False),
            "time/step_s": ("iteration_time_s", 1.0, False),
            "mem/rss": ("host_memory_mib", 2.0**20, False),
            "seq/truncated_frac": ("frac_truncated", 1.0, False),
        },
        "MlflowClient.log_batch into a file store, ms timestamps",
    ),
    "wandb-history": (
        {
            **_BASE,
            "loss": ("train/loss", 1.0, False),
            "grad/global_norm": ("train/global_grad_norm", 1.0, False),
            "opt/lr": ("train/lr", 1.0, False),
            "grad/layer/": ("grad_norms/", 1.0, False),
            "grad/clip_triggered": ("train/clip_active", 1.0, True),
            "time/step_s": ("perf/step_time_ms", 1e-3, False),
            "mem/rss": ("rssMB", 1e6, False),
            "seq/truncated_frac": ("truncated_fraction", 1.0, False),
        },
        "wandb-history.jsonl: _step/_timestamp, nested per-layer dict, booleans, rssMB",
    ),
    "jsonl-nested": (
        {
            **_BASE,
            "loss": ("train_loss", 1.0, False),
            "grad/global_norm": ("total_grad_norm", 1.0, False),
            "opt/lr": ("learning_rate", 1.0, False),
            "grad/layer/": ("grad_norm/", 1.0, False),
            "grad/clip_triggered": ("grad_clip_triggered", 1.0, True),
            "time/step_s": ("iter_time_ms", 1e-3, False),
            "mem/rss": ("mem/rss_mib", 2.0**20, False),
            "seq/truncated_frac": ("seq/truncated_frac", 1.0, False),
        },
        "metrics.jsonl: iteration, timestamp, nested objects (grad_norm.{layer}, mem.rss_mib)",
    ),
}
_RECOGNISER = Recognizer()


def dialect_name(name: str, rename: Rename) -> Optional[Tuple[str, float, bool]]:
    """The dialect's field for a TrainGuard metric; None for a field the user would not write twice (a
    framework's own copy, e.g. the user's ``lr`` beside ``opt/lr``, which the recognizer also maps)."""
    if name.startswith("grad/layer/"):
        field, factor, as_bool = rename["grad/layer/"]
        return field + name[len("grad/layer/") :], factor, as_bool
    if name in rename:
        return rename[name]
    target = _RECOGNISER.target_of(name)
    if target != name:
        return None  # a synonym of a signal the SDK sent under its own name
    return name, 1.0, False


def user_fields(values: Mapping[str, float], rename: Rename) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, value in values.items():
        said = dialect_name(name, rename)
        if said is None:
            continue
        field, factor, as_bool = said
        out[field] = (value != 0.0) if as_bool and value == value else value / factor
    return out


def _nest(fields: Mapping[str, Any], prefixes: Sequence[str]) -> Dict[str, Any]:
    """``grad_norm/x`` -> ``{"grad_norm": {"x": ...}}`` for the given prefixes (as nested-dict loggers do)."""
    out: Dict[str, Any] = {}
    for name, value in fields.items():
        for prefix in prefixes:
            if name.startswith(prefix + "/"):
                out.setdefault(prefix, {})[name[len(prefix) + 1 :]] = value
                break
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------------- writers


def write_tensorboard(folder: Path, steps: Steps, times: Dict[int, int], rename: Rename) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    run = folder / "tb" / "run"
    writer = SummaryWriter(str(run))
    for step in sorted(steps):
        for name, value in user_fields(steps[step], rename).items():
            writer.add_scalar(name, float(value), step, walltime=times[step] / 1e9)
    writer.close()
    return run


def write_lightning_csv(folder: Path, steps: Steps, times: Dict[int, int], rename: Rename) -> Path:
    from pytorch_lightning.loggers import CSVLogger

    logger = CSVLogger(str(folder), name="lightning_logs", version=0)
    for step in sorted(steps):
        logger.log_metrics(user_fields(steps[step], rename), step=step)
    logger.save()
    logger.finalize("success")
    return Path(logger.log_dir) / "metrics.csv"


def write_hf_trainer(folder: Path, steps: Steps, times: Dict[int, int], rename: Rename) -> Path:
    history = []
    last = max(steps) if steps else 0
    for step in sorted(steps):
        entry = user_fields(steps[step], rename)
        entry.update({"epoch": round(step / max(1, last), 4), "step": step})
        history.append(entry)
    path = folder / "out" / "trainer_state.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"global_step": last, "log_history": history, "max_steps": last}, indent=2))
    return path


def write_mlflow(folder: Path, steps: Steps, times: Dict[int, int], rename: Rename) -> Path:
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    run = client.create_run("0")
    for step in sorted(steps):
        ts = times[step] // 1_000_000
        metrics = [Metric(k, float(v), ts, step) for k, v in user_fields(steps[step], rename).items()]
        for lo in range(0, len(metrics), 1000):
            client.log_batch(run.info.run_id, metrics=metrics[lo : lo + 1000])
    client.set_terminated(run.info.run_id)
    return folder / "mlruns" / "0" / run.info.run_id


def write_wandb_history(folder: Path, steps: Steps, times: Dict[int, int], rename: Rename) -> Path:
    run = folder / "wandb" / "run-20260301_120000-abc123"
    (run / "files").mkdir(parents=True)
    start = min(times.values()) if times else 0
    with open(run / "files" / "wandb-history.jsonl", "w", encoding="utf-8") as fh:
        for step in sorted(steps):
            row = _nest(user_fields(steps[step], rename), ["grad_norms"])
            row.update(
                {"_step": step, "_timestamp": times[step] / 1e9, "_runtime": (times[step] - start) / 1e9}
            )
            fh.write(json.dumps(row) + "\n")
    return run


def write_jsonl_nested(folder: Path, steps: Steps, times: Dict[int, int], rename: Rename) -> Path:
    path = folder / "metrics.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for step in sorted(steps):
            row = _nest(user_fields(steps[step], rename), ["grad_norm", "mem", "seq"])
            row.update({"iteration": step, "timestamp": round(times[step] / 1e9, 6)})
            fh.write(json.dumps(row) + "\n")
    return path


WRITERS: Dict[str, Callable[[Path, Steps, Dict[int, int], Rename], Path]] = {
    "tensorboard": write_tensorboard,
    "lightning-csv": write_lightning_csv,
    "hf-trainer": write_hf_trainer,
    "mlflow": write_mlflow,
    "wandb-history": write_wandb_history,
    "jsonl-nested": write_jsonl_nested,
}


# ------------------------------------------------------------------------------------------------ runs


@dataclass
class Outcome:
    name: str
    dialect: str
    sdk: List[Tuple[str, int]]
    replay: List[Tuple[str, int]]
    records: int
    signals: str
    seconds: float

    @property
    def same(self) -> bool:
        return sorted({k for k, _ in self.sdk}) == sorted({k for k, _ in self.replay})


def read_events(path: Path) -> List[Event]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def metrics_by_step(events: Sequence[Event]) -> Tuple[Steps, Dict[int, int]]:
    steps: Steps = {}
    times: Dict[int, int] = {}
    for event in events:
        if "metrics" not in event or int(event.get("rank") or 0) != 0:
            continue
        for name, step, value in batch_points(event["metrics"], int(event.get("step") or 0)):
            steps.setdefault(step, {})[name] = value
            times.setdefault(step, int(event["time_unix_nano"]))
    return steps, times


def exit_code(events: Sequence[Event]) -> Optional[int]:
    for event in events:
        life = event.get("lifecycle") or {}
        if life.get("phase") == "EXIT":
            return int(life.get("exit_code", 0))
    return None


def user_log(events: Sequence[Event], path: Path) -> Optional[Path]:
    """What the job printed that a user keeps: its log records and tracebacks, ``logging``-stamped."""
    lines: List[str] = []
    for event in events:
        stamp = datetime.fromtimestamp(int(event["time_unix_nano"]) / 1e9)
        asctime = stamp.strftime("%Y-%m-%d %H:%M:%S") + f",{stamp.microsecond // 1000:03d}"
        if "log" in event:
            lines.append(f"{asctime} {event['log'].get('level', 'INFO')} {event['log'].get('message', '')}")
        elif "exception" in event:
            lines.append(event["exception"].get("traceback", "").rstrip("\n"))
    if not lines:
        return None
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def kinds(incidents: Sequence[Mapping[str, Any]]) -> List[Tuple[str, int]]:
    return sorted((f"{i['category']}/{i['subtype']}", int(i.get("first_step") or 0)) for i in incidents)


def sdk_way(events: Sequence[Event]) -> List[Tuple[str, int]]:
    pipeline = Pipeline()
    pipeline.process(events)
    return kinds([i.to_dict() for i in pipeline.incidents()])


def replay_way(
    name: str, events: Sequence[Event], dialect: str, work: Path, backend: LocalBackend
) -> Tuple[List[Tuple[str, int]], int, str]:
    steps, times = metrics_by_step(events)
    folder = work / name
    folder.mkdir(parents=True)
    rename = DIALECTS[dialect][0]
    path = WRITERS[dialect](folder, steps, times, rename)
    log = user_log(events, folder / "train.log")
    options = ReplayOptions(
        run_id=f"eq-{name}",
        run_name=name,
        inputs=[(0, path, "")],
        logs=[(0, log)] if log else [],
        exit_code=exit_code(events),
    )
    summary = Importer(options, backend).run()
    if summary.error:
        raise RuntimeError(f"{name}: {summary.error}")
    run, _ = wait_for_run(backend, summary, timeout_s=60)
    incidents = backend.incidents(options.run_id) if run is not None else []
    src = summary.sources[0]
    records = src.metrics.records if src.metrics is not None else 0
    said = "; ".join(line for line in (src.recognition.lines() if src.recognition else []) if "<-" in line)
    return kinds(incidents), records, said


def corpus_runs(n: int, record: bool) -> List[Tuple[str, Path]]:
    """``n`` corpus runs, the first of each (cause, framework) in manifest order, then more."""
    manifest = json.loads((REPO / "bench" / "corpus" / "manifest.json").read_text())["runs"]
    seen: set = set()
    first, rest = [], []
    for spec in manifest:
        key = (spec["cause"], spec["framework"])
        (rest if key in seen else first).append(spec["id"])
        seen.add(key)
    ids = (first + rest)[:n]
    missing = [i for i in ids if not (CORPUS_OUT / f"{i}.jsonl").exists()]
    if missing and record:
        from bench.corpus import record as recorder

        recorder.main(["--only", ",".join(missing)])
    return [(i, CORPUS_OUT / f"{i}.jsonl") for i in ids if (CORPUS_OUT / f"{i}.jsonl").exists()]


def run_all(streams: Sequence[Tuple[str, Path]], work: Path, out: Any = sys.stdout) -> List[Outcome]:
    outcomes: List[Outcome] = []
    names = list(DIALECTS)
    backend = LocalBackend(work / "data")
    try:
        for index, (name, path) in enumerate(streams):
            dialect = names[index % len(names)]
            events = read_events(path)
            started = time.perf_counter()
            sdk = sdk_way(events)
            replay, records, said = replay_way(name, events, dialect, work / "files", backend)
            outcomes.append(Outcome(name, dialect, sdk, replay, records, said, time.perf_counter() - started))
            o = outcomes[-1]
            out.write(
                f"  {name:<24} {dialect:<14} {'same' if o.same else 'DIFFERENT':<9} sdk: {_said(sdk)} | "
                f"replay: {_said(replay)}\n"
            )
            out.flush()
    finally:
        backend.close()
    return outcomes


def _said(found: Sequence[Tuple[str, int]]) -> str:
    return ", ".join(f"{k}@{s}" for k, s in found) or "-"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--corpus", type=int, default=12, help="varied-corpus runs besides the scenarios (12)"
    )
    parser.add_argument("--only", help="comma-separated run names")
    parser.add_argument(
        "--record", action="store_true", help="record corpus runs missing from bench/corpus/out"
    )
    args = parser.parse_args(argv)
    streams = [(p.stem, p) for p in sorted(SCENARIOS.glob("*.jsonl"))] + corpus_runs(args.corpus, args.record)
    if args.only:
        wanted = set(args.only.split(","))
        streams = [s for s in streams if s[0] in wanted]
    print(
        f"replay equivalence: {len(streams)} runs, dialects: "
        + "; ".join(f"{k} ({v[1]})" for k, v in DIALECTS.items())
    )
    with tempfile.TemporaryDirectory(prefix="tg-replay-eq-") as tmp:
        outcomes = run_all(streams, Path(tmp))
    same = sum(o.same for o in outcomes)
    print("\n| run | dialect | records | SDK incidents (kind@first step) | replay incidents | same kinds |")
    print("|---|---|---|---|---|---|")
    for o in outcomes:
        print(
            f"| {o.name} | {o.dialect} | {o.records} | {_said(o.sdk)} | {_said(o.replay)} | "
            f"{'yes' if o.same else '**no**'} |"
        )
    steps_equal = sum(1 for o in outcomes if o.same and o.sdk == o.replay)
    print(
        f"\nsame incident kinds: {same}/{len(outcomes)} runs; same kinds and first steps: "
        f"{steps_equal}/{len(outcomes)}; {sum(o.seconds for o in outcomes):.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
