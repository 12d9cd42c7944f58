"""gate.policy: defaults, overrides from YAML, and refusals that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainguard_server.gate.policy import Policy, defaults_table, policy_from_dict


def test_defaults_are_the_documented_ones() -> None:
    policy = policy_from_dict(None)
    assert policy == Policy()
    assert (policy.loss.k, policy.loss.max_consecutive, policy.loss.smooth_window) == (5.0, 10, 15)
    assert (policy.peak_memory.warn_pct, policy.peak_memory.fail_pct) == (10.0, 25.0)
    assert (policy.step_time.warn_pct, policy.step_time.fail_pct) == (25.0, None)
    assert policy.baseline.min_runs == 2 and policy.fingerprints.on_new == "fail"
    rows = {key: (default, doc) for key, default, doc in defaults_table()}
    assert rows["loss.k"][0] == 5.0 and "sigma" in rows["loss.k"][1]
    assert rows["peak_memory.metrics"][0][-1] == "mem/rss"
    assert all(doc for _, doc in rows.values())  # every key says what it means
    # every key of the policy is in the table
    assert len(rows) == sum(len(section) for section in Policy().to_dict().values())


def test_a_yaml_file_overrides_some_keys(tmp_path: Path) -> None:
    path = tmp_path / "gate.yaml"
    path.write_text("loss:\n  k: 6\n  direction: both\nstep_time:\n  fail_pct: 50\n"
                    "fingerprints:\n  ignore: [abc]\npeak_memory:\n  fail_pct: null\n")
    policy = policy_from_dict(yaml.safe_load(path.read_text()))
    assert policy.loss.k == 6.0 and isinstance(policy.loss.k, float) and policy.loss.direction == "both"
    assert policy.loss.max_consecutive == 10  # untouched keys keep their defaults
    assert policy.step_time.fail_pct == 50.0 and policy.step_time.metrics == ["time/step_s"]
    assert policy.peak_memory.fail_pct is None and policy.peak_memory.warn_pct == 10.0
    assert policy.fingerprints.ignore == ["abc"]
    # the defaults object is not shared between policies
    assert Policy().fingerprints.ignore == []


@pytest.mark.parametrize("data,message", [
    ({"los": {}}, "unknown section 'los'"),
    ({"loss": {"kk": 1}}, "unknown key loss.kk"),
    ({"loss": {"k": "five"}}, "loss.k must be a number"),
    ({"loss": {"k": 0.1}}, "loss.k must be >= 0.5"),
    ({"loss": {"max_consecutive": 2.5}}, "loss.max_consecutive must be an integer"),
    ({"loss": {"direction": "below"}}, "loss.direction must be one of above, both"),
    ({"fingerprints": {"on_new": "explode"}}, "fingerprints.on_new must be one of fail, warn, off"),
    ({"status": {"fail_on": ["failed", "exploded"]}}, "status.fail_on: 'exploded' is not one of"),
    ({"loss": 3}, "section 'loss' must be a mapping"),
    ({"loss": {"k": True}}, "loss.k must be a number"),
])
def test_refusals_name_the_key(data: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        policy_from_dict(data)


def test_profile_settings_are_the_keys_that_shape_a_profile() -> None:
    changed = policy_from_dict({"loss": {"k": 9, "smooth_window": 31}})
    base = Policy().profile_settings()
    assert changed.profile_settings() != base
    assert policy_from_dict({"loss": {"k": 9}}).profile_settings() == base
