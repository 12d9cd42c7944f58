"""The scenario corpus as one manifest: every real training run the detection engine is judged on, what it
must be classified as, and where its recorded event streams live.

Three sources, one shape:

* ``cpu``  -- single-process CPU trainings that run in seconds. ``module`` runs one with
  ``python -m <module> <name> [--seed N]`` and the SDK configured from the environment
  (``tests/scenarios/record.py`` records them into ``streams/<name>.jsonl``).
* ``gpu``  -- trainings that need a CUDA device, run on the lent H200 and committed as recorded streams
  (``streams_gpu/<name>.jsonl``; the command is in ``streams_gpu/README.md``).
* ``dist`` -- two-process ``torch.distributed`` (gloo) jobs launched by torchrun; each rank's stream is
  ``streams_dist/<name>/rank<N>.events.jsonl``.

``expected`` is the one incident kind ``(category, subtype)`` the run must yield; ``None`` marks a
healthy run, which must yield none. ``lead_rank`` (dist only) is the rank the incident must name as where
it started. Tests and ``bench/detection.py`` read this manifest; nothing else lists scenarios.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
STREAMS = HERE / "streams"
STREAMS_GPU = HERE / "streams_gpu"
STREAMS_DIST = HERE / "streams_dist"

Kind = Tuple[str, str]


@dataclass(frozen=True)
class Scenario:
    """One run of the corpus (see the module docstring)."""

    name: str
    expected: Optional[Kind]
    source: str = "cpu"                      # "cpu" | "gpu" | "dist"
    module: str = "tests.scenarios.trainings"  # cpu: the module whose main() runs it
    lead_rank: int = -1                      # dist: the rank the incident must lead with
    note: str = ""

    @property
    def healthy(self) -> bool:
        return self.expected is None

    @property
    def label(self) -> str:
        """``"category/subtype"``, or ``"healthy"``."""
        return "/".join(self.expected) if self.expected else "healthy"

    def stream_files(self) -> List[Path]:
        """The recorded stream file(s): one per rank for ``dist``."""
        if self.source == "dist":
            return sorted((STREAMS_DIST / self.name).glob("rank*.events.jsonl"))
        folder = STREAMS_GPU if self.source == "gpu" else STREAMS
        return [folder / f"{self.name}.jsonl"]

    def events(self) -> List[Dict[str, Any]]:
        """Every envelope of the recorded run, ranks merged in event-time order (ties: file order)."""
        return load_events(self.stream_files())


def load_events(paths: Sequence[Path]) -> List[Dict[str, Any]]:
    """Every envelope of the stream files ``paths`` (plain, or gzipped when named ``*.gz``) merged in
    event-time order (ties: file order)."""
    out: List[Tuple[int, int, Dict[str, Any]]] = []
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    event = json.loads(line)
                    out.append((int(event.get("time_unix_nano") or 0), len(out), event))
    out.sort(key=lambda item: (item[0], item[1]))
    return [event for _t, _i, event in out]


def _shift_times(obj: Any, shift: int) -> None:
    """Add ``shift`` to every positive integer ``*_unix_nano`` field, in place (nested)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key.endswith("unix_nano") and type(value) is int and value > 0:
                obj[key] = value + shift
            elif isinstance(value, (dict, list)):
                _shift_times(value, shift)
    elif isinstance(obj, list):
        for item in obj:
            _shift_times(item, shift)


def retimed(events: Sequence[Dict[str, Any]], end_ns: int) -> List[Dict[str, Any]]:
    """Copies of ``events`` with every time shifted by one constant so that the last one is ``end_ns`` (a
    recorded run delivered as if it had just happened: otherwise a backend's processing-time timers call a
    run recorded hours ago lost at once)."""
    last = max(int(e.get("time_unix_nano") or 0) for e in events)
    out: List[Dict[str, Any]] = json.loads(json.dumps(list(events)))
    for event in out:
        _shift_times(event, end_ns - last)
    return out


