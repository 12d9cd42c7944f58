"""Metrics JSON-lines parsing and field mapping on real files: NaN literals, nested values, malformed lines,
step and time fields, rank routing, automatic and user renames."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from trainguard_server.replay.metrics_jsonl import (
    FieldMap,
    MetricsReader,
    MetricsRecord,
    MetricsStats,
    parse_map_rule,
    peek_times,
)


def _write(path: Path, lines: List[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _read(path: Path, field_map: Optional[FieldMap] = None, *, step_field: Optional[str] = None,
          time_field: Optional[str] = None) -> Tuple[List[MetricsRecord], MetricsStats]:
    reader = MetricsReader(path, field_map or FieldMap(auto=False), step_field=step_field,
                           time_field=time_field)
    return list(reader), reader.stats


def test_nan_literals_strings_nested_values_and_malformed_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", [
        '{"step": 0, "loss": 2.5, "grad_norm": {"layer1": 0.1, "layer2": {"attn": 0.2}}, "tag": "warmup"}',
        '{"step": 1, "loss": NaN, "grad_norm": {"layer1": Infinity, "layer2": {"attn": -Infinity}}}',
        '',
        '{"step": 2, "loss": "nan", "scale": "inf", "neg": "-Infinity", "lr": "3e-4", "ok": true}',
        '{"step": 3, "loss": 1.0,',                        # truncated line
        '[1, 2, 3]',                                      # not an object
        '{"step": -4, "loss": 1.0}',                      # bad step
        '{"loss": 9.0}',                                  # no step field
        '{"step": 5, "note": "only text", "flags": [1, 2], "none": null}',
        '{"step": 6.0, "loss": 0.5}',
    ])
    records, stats = _read(path)
    assert [r.step for r in records] == [0, 1, 2, 6]
    assert [r.line for r in records] == [1, 2, 4, 10]
    assert records[0].values == {"loss": 2.5, "grad_norm/layer1": 0.1, "grad_norm/layer2/attn": 0.2}
    one = records[1].values
    assert math.isnan(one["loss"]) and one["grad_norm/layer1"] == math.inf
    assert one["grad_norm/layer2/attn"] == -math.inf
    two = records[2].values
    assert math.isnan(two["loss"]) and two["scale"] == math.inf and two["neg"] == -math.inf
    assert two["lr"] == pytest.approx(3e-4) and two["ok"] == 1.0  # a JSON boolean is 0/1 (issue 19)
    assert stats.lines == 9 and stats.records == 4 and stats.points == 3 + 3 + 5 + 1
    assert stats.malformed == 3
    assert [line for line, _ in stats.malformed_lines] == [5, 6, 7]
    assert "not JSON" in stats.malformed_lines[0][1] and "not a JSON object" in stats.malformed_lines[1][1]
    assert "non-negative integer" in stats.malformed_lines[2][1]
    assert stats.no_step == 1 and stats.no_values == 1
    assert stats.non_numeric == {"tag": 1, "note": 1, "flags": 1, "none": 1}
    assert stats.step_field == "step" and not stats.numbered


@pytest.mark.parametrize("name", ["step", "global_step", "trainer/global_step", "iteration", "iter", "_step"])
def test_accepted_step_field_names(tmp_path: Path, name: str) -> None:
    path = _write(tmp_path / "m.jsonl", [json.dumps({name: s, "loss": 1.0 / (s + 1)}) for s in (3, 4)])
    records, stats = _read(path)
    assert [r.step for r in records] == [3, 4]
    assert stats.step_field == name
    assert all(set(r.values) == {"loss"} for r in records)


def test_step_field_override_and_numbering_by_position(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", ['{"it": 10, "step": 99, "loss": 1}', '{"it": 11, "step": 99, "loss": 2}'])
    assert [r.step for r in _read(path, step_field="it")[0]] == [10, 11]
    path = _write(tmp_path / "n.jsonl", ['{"loss": 1}', "", "garbage", '{"loss": 2}', '{"loss": 3}'])
    records, stats = _read(path)
    assert stats.numbered
    # positions among non-blank lines: the malformed line keeps its place
    assert [r.step for r in records] == [0, 2, 3]


def test_time_fields_and_their_units(tmp_path: Path) -> None:
    base = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
    seconds = base.timestamp()
    path = _write(tmp_path / "m.jsonl", [
        json.dumps({"step": 0, "time": "2026-03-01T12:00:00Z", "loss": 1}),
        json.dumps({"step": 1, "timestamp": seconds + 1.5, "loss": 1}),
        json.dumps({"step": 2, "_timestamp": int((seconds + 2) * 1000), "loss": 1}),
        json.dumps({"step": 3, "time_unix_nano": int(seconds + 3) * 10**9, "loss": 1}),
        json.dumps({"step": 4, "wall_time": "2026-03-01 13:00:04,250+01:00", "loss": 1}),
        json.dumps({"step": 5, "time": 0.35, "loss": 1}),  # a step duration, not a timestamp
    ])
    records, _ = _read(path)
    ns = int(seconds) * 10**9
    assert [r.time_ns for r in records] == [ns, ns + 1_500_000_000, ns + 2 * 10**9, ns + 3 * 10**9,
                                            ns + 4_250_000_000, None]
    assert records[5].values == {"time": 0.35, "loss": 1.0}
    assert all("time" not in r.values for r in records[:5])
    lines, first, last = peek_times(path)
    assert (lines, first, last) == (6, ns, ns + 4_250_000_000)
    custom = _write(tmp_path / "c.jsonl", ['{"step": 0, "t": 1772366400, "time": 5, "loss": 1}'])
    rec = _read(custom, time_field="t")[0][0]
    assert rec.time_ns == 1772366400 * 10**9 and rec.values == {"time": 5.0, "loss": 1.0}


def test_rank_field_routes_records(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", ['{"step": 0, "rank": 1, "loss": 1}', '{"step": 0, "loss": 2}'])
    records, _ = _read(path)
    assert [r.rank for r in records] == [1, None]
    assert records[0].values == {"loss": 1.0}


def test_field_map_automatic_user_prefix_drop_and_off() -> None:
    values = {"train/loss": 1.0, "grad_norm": 2.0, "grad_norm/enc.0": 0.5, "learning_rate": 3e-4,
              "loss_scale": 65536.0, "epoch": 1.0, "val/ppl": 9.0, "custom/x": 4.0}
    auto, dropped = FieldMap().apply(values)
    # "epoch" is bookkeeping, left out with its reason (issue 19)
    assert auto == {"loss": 1.0, "grad/global_norm": 2.0, "grad/layer/enc.0": 0.5, "opt/lr": 3e-4,
                    "amp/scale": 65536.0, "val/ppl": 9.0, "custom/x": 4.0}
    assert dropped == 0
    rules = [parse_map_rule(r) for r in ("val/ppl=eval/perplexity", "epoch=", "custom/*=mine/*",
                                         "grad_norm=grad/clipped_norm")]
    mapped, dropped = FieldMap(rules).apply(values)
    assert mapped["eval/perplexity"] == 9.0 and mapped["mine/x"] == 4.0 and "epoch" not in mapped
    assert mapped["grad/clipped_norm"] == 2.0 and mapped["loss"] == 1.0  # user rule wins, auto still on
    assert dropped == 1
    assert FieldMap(auto=False).apply(values)[0] == values
    # an automatic rename never overwrites a field that already has the target name
    both, _ = FieldMap().apply({"loss": 1.0, "train/loss": 2.0, "lr": 0.1, "opt/lr": 0.2})
    assert both == {"loss": 1.0, "train/loss": 2.0, "lr": 0.1, "opt/lr": 0.2}
    with pytest.raises(ValueError):
        parse_map_rule("no-equals-sign")
