"""What ``trainguard replay PATH...`` imports: each path is a metrics file, a run folder, or a tree of runs
(:func:`.registry.find_runs`), planned as one import per run.

Contract of :func:`plan`: a file, or a folder that is itself one run of a folder format (TensorBoard,
MLflow, W&B), is one run with that input; any other folder is searched, and every run found becomes an
import. Run ids are deterministic, so re-importing the same tree changes nothing: ``run_id`` when one
run is planned, ``<run_id>-<relative path>`` for several; without ``run_id``, the folder's name plus the
relative path, and 8 hex digits of the absolute path's hash (two trees with the same names stay apart).
``fmt`` forces the format of every path given (a file or a run folder; not a tree). ValueError with a
message when a path does not exist or holds nothing importable.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Dict, List, Optional, Sequence, TextIO, Tuple

from .registry import FORMATS, detect, find_runs

if TYPE_CHECKING:
    from ..backends import Backend
    from ..importer import ReplayOptions

_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class PlannedRun:
    run_id: str
    run_name: str
    inputs: List[Tuple[Path, str]] = field(default_factory=list)  # (file or folder, format)
    logs: List[Path] = field(default_factory=list)


def _slug(text: str) -> str:
    return _SLUG.sub("_", text).strip("_") or "run"


def _default_id(root: Path, rel: str) -> str:
    digest = hashlib.sha256(str(root.resolve() / rel).encode()).hexdigest()[:8]
    name = root.resolve().name if rel == "." else f"{root.resolve().name}-{rel}"
    return f"{_slug(name)[:80]}-{digest}"


def plan(paths: Sequence[Path], fmt: str = "", run_id: Optional[str] = None) -> List[PlannedRun]:
    """The imports ``trainguard replay PATH...`` makes (see the module doc)."""
    if fmt and fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}: one of {', '.join(FORMATS)}")
    found: List[Tuple[Path, str, List[Tuple[Path, str]], List[Path]]] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"no such file or folder: {path}")
        if fmt and fmt != "auto":
            found.append((path, ".", [(path, fmt)], []))
            continue
        kind = detect(path)
        if path.is_file() or kind in ("tensorboard", "mlflow", "wandb"):
            if kind is None:
                raise ValueError(f"cannot tell the format of {path}: give --format ({', '.join(FORMATS)})")
            logs = [path] if kind in ("megatron", "deepspeed", "hf-log") else []
            found.append((path, ".", [(path, kind)], logs))
            continue
        runs = find_runs(path)
        if not runs:
            raise ValueError(f"no runs found under {path} (known formats: {', '.join(FORMATS)})")
        found.extend((path, r.name, r.inputs, r.logs) for r in runs if r.inputs)
    planned: List[PlannedRun] = []
    for root, rel, inputs, logs in found:
        name = root.name if rel == "." else f"{root.name}/{rel}"
        if run_id and len(found) == 1:
            rid = run_id
        elif run_id:
            rid = f"{run_id}-{_slug(name if len(paths) > 1 else rel)}"
        else:
            rid = _default_id(root, rel)
        planned.append(PlannedRun(rid, name, list(inputs), list(logs)))
    return planned


def import_runs(
    paths: Sequence[Path],
    fmt: str,
    base: ReplayOptions,
    backend: Backend,
    *,
    quiet: bool = False,
    wait: bool = True,
    wait_timeout: float = 120.0,
    out: Optional[IO[str]] = None,
    err: Optional[TextIO] = None,
) -> int:
    """``trainguard replay PATH...``: plan the runs, import each (its summary, then -- ``wait`` -- its status
    and incidents), then one line per run; 0 when every import ran to its end, else 1. ``base``: the
    other flags (its ``metrics``/``logs`` join a single planned run)."""
    from ..importer import Importer, wait_for_run
    from ..report import Progress, print_status, print_summary

    out = out or sys.stdout
    err = err or sys.stderr
    runs = plan(paths, fmt, base.run_id or None)
    rows: List[Tuple[str, str, str, int, str]] = []
    worst = 0
    for index, run in enumerate(runs, 1):
        options = replace(
            base,
            run_id=run.run_id,
            run_name=base.run_name or run.run_name,
            inputs=[(0, p, f) for p, f in run.inputs],
            logs=list(base.logs if len(runs) == 1 else ()) + [(0, p) for p in run.logs],
            metrics=list(base.metrics if len(runs) == 1 else ()),
        )
        if len(runs) > 1:
            out.write(f"[{index}/{len(runs)}] {run.run_name}\n")
        progress = Progress(err, enabled=not quiet)
        summary = Importer(options, backend, progress=progress).run()
        progress.finish()
        print_summary(summary, out)
        incidents: List[Dict[str, Any]] = []
        if summary.accepted and wait and backend.can_report:
            found, complete = wait_for_run(backend, summary, timeout_s=wait_timeout)
            incidents = backend.incidents(run.run_id) if found is not None else []
            print_status(found, incidents, out, complete=complete, origins=summary.origins)
        formats = ",".join(sorted({f for _, f in run.inputs}))
        said = (summary.error and f"ERROR {summary.error[:60]}") or (
            ", ".join(f"{i['category']}/{i['subtype']}" for i in incidents[:3])
            or (
                "no incidents"
                if wait and backend.can_report
                else "read (dry run)"
                if getattr(backend, "dry", False)
                else "imported"
            )
        )
        records = sum(s.metrics.records for s in summary.sources if s.metrics is not None)
        rows.append((run.run_id, run.run_name, formats, records, said))
        worst = max(worst, 0 if summary.ok else 1)
        out.flush()
    if len(runs) > 1:
        out.write(f"\n{len(runs)} runs:\n")
        for rid, name, formats, records, said in rows:
            out.write(f"  {rid}  {name}  [{formats}]  {records} records  {said}\n")
    return worst
