#!/usr/bin/env python3
"""Copy a stratified subset of the recorded corpus into ``tests/scenarios/streams_varied/`` for CI.

CI must judge detection without training 408 runs, so a fixed subset is committed: per label (what
``labels.py`` says the run is) the first ``--per-label`` runs of each half, by id, whose stream is under
``--max-bytes`` -- chosen by label and id only, never by whether the engine gets them right. Each run is
``<id>.jsonl.gz`` (the SDK's stream, unedited) and ``<id>.truth.json.gz`` (spec and ground truth);
``verdicts.json`` records, per run, its label and what the engine said when the subset was exported (the
regression baseline ``tests/engine/test_varied_corpus.py`` compares with).

    python -m bench.corpus.export                 # after record.py; rewrites the subset and its verdicts
    python -m bench.corpus.export --verdicts-only # keep the streams, re-record what the engine says now
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
SUBSET = REPO / "tests" / "scenarios" / "streams_varied"


def verdict_doc(folder: Path) -> Dict[str, Dict[str, object]]:
    """What the engine says now about every run of ``folder`` (read back from its gz files)."""
    from bench.corpus import evaluate, manifest

    settings = evaluate.DetectionSettings()
    out: Dict[str, Dict[str, object]] = {}
    for truth_file in sorted(folder.glob("*.truth.json.gz")):
        run_id = truth_file.name.split(".")[0]
        doc = json.loads(gzip.decompress(truth_file.read_bytes()))
        spec = manifest.RunSpec.from_dict(doc["spec"])
        o = evaluate.outcome_of(spec, doc["truth"], evaluate.read_events(folder / f"{run_id}.jsonl.gz"),
                                settings)
        out[run_id] = {"split": spec.split, "cause": spec.cause, "framework": spec.framework,
                       "label": o.label, "verdict": o.verdict, "open_alerts": o.open_alerts}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    sys.path.insert(0, str(REPO))
    from bench.corpus import labels, manifest
    from bench.corpus.record import DEFAULT_OUT
    from bench.corpus.trainings import clip_for

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where record.py wrote the runs")
    parser.add_argument("--per-label", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=400_000)
    parser.add_argument("--verdicts-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.verdicts_only:
        chosen: Dict[tuple, List[str]] = defaultdict(list)
        for spec in manifest.load():
            stream, truth = args.out / f"{spec.id}.jsonl", args.out / f"{spec.id}.truth.json"
            if not stream.exists() or not truth.exists() or stream.stat().st_size > args.max_bytes:
                continue
            label = labels.label(spec, json.loads(truth.read_text())["truth"], clip_for(spec))
            if label == labels.UNMANIFESTED:
                continue
            per = args.per_label * (3 if label == labels.HEALTHY else 1)
            if len(chosen[(label, spec.split)]) < per:
                chosen[(label, spec.split)].append(spec.id)
        if SUBSET.exists():
            shutil.rmtree(SUBSET)
        SUBSET.mkdir(parents=True)
        for ids in chosen.values():
            for run_id in ids:
                for suffix in (".jsonl", ".truth.json"):
                    data = (args.out / f"{run_id}{suffix}").read_bytes()
                    (SUBSET / f"{run_id}{suffix}.gz").write_bytes(gzip.compress(data, 9, mtime=0))
    doc = verdict_doc(SUBSET)
    (SUBSET / "verdicts.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in SUBSET.iterdir())
    print(f"{len(doc)} runs in {SUBSET} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
