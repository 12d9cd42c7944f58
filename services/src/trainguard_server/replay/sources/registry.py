"""The readers by format name, detection of an input's format by its shape, and discovery of the runs in a
folder tree.

Contract:

* :data:`FORMATS`: name -> :class:`Format` (reader class, one-line description, detection). Readers are
  imported here; their optional libraries only when they read.
* :func:`detect(path) <detect>`: the format of a file or run folder (the first format whose ``detect`` says
  yes, in :data:`FORMATS` order, most specific first), or None.
* :func:`open_source`: a :class:`~.base.Source` for ``path`` in ``fmt`` (``""``/``"auto"``: detected);
  ValueError naming the known formats when it is unknown or cannot be told.
* :func:`find_runs(root) <find_runs>`: the runs under ``root``, each a :class:`FoundRun` (a name, its metric
  inputs with their formats, its text logs) -- a TensorBoard log dir (each folder holding event files is a
  run), an ``mlruns/`` store (each run folder), a ``wandb/`` folder (each ``run-*``/``offline-run-*``), an
  HF output dir (``trainer_state.json``; the latest ``checkpoint-*``'s when the top has none), Lightning
  ``version_*`` folders (``metrics.csv``), and any folder with ``*.jsonl``/``*.csv`` metrics or Megatron /
  DeepSpeed text logs. Hidden folders (MLflow's ``.trash`` of deleted runs) and symbolic links (W&B's
  ``latest-run``) are not followed. Nothing is read beyond each file's first 64 KiB.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Type

from ..signals import Recognizer
from .base import Source, SourceOptions
from .csv_table import CsvSource
from .deepspeed import DeepSpeedLogSource
from .hf_log import HfLogSource
from .hf_trainer import TrainerStateSource
from .jsonl import JsonlSource
from .megatron import MegatronLogSource
from .mlflow_store import MlflowRunSource
from .tensorboard import TensorBoardSource, add_scalars_children
from .wandb_run import WandbRunSource


@dataclass(frozen=True)
class Format:
    name: str
    reader: Type[Source]
    description: str
    detect: Callable[[Path], bool]


FORMATS: Dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "tensorboard",
            TensorBoardSource,
            "TensorBoard event files (a run folder or one tfevents file)",
            TensorBoardSource.detect,
        ),
        Format(
            "mlflow",
            MlflowRunSource,
            "an MLflow file-store run folder (mlruns/<experiment>/<run>)",
            MlflowRunSource.detect,
        ),
        Format(
            "wandb",
            WandbRunSource,
            "a W&B run folder (offline-run-*/run-*: its .wandb file or files/wandb-history.jsonl)",
            WandbRunSource.detect,
        ),
        Format(
            "hf-trainer",
            TrainerStateSource,
            "HF Trainer trainer_state.json (log_history)",
            TrainerStateSource.detect,
        ),
        Format(
            "megatron",
            MegatronLogSource,
            "Megatron-LM text log (' iteration N/ M | lm loss: ... |')",
            MegatronLogSource.detect,
        ),
        Format(
            "deepspeed",
            DeepSpeedLogSource,
            "DeepSpeed text log ('[Rank 0] step=N, skipped=K, lr=[...]')",
            DeepSpeedLogSource.detect,
        ),
        Format(
            "hf-log",
            HfLogSource,
            "HF Trainer's printed log dicts ({'loss': ..., 'grad_norm': ..., 'learning_rate': ...})",
            HfLogSource.detect,
        ),
        Format(
            "csv",
            CsvSource,
            "CSV with a header (Lightning CSVLogger metrics.csv, W&B/MLflow CSV exports, any field names)",
            CsvSource.detect,
        ),
        Format(
            "jsonl",
            JsonlSource,
            "JSON lines, one object per step (any field names; W&B wandb-history.jsonl)",
            JsonlSource.detect,
        ),
    )
}


def detect(path: Path) -> Optional[str]:
    """The format of ``path`` (see the module doc), or None."""
    for fmt in FORMATS.values():
        try:
            if fmt.detect(path):
                return fmt.name
        except OSError:
            continue
    return None


def open_source(
    path: Path,
    fmt: str = "",
    recognizer: Optional[Recognizer] = None,
    options: Optional[SourceOptions] = None,
    *,
    key: str = "",
) -> Source:
    """A reader of ``path`` in ``fmt`` (detected when empty or ``auto``); ValueError when unknown."""
    name = fmt if fmt and fmt != "auto" else detect(path)
    if name is None:
        raise ValueError(f"cannot tell the format of {path}: give --format ({', '.join(FORMATS)})")
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: one of {', '.join(FORMATS)}")
    return FORMATS[name].reader(path, recognizer, options, key=key)


@dataclass
class FoundRun:
    """One run found in a folder tree."""

    name: str  # path relative to the root ("." for the root itself)
    inputs: List[Tuple[Path, str]] = field(default_factory=list)  # (metrics file or folder, format)
    logs: List[Path] = field(default_factory=list)


_LOG_NAMES = re.compile(r".*\.(log|out|err|txt)$|^(stdout|stderr|output)$", re.IGNORECASE)
_METRIC_FILES = re.compile(r".*\.(jsonl|csv)$", re.IGNORECASE)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _folder_format(folder: Path) -> Optional[str]:
    for name in ("tensorboard", "mlflow", "wandb"):
        if FORMATS[name].detect(folder):
            return name
    return None


def _checkpoint_no(folder: Path) -> int:
    m = _CHECKPOINT.match(folder.name)
    return int(m.group(1)) if m is not None else -1


def find_runs(root: Path) -> List[FoundRun]:
    """The runs under ``root`` (see the module doc), sorted by name."""
    root = Path(root)
    runs: Dict[str, FoundRun] = {}

    def run_of(folder: Path) -> FoundRun:
        rel = folder.relative_to(root).as_posix() if folder != root else "."
        return runs.setdefault(rel, FoundRun(rel))

    for dirpath, dirnames, filenames in os.walk(root):
        folder = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .trash: MLflow's deleted runs
        fmt = _folder_format(folder)
        if fmt == "tensorboard":  # add_scalars' subfolders are this run's, not runs of their own
            children = {f.name for f, _ in add_scalars_children(folder)}
            dirnames[:] = [d for d in dirnames if d not in children]
        if fmt is not None:
            run_of(folder).inputs.append((folder, fmt))
            if fmt in ("mlflow", "wandb"):
                dirnames[:] = []  # the run folder is one input
                continue
        if _CHECKPOINT.match(folder.name) and (folder.parent / "trainer_state.json").exists():
            continue  # the output dir's own trainer_state.json has the whole history
        for name in sorted(filenames):
            path = folder / name
            if fmt == "tensorboard" and "tfevents" in name:
                continue
            if name == "trainer_state.json":
                target = folder
                m = _CHECKPOINT.match(folder.name)
                if m is not None:  # the latest checkpoint's, under the output dir's run
                    target = folder.parent
                    if any(
                        _checkpoint_no(d) > int(m.group(1)) and (d / "trainer_state.json").exists()
                        for d in folder.parent.iterdir()
                    ):
                        continue
                run_of(target).inputs.append((path, "hf-trainer"))
            elif _METRIC_FILES.match(name):
                found = detect(path)
                if found in ("csv", "jsonl"):
                    run_of(folder).inputs.append((path, found))
            elif _LOG_NAMES.match(name):
                found = detect(path)
                run = run_of(folder)
                if found in ("megatron", "deepspeed", "hf-log"):
                    run.inputs.append((path, found))
                run.logs.append(path)
    return sorted((r for r in runs.values() if r.inputs), key=lambda r: r.name)