SCENARIOS: Tuple[Scenario, ...] = (
    # healthy negatives: realistic noise, LR warmup, clipping
    Scenario("healthy_mlp", None),
    Scenario("healthy_lm", None),
    Scenario("healthy_cnn", None),
    # loss and gradient dynamics (tests/scenarios/trainings.py)
    Scenario("oscillation", ("loss", "oscillation")),
    Scenario("rise_after_fall", ("loss", "rise-after-fall")),
    Scenario("plateau", ("loss", "plateau")),
    Scenario("explosion", ("gradient", "explosion")),
    Scenario("vanishing", ("gradient", "vanishing")),
    Scenario("clip_stale", ("gradient", "clip-stale")),
    Scenario("nan_source", ("gradient", "nan-source")),
    # process-level: a real bug that raises, a real deadlock (tests/scenarios/trainings_process.py)
    Scenario("crash", ("process", "exception"), module="tests.scenarios.trainings_process",
             note="x.view(BATCH, ...) of the epoch's incomplete last batch: RuntimeError, exit 1"),
    Scenario("stall", ("progress", "stalled"), module="tests.scenarios.trainings_process",
             note="DataLoader workers forked while a thread holds the dataset's lock; SIGTERMed after 12 s"),
    # memory: a real leak in a CPU training loop (tests/scenarios/trainings_memory.py)
    Scenario("leak", ("memory", "leak"), module="tests.scenarios.trainings_memory",
             note="held-out loss computed outside no_grad and summed as a tensor: every step's graph kept"),
    # fine-tuning: what only the job can see (tests/scenarios/trainings_finetune.py)
    Scenario("truncation", ("sequence", "truncation"), module="tests.scenarios.trainings_finetune",
             note="collator builds a right-padding mask from pre-truncation lengths; tokenizer pads left; EOS cut"),
    Scenario("lora_break", ("adapter", "lora-grad-break"), module="tests.scenarios.trainings_finetune",
             note="reentrant checkpointing from step 24 over frozen embeddings: adapters get no grad, head learns"),
    Scenario("healthy_lora", None, module="tests.scenarios.trainings_finetune",
             note="the same LoRA fine-tune with enable_input_require_grads; correct collation, checked"),
    # real H200 runs (tests/scenarios/gpu.py)
    Scenario("gpu_oom", ("memory", "oom"), source="gpu"),
    Scenario("gpu_fragmentation", ("memory", "fragmentation"), source="gpu"),
    Scenario("gpu_amp_overflow", ("memory", "amp-overflow"), source="gpu"),
    Scenario("gpu_leak", ("memory", "leak"), source="gpu",
             note="every step's logits kept on the GPU for an epoch-end report: +4 MiB allocated per step"),
    Scenario("gpu_healthy_amp", None, source="gpu",
             note="fp16 + GradScaler (clip 1.0) on a normalised regression: the scaler skips its first steps "
                  "while it calibrates down from 2**16 (its job), then the loss falls"),
    Scenario("gpu_context_leak", ("memory", "context-leak"), source="gpu",
             note="a previous job's orphaned evaluation worker holds a CUDA context and 3 GiB on the GPU"),
    # two-process torch.distributed jobs on the CPU, gloo (tests/scenarios/dist.py runs
    # tests/fixtures/nccl/capture.py; streams_dist/README.md). Judged as a runtime would: the events, then
    # Pipeline.advance() a minute after the last one (a silent rank is only known to be lost by then)
    Scenario("dist_timeout", ("comm", "timeout"), source="dist",
             note="rank 1 sleeps 90 s before an all_reduce rank 0 entered: rank 0's gloo recv times out "
                  "after the 10 s PG timeout, then torchrun SIGTERMs rank 1"),
    Scenario("dist_mismatch", ("comm", "mismatch"), source="dist",
             note="TORCH_DISTRIBUTED_DEBUG=DETAIL, gradients all-reduced by hand; all_reduce of 1024 vs 2048 "
                  "floats: 'Detected mismatch between collectives' on both ranks"),
    Scenario("dist_rank_lost", ("comm", "rank-lost"), source="dist", lead_rank=1,
             note="rank 1 SIGKILLs itself after step 10 (no exit event); rank 0's next all-reduce fails "
                  "with gloo 'Connection reset by peer'"),
    Scenario("dist_init_failure", ("comm", "init-failure"), source="dist",
             note="no torchrun; rank 1's MASTER_PORT has no listener: its TCPStore client times out, rank 0 "
                  "times out waiting for clients (1/2 joined)"),
    Scenario("dist_nan_one_rank", ("gradient", "nan-source"), source="dist", lead_rank=1,
             note="rank 1's batch of step 10 holds an inf: its loss goes NaN, DDP's all-reduce spreads NaN "
                  "gradients to rank 0 (whose loss is NaN from step 11)"),
    Scenario("dist_hang", ("progress", "stalled"), source="dist",
             note="uneven shards under DDP: rank 1 waits in the final barrier, rank 0 in DDP's all-reduce "
                  "(PG timeout 600 s), both heartbeating; SIGKILLed after 40 s. Needs stall_min_s < ~30 s "
                  "(the tests use 5 s; the default floor is 120 s)"),
)

BY_NAME: Dict[str, Scenario] = {s.name: s for s in SCENARIOS}


def of_source(source: str) -> Tuple[Scenario, ...]:
    """The scenarios recorded from ``source`` ("cpu" | "gpu" | "dist")."""
    return tuple(s for s in SCENARIOS if s.source == source)


def healthy() -> Tuple[Scenario, ...]:
    return tuple(s for s in SCENARIOS if s.healthy)


def anomalous() -> Tuple[Scenario, ...]:
    return tuple(s for s in SCENARIOS if not s.healthy)
