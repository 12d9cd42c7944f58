"""The compiled engine's loader and build kept safe (hR5's review of stop 48): the group library counts
towards a complete build and the build script towards a current one; ``TRAINGUARD_ENGINE_NATIVE``'s words;
the whole hot set loads at activation, so a build swapped or removed later mixes nothing; a reader waits
for a swap in progress; compiled run states deep-copy and pickle; input that raised out of
``Pipeline.process`` or crashed the compiled build (an int past the double range, a value nested without
bound) is malformed, the same way in both builds; ``make ... ENGINE_NATIVE=0`` opts out."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.engine.test_engine_native import REPO, _copy_engine, _fake_build, _probe
from tests.engine.test_pipeline import DEMO, load, of_kind
from trainguard_engine import _native, records
from trainguard_engine.extract import as_float, metric_points
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RankState, SeriesTail


def _real_build() -> None:
    """Skip a test that needs the real compiled build where there is none (make test builds it and
    requires it: then this fails instead)."""
    reason = _native.check()
    if reason is not None:
        assert os.environ.get("TRAINGUARD_REQUIRE_NATIVE") != "1", reason
        pytest.skip(f"no current compiled build here ({reason})")


def test_a_build_without_the_group_library_is_incomplete(tmp_path: Path) -> None:
    src = _copy_engine(tmp_path, with_build=False)
    package, build = src / "trainguard_engine", tmp_path / "engine" / "build" / "native"
    _fake_build(build, package)
    assert _native.check(build, package) is None
    (build / "trainguard_engine" / (_native.GROUP_LIBRARY + _native.interpreter()["ext_suffix"])).unlink()
    assert _native.check(build, package) == f"incomplete build ({_native.GROUP_LIBRARY})"


def test_an_edited_build_script_makes_the_build_stale(tmp_path: Path) -> None:
    src = _copy_engine(tmp_path, with_build=False)
    package, build = src / "trainguard_engine", tmp_path / "engine" / "build" / "native"
    _fake_build(build, package)
    script = tmp_path / "engine" / "native_build.py"
    script.write_text(script.read_text().replace("check_untyped_defs = True", "check_untyped_defs = False"))
    assert _native.check(build, package) == "stale: engine/native_build.py changed since the build"


@pytest.mark.parametrize("value", ["false", "No", "OFF", " 0 "])
def test_the_off_words_give_the_pure_engine_silently(value: str) -> None:
    got = _probe(REPO / "engine" / "src", TRAINGUARD_ENGINE_NATIVE=value)
    assert got["active"] is False and not any(got["compiled"].values())
    assert got["reason"] == f"TRAINGUARD_ENGINE_NATIVE={value.strip().lower()}"
    assert "trainguard_engine" not in str(got["stderr"])


def test_an_unknown_native_value_gives_the_pure_engine_and_says_so() -> None:
    got = _probe(REPO / "engine" / "src", TRAINGUARD_ENGINE_NATIVE="compiled")
    assert got["active"] is False and not any(got["compiled"].values())
    lines = [line for line in str(got["stderr"]).splitlines() if "trainguard_engine" in line]
    assert len(lines) == 1 and "'compiled' is not one of 0/false/no/off/1/true/yes/on" in lines[0]


SWAP = """
import json, os, sys
import trainguard_engine.detectors.progress  # what the agent's events module imports first
import trainguard_engine._native as n
build = n.BUILD
os.rename(build, str(build) + ".gone")  # a rebuild's swap, rm -rf engine/build, git clean -X
try:
    import trainguard_engine.pipeline
    ok = True
except Exception as exc:
    ok = repr(exc)
