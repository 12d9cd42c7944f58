"""The catalogue's data file (engine/src/trainguard_engine/data/catalogue.toml): what it loads into, that a
malformed entry is refused at import with the entry and the field named, that the roles, numeric
strengths and diagnosis rules come from it, and that the README's table is generated from it."""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

from trainguard_engine import catalogue, correlate, diagnosis
from trainguard_engine.catalogue import KINDS, CatalogueError, _load_exception_rules, _load_exits, _load_kinds
from trainguard_engine.detectors import numeric

REPO = Path(__file__).resolve().parents[2]
DATA: Dict[str, Any] = catalogue._DATA


def _mutated(change: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    data = copy.deepcopy(DATA)
    change(data)
    return data


def _kind_entry(data: Dict[str, Any], name: str) -> Dict[str, Any]:
    entry: Dict[str, Any] = next(k for k in data["kinds"] if k["kind"] == name)
    return entry


BROKEN = {
    "unknown field 'sevrity'": lambda d: _kind_entry(d, "loss/plateau").update(sevrity="warning"),
    "missing field 'title'": lambda d: _kind_entry(d, "loss/plateau").pop("title"),
    "severity must be one of": lambda d: _kind_entry(d, "loss/plateau").update(severity="fatal"),
    "checks must be ordered hardware -> framework -> model":
        lambda d: _kind_entry(d, "comm/failure")["checks"].reverse(),
    "no shared check 'hw-gpus'": lambda d: _kind_entry(d, "comm/failure")["checks"].insert(0, "hw-gpus"),
    "cause ids repeat": lambda d: _kind_entry(d, "loss/plateau")["causes"].append(
        dict(_kind_entry(d, "loss/plateau")["causes"][0])),
    "roles must be among": lambda d: _kind_entry(d, "comm/timeout").update(roles=["victim"]),
    "field 'numeric_strength' must be int": lambda d: _kind_entry(d, "loss/non_finite").update(
        numeric_strength="high"),
    "kind must be 'category/subtype'": lambda d: _kind_entry(d, "loss/plateau").update(kind="plateau"),
    "kinds repeat": lambda d: d["kinds"].append(dict(_kind_entry(d, "loss/plateau"))),
}


@pytest.mark.parametrize("message", sorted(BROKEN))
def test_a_malformed_kind_is_refused_naming_the_entry_and_field(message: str) -> None:
    with pytest.raises(CatalogueError, match=r"catalogue\.toml") as err:
        _load_kinds(_mutated(BROKEN[message]))
    assert message in str(err.value)


def test_exits_and_exception_rules_are_checked_against_known_kinds() -> None:
    with pytest.raises(KeyError, match="memory/oops"):
        _load_exits(_mutated(lambda d: d["exits"][0].update(kind="memory/oops")))
    with pytest.raises(CatalogueError, match="expected integers"):
        _load_exits(_mutated(lambda d: d["exits"][0].update(codes=["134"])))
    with pytest.raises(CatalogueError, match="needs types or a pattern"):
        _load_exception_rules(_mutated(lambda d: d["exception_rules"][0].pop("types")))
    with pytest.raises(CatalogueError, match="pattern: "):
        _load_exception_rules(_mutated(lambda d: d["exception_rules"][0].update(pattern="(unclosed")))


def test_the_shipped_data_loads_into_every_kind_with_ids_for_its_causes() -> None:
    assert len(_load_kinds(DATA)) == len(KINDS) == len(DATA["kinds"])
    for spec in KINDS.values():
        assert len(spec.cause_ids) == len(spec.causes) and all(spec.cause_ids)
        for cid, text in zip(spec.cause_ids, spec.causes):
            assert spec.cause_text(cid) == text
    with pytest.raises(KeyError, match="loss/plateau has no cause 'nope'"):
        KINDS["loss/plateau"].cause_text("nope")


def test_correlation_roles_and_numeric_strengths_are_the_datas() -> None:
    for role, table in (("cause", correlate.CAUSES), ("consequence", correlate.CONSEQUENCES),
                        ("peer-failure", correlate.PEER_FAILURES), ("comm-failure", correlate.COMM_FAILURES),
                        ("numeric", correlate.NUMERIC)):
        assert table == tuple((k.category, k.subtype) for k in KINDS.values() if role in k.roles)
        assert table  # every role is held by some kind
    assert set(correlate.NUMERIC) <= set(correlate.CAUSES)
    assert numeric.NUMERIC_STRENGTH == {n: k.numeric_strength for n, k in KINDS.items() if k.numeric_strength}
    assert numeric.NUMERIC_STRENGTH["gradient/explosion"] > numeric.NUMERIC_STRENGTH["loss/non_finite"]


def test_every_diagnosis_rule_names_a_cause_of_its_kind_by_id() -> None:
    for rule_kind, cause_id, *_rest in diagnosis.RULES:
        category, _, subtype = rule_kind.partition("/")
        assert catalogue.kind(category, subtype).cause_text(cause_id)


def test_a_diagnosis_rule_with_an_unknown_cause_id_fails_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = (("loss/plateau", "no-such-cause", lambda f: True, 2.0, lambda f: ""),)
    monkeypatch.setattr(diagnosis, "RULES", bad)
    with pytest.raises(KeyError, match="no-such-cause"):
        diagnosis._check_rules()


def test_the_readme_table_is_generated_from_the_data() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        tool = importlib.import_module("catalogue_table")
    finally:
        sys.path.remove(str(REPO / "tools"))
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert tool.rendered(text) == text, "README.md's table is stale: run python tools/catalogue_table.py"
    table = catalogue.readme_table()
    for spec in KINDS.values():  # every kind is on a row
        assert spec.name in table or f", {spec.subtype}" in table, spec.name
    assert f"`leak_window` {catalogue.DetectionSettings().leak_window}" in table  # defaults read live


def test_every_setting_is_in_exactly_one_section() -> None:
    names = [f.name for f in __import__("dataclasses").fields(catalogue.DetectionSettings)]
    assert sorted(catalogue.SECTION_OF) == sorted(names)
    assert sum(len(v) for v in catalogue.SECTIONS.values()) == len(names)
    assert {row["section"] for row in catalogue.settings_table()} == set(catalogue.SECTIONS)


def test_overrides_by_section_and_flat_give_the_same_settings() -> None:
    flat = catalogue.DetectionSettings.from_overrides({"leak_window": 64, "stall_min_s": 5.0})
    nested = catalogue.DetectionSettings.from_overrides({"memory": {"leak_window": 64},
                                                         "progress": {"stall_min_s": 5.0}})
    assert flat == nested and flat.leak_window == 64
    with pytest.raises(ValueError, match="'stall_min_s' is not in section 'memory' \\(it is in 'progress'\\)"):
        catalogue.DetectionSettings.from_overrides({"memory": {"stall_min_s": 5.0}})
    with pytest.raises(ValueError, match="unknown detection setting 'leak_windw'; did you mean 'leak_window'"):
        catalogue.DetectionSettings.from_overrides({"leak_windw": 64})
