"""The engine's compiled build (engine/native_build.py, trainguard_engine/_native.py): used only when built
from exactly the sources there, never in place of an edited ``.py``; ``TRAINGUARD_ENGINE_NATIVE=0`` gives the
pure modules; with ``TRAINGUARD_REQUIRE_NATIVE=1`` (what ``make test`` sets) the hot modules must be the
compiled ones, so the whole suite really runs on them."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict

import pytest

from trainguard_engine import _native

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import json, trainguard_engine._native as n, trainguard_engine.pipeline, "
         "trainguard_engine.detectors.loss; print(json.dumps({'active': n.ACTIVE, 'reason': n.REASON, "
         "'compiled': n.compiled_modules()}))")


def _probe(src: Path, **env: str) -> Dict[str, Any]:
    """Import the engine under ``src`` in a fresh interpreter: what it loaded, and its stderr."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              (str(src), str(REPO / "sdk" / "src"))), **env), check=True)
    out: Dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


def _copy_engine(tmp: Path, with_build: bool) -> Path:
    """The engine's package (and its build, where asked) copied as a checkout lays them out: returns the
    copy's ``src`` folder."""
    src = tmp / "engine" / "src"
    shutil.copytree(_native.PACKAGE, src / "trainguard_engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(_native.SCRIPT, tmp / "engine" / "native_build.py")  # its sha is in the manifest too
    if with_build:
        shutil.copytree(_native.BUILD, tmp / "engine" / "build" / "native")
    return src


def test_the_required_compiled_engine_is_loaded() -> None:
    """With TRAINGUARD_REQUIRE_NATIVE=1 every hot module this process runs is the compiled one (unless the
    pure engine was asked for: a module of tests/support/engine_pure.py's, run in its subprocess)."""
    for name in _native.HOT:
        importlib.import_module("trainguard_engine." + name)
    compiled = _native.compiled_modules()
    assert set(compiled) == set(_native.HOT)
    if os.environ.get("TRAINGUARD_ENGINE_NATIVE", "1") == "0":
        assert not any(compiled.values()) and not _native.ACTIVE
    elif os.environ.get("TRAINGUARD_REQUIRE_NATIVE") == "1":
        assert _native.ACTIVE and all(compiled.values()), (
            f"TRAINGUARD_REQUIRE_NATIVE=1 but the compiled engine is not used ({_native.REASON}; "
            f"python engine/native_build.py builds it): {compiled}")
    else:  # either is valid; the modules agree with the package's decision
        assert set(compiled.values()) == {_native.ACTIVE}


def test_native_0_gives_the_pure_engine_silently() -> None:
    got = _probe(REPO / "engine" / "src", TRAINGUARD_ENGINE_NATIVE="0")
    assert got["active"] is False and got["reason"] == "TRAINGUARD_ENGINE_NATIVE=0"
    assert not any(got["compiled"].values())
    assert "trainguard_engine" not in str(got["stderr"])


def _fake_build(build: Path, package: Path) -> None:
    """A build folder whose manifest describes ``package`` as it is now (empty stand-ins for the modules):
    what :func:`_native.check` reads."""
    suffix = _native.interpreter()["ext_suffix"]
    for name in (*_native.HOT, _native.GROUP_LIBRARY):
        target = build / "trainguard_engine" / (name.replace(".", "/") + suffix)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"")
    manifest = {"interpreter": _native.interpreter(), "modules": list(_native.HOT),
                "sources": _native.source_digests(package),
                "script": _native.script_digest(package.parents[1] / "native_build.py")}
    (build / _native.MANIFEST).write_text(json.dumps(manifest))


def test_the_check_refuses_an_edited_source_another_interpreter_and_a_missing_module(tmp_path: Path) -> None:
    src = _copy_engine(tmp_path, with_build=False)
    package, build = src / "trainguard_engine", tmp_path / "engine" / "build" / "native"
    assert _native.check(build, package) == "no build"
    _fake_build(build, package)
    assert _native.check(build, package) is None
    loss = package / "detectors" / "loss.py"
    loss.write_text(loss.read_text() + "\n# edited\n")
    assert _native.check(build, package) == "stale: sources changed since the build (detectors/loss.py)"
    _fake_build(build, package)
    assert _native.check(build, package) is None
    (package / "catalogue.py").write_text((package / "catalogue.py").read_text() + "\n")  # typed against, pure
    assert str(_native.check(build, package)).startswith("stale:")
    _fake_build(build, package)
    (package / "classify" / "__init__.py").write_text((package / "classify" / "__init__.py").read_text() + "\n")
    assert _native.check(build, package) is None  # classify/ is called as Python: not in the digests
    manifest = json.loads((build / _native.MANIFEST).read_text())
    (build / _native.MANIFEST).write_text(json.dumps(dict(manifest, interpreter={"cache_tag": "cpython-39"})))
    assert str(_native.check(build, package)).startswith("built for another interpreter")
    _fake_build(build, package)
    (build / "trainguard_engine" / ("pipeline" + _native.interpreter()["ext_suffix"])).unlink()
    assert _native.check(build, package) == "incomplete build (pipeline)"


def test_a_stale_build_never_shadows_the_edited_source(tmp_path: Path) -> None:
    """End to end, on the real build (make test builds it first; without it the check above covers the
    decision): a copy of the package with its build runs compiled; the same copy with one hot module
    edited runs every module pure, with one warning line naming the file."""
    if _native.check() is not None:
        assert os.environ.get("TRAINGUARD_REQUIRE_NATIVE") != "1", _native.REASON
        pytest.skip(f"no current compiled build here ({_native.check()})")
    src = _copy_engine(tmp_path, with_build=True)
    fresh = _probe(src)
    assert fresh["active"] is True and all(fresh["compiled"].values())
    assert "trainguard_engine" not in str(fresh["stderr"])
    state = src / "trainguard_engine" / "state.py"
    state.write_text(state.read_text() + "\n# edited after the build\n")
    stale = _probe(src)
    assert stale["active"] is False and not any(stale["compiled"].values())
    lines = [line for line in str(stale["stderr"]).splitlines() if "trainguard_engine" in line]
    assert len(lines) == 1 and "not used (stale" in lines[0] and "state.py" in lines[0], stale["stderr"]


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_engine_native_build", REPO / "engine" / "native_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_mypyc_nothing_is_built_and_one_line_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    builder = _builder()
    monkeypatch.setattr(builder.importlib.util, "find_spec", lambda name, *a: None)
    assert builder.build(tmp_path / "native", force=True) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not built (no mypyc" in err[0]
    assert not (tmp_path / "native").exists()


def test_a_current_build_is_not_built_again(tmp_path: Path) -> None:
    """The build script's check is the package's: a current build is left as it is (make install and make
    test run the script every time)."""
    builder = _builder()
    build = tmp_path / "native"
    _fake_build(build, _native.PACKAGE)
    before = (build / _native.MANIFEST).stat().st_mtime_ns
    assert builder.build(build) == build
    assert (build / _native.MANIFEST).stat().st_mtime_ns == before