print(json.dumps({"ok": ok, "active": n.ACTIVE, "compiled": n.compiled_modules()}))
"""


def test_a_build_removed_after_the_package_import_mixes_nothing(tmp_path: Path) -> None:
    """Every hot module is loaded at activation, while the check holds (hR5's MEDIUM-1: before, a later
    import fell through to the pure source beside compiled modules, or died subclassing a compiled
    class)."""
    _real_build()
    src = _copy_engine(tmp_path, with_build=True)
    done = subprocess.run([sys.executable, "-c", SWAP], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join((str(src), str(REPO / "sdk" / "src")))),
                          check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["ok"] is True and got["active"] is True, done.stderr
    assert set(got["compiled"]) == set(_native.HOT) and all(got["compiled"].values()), got


def test_without_its_group_library_the_build_is_not_used(tmp_path: Path) -> None:
    """LOW-7: was ``ModuleNotFoundError: trainguard_engine.native__mypyc`` at the first hot import."""
    _real_build()
    src = _copy_engine(tmp_path, with_build=True)
    build = tmp_path / "engine" / "build" / "native" / "trainguard_engine"
    (build / (_native.GROUP_LIBRARY + _native.interpreter()["ext_suffix"])).unlink()
    got = _probe(src)
    assert got["active"] is False and not any(got["compiled"].values())
    lines = [line for line in str(got["stderr"]).splitlines() if "trainguard_engine" in line]
    assert len(lines) == 1 and f"incomplete build ({_native.GROUP_LIBRARY})" in lines[0]


def test_the_package_import_waits_for_a_swap_in_progress(tmp_path: Path) -> None:
    """The build script swaps under the lock held exclusively; the package checks and loads under it held
    shared (LOW-8: a reader in the swap's window saw "no build" and ran pure)."""
    _real_build()
    src = _copy_engine(tmp_path, with_build=True)
    lock = _native.locked(shared=False, lock=tmp_path / "engine" / "build" / "native.lock")
    assert lock is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(src), str(REPO / "sdk" / "src"))))
    with subprocess.Popen([sys.executable, "-c", "import trainguard_engine._native as n; print(n.ACTIVE)"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) as reader:
        time.sleep(1.5)
        assert reader.poll() is None  # waiting on the lock
        lock.close()
        out, _ = reader.communicate(timeout=60)
    assert out.strip() == "True"


def _tailed_rank() -> RankState:
    rank = RankState(rank=0)
    rank.history["loss"] = {step: (1.0 / step, step * 10**9) for step in range(1, 40)}
    rank.tails["loss"] = SeriesTail(rank.history["loss"])  # as the detectors keep it
    return rank


def test_a_rank_state_with_a_series_tail_deep_copies_and_pickles() -> None:
    """LOW-4: compiled, ``copy.deepcopy`` of a RankState holding a tail raised ``TypeError: __init__()
    missing required argument 'data'`` (copyreg makes an object without arguments)."""
    rank = _tailed_rank()
    for twin in (copy.deepcopy(rank), pickle.loads(pickle.dumps(rank))):
        tail, original = twin.tails["loss"], rank.tails["loss"]
        assert tail is not original and len(tail.points) == 39
        assert tail.points == original.points and (tail.bad_end, tail.descent) == (
            original.bad_end, original.descent)
        assert tail.data is twin.history["loss"] and tail.data == original.data


def _metrics_event(value: Any) -> Dict[str, Any]:
    event = copy.deepcopy(of_kind(load("healthy"), "metrics")[0])
    event["metrics"]["points"].append({"name": "opt/weird", "value": value})
    return event


def _nested(depth: int) -> List[Any]:
    """``depth`` lists, one in another."""
    value: List[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("value", [10**400, -(10**400), _nested(300_000)])
def test_a_metric_value_past_the_double_range_or_nested_deep_is_a_bad_point(value: Any) -> None:
    """LOW-11: an int past the double range raised OverflowError out of ``Pipeline.process`` (a value
    nested 300,000 deep, RecursionError): it is a bad point now, as a string that is no number is."""
    with pytest.raises(ValueError, match="not a double"):
        as_float(value)
    assert metric_points(_metrics_event(value)) == metric_points(_metrics_event("not a number"))
    outputs = []
    for bad in (value, "not a number"):
        pipeline = Pipeline(DEMO)
        out = pipeline.process([_metrics_event(bad)])
        outputs.append(([r.to_dict() for r in out.runs], dict(pipeline.counters)))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("copier", [records.finite_copy, records._plain])
def test_record_values_nest_at_most_max_depth_in_both_builds(copier: Any) -> None:
    """LOW-12: compiled code ignores the recursion limit (a 10**6-deep list crashed the process; from ~900
    levels pure raised where compiled went on): the helpers count the depth themselves."""
    assert copier(_nested(records.MAX_DEPTH)) == _nested(records.MAX_DEPTH)
    for depth in (records.MAX_DEPTH + 1, 5_000, 10**6):
        with pytest.raises(ValueError, match=f"nested more than {records.MAX_DEPTH} levels"):
            copier(_nested(depth))
    deep_dict: Any = 1.5
    for _ in range(records.MAX_DEPTH + 1):  # MAX_DEPTH + 1 dicts
        deep_dict = {"k": deep_dict}
    with pytest.raises(ValueError):
        copier(deep_dict)


def _make_n(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "-B", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_builds_the_compiled_engine_once_and_opts_out_with_engine_native_0() -> None:
    """LOW-10: the build runs once (make install's; a failure leaves a stamp make test stops on, with the
    way out), the suite requires it; ``ENGINE_NATIVE=0`` builds nothing and tests pure."""
    default = _make_n("test")
    assert default.count("engine/native_build.py") == 1
    assert "touch .venv/.engine-native-failed" in default and "test ! -f .venv/.engine-native-failed" in default
    assert "TRAINGUARD_REQUIRE_NATIVE=1 .venv/bin/python -m pytest" in default
    off = _make_n("test", "ENGINE_NATIVE=0")
    assert "native_build.py" not in off and "TRAINGUARD_REQUIRE_NATIVE" not in off
    assert "TRAINGUARD_ENGINE_NATIVE=0 .venv/bin/python -m pytest" in off


PROBE_MODULE = '''
import pytest
from trainguard_engine import _native

PURE = pytest.mark.engine_pure("probe")


@PURE
def test_pure_here():
    assert not _native.ACTIVE


def test_compiled_here():
    assert _native.ACTIVE


@PURE
@pytest.mark.parametrize("x", [1, 2])
def test_marked(x):
    assert x == 1, "x is not one"


@PURE
def test_skips():
    pytest.skip("because")
'''


def _pytest_in(folder: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        str(REPO / p) for p in (".", "sdk/src", "engine/src", "services/src")))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "--rootdir",
                           str(folder), *args], cwd=folder, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    return done.stdout


def test_marked_tests_run_pure_one_by_one_and_the_others_compiled(tmp_path: Path) -> None:
    """MEDIUM-3: a marked test runs on the pure engine and reports its own outcome (pass, fail, skip); the
    module's other tests run compiled; node ids and ``-k`` select as usual."""
    _real_build()
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n"
                                          "from tests.conftest import __all__  # noqa: F401\n")
    (tmp_path / "test_probe.py").write_text(PROBE_MODULE)
    whole = _pytest_in(tmp_path)
    assert "1 failed, 3 passed, 1 skipped" in whole, whole
    assert "FAILED test_probe.py::test_marked[2]" in whole and "(pure engine) because" in whole, whole
    picked = _pytest_in(tmp_path, "-k", "pure_here or compiled_here")
    assert "2 passed, 3 deselected" in picked, picked
    one = _pytest_in(tmp_path, "test_probe.py::test_marked[1]")
    assert "1 passed" in one, one


def test_settings_built_directly_hold_floats_and_tuples_as_from_overrides_makes_them() -> None:
    """LOW-6: ``DetectionSettings(stall_min_s=5)`` kept the int (pure evidence said ``5``, compiled ``5.0``);
    a list for a tuple setting quarantined runs in both builds."""
    from trainguard_engine.catalogue import DetectionSettings

    direct = DetectionSettings(stall_min_s=5, stall_factor=3, explosion_jump_factor=10, trend_z=3,
                               loss_metrics=["loss", "train/loss"])  # type: ignore[arg-type]
    assert direct == DetectionSettings.from_overrides({"stall_min_s": 5, "stall_factor": 3,
                                                       "explosion_jump_factor": 10, "trend_z": 3,
                                                       "loss_metrics": ["loss", "train/loss"]})
    assert type(direct.stall_min_s) is float and type(direct.trend_z) is float
    assert direct.loss_metrics == ("loss", "train/loss")
    assert DetectionSettings(history_len=64).history_len == 64 and type(DetectionSettings().history_len) is int
