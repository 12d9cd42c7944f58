"""Test modules that check the engine's pure-Python internals, run on the pure engine when the compiled one is
loaded (engine/native_build.py; trainguard_engine/_native.py).

Some tests watch the engine from inside: they wrap or replace a module's function to count its calls or to
compare it with an oracle (``loss._track_level``, ``correlate.waits_open``), or subclass a detector. In the
compiled engine, calls between compiled modules are bound at build time and its classes take no Python
subclasses, so such a test would watch nothing. Under the compiled engine (without it, everything is
collected and run as usual; nothing is ever skipped for it):

* a test marked ``@pytest.mark.engine_pure("<why>")`` (or a module's ``pytestmark``) runs in a subprocess on
  the pure modules (``TRAINGUARD_ENGINE_NATIVE=0``, the same sources): the marked tests of a module that
  were selected (node ids, ``-k``) run there together, once, and each reports its own outcome (pass, fail
  with the subprocess's report, skip); the module's other tests run compiled, in this process;
* a module that cannot even be imported under the compiled engine (a subclass of a compiled detector at its
  top level) says so with a top-level line ``ENGINE_PURE = "<why>"`` and runs whole in the subprocess, as
  one test item that fails with the subprocess's report.

The compiled engine's own results are checked by everything else, which runs compiled.

tests/conftest.py hooks it in for the whole suite.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^ENGINE_PURE(?:: *str)? *= ", re.M)
"""How a test module asks for the pure engine (a top-level assignment, read from its text: the module
itself may not import under the compiled engine, e.g. a subclass of a compiled detector)."""


def compiled_engine() -> bool:
    """Whether this process runs the engine's compiled build."""
    from trainguard_engine import _native

    return bool(_native.ACTIVE)


def wants_pure(path: Path) -> bool:
    """Whether the test module at ``path`` asks for the pure engine (:data:`MARK`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    found = MARK.search(text)
    return found is not None and text.count('"""', 0, found.start()) % 2 == 0  # not inside a docstring


class PureEngineFailed(Exception):
    """The module's run on the pure engine failed (its report is the message)."""


class PureEngineRun(pytest.Item):
    """The whole module, run by pytest in a subprocess with ``TRAINGUARD_ENGINE_NATIVE=0``."""

    def runtest(self) -> None:
        env = dict(os.environ, TRAINGUARD_ENGINE_NATIVE="0")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(self.path)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise PureEngineFailed(f"{self.path.name} on the pure engine (TRAINGUARD_ENGINE_NATIVE=0): rc "
                                   f"{done.returncode}\n{done.stdout[-8000:]}\n{done.stderr[-2000:]}")

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:  # type: ignore[override]
        if isinstance(excinfo.value, PureEngineFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> Any:
        return self.path, None, f"{self.path.name} [pure engine, subprocess]"


class PureEngineModule(pytest.File):
    """A module that asks for the pure engine, under the compiled one: one :class:`PureEngineRun`."""

    def collect(self) -> Iterator[pytest.Item]:
        yield PureEngineRun.from_parent(self, name="pure_engine")


MARKER = "engine_pure"
SELECTED = pytest.StashKey[Dict[Path, List[str]]]()
"""Per module, the node ids of its marked tests that this session runs (set after selection)."""
RESULTS = pytest.StashKey[Dict[Path, Dict[str, Tuple[str, str]]]]()
"""Per module, the pure subprocess's outcome and report of each of them (filled by the first one run)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(why): run this test on the pure engine when the compiled one "
                                       "is loaded (tests/support/engine_pure.py)")
    config.stash[SELECTED] = {}
    config.stash[RESULTS] = {}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Note the selected marked tests by module; their runs go to the pure subprocess (compiled engine)."""
    if not any(item.get_closest_marker(MARKER) for item in items) or not compiled_engine():
        return
    for item in items:
        if item.get_closest_marker(MARKER) is not None:
            config.stash[SELECTED].setdefault(item.path, []).append(item.nodeid)
            # its fixtures are set up in the subprocess, not here (they may wrap what compiled code binds)
            item.setup = lambda: None  # type: ignore[method-assign]
            item.runtest = functools.partial(_pure_call, item)  # type: ignore[method-assign]


def _junit_key(nodeid: str) -> str:
    """A node id as junitxml names its test case (``classname.name``)."""
    parts = nodeid.split("::")
    return ".".join([parts[0][:-3].replace("/", "."), *parts[1:]])


def _run_pure(config: pytest.Config, path: Path) -> Dict[str, Tuple[str, str]]:
    """Run the module's selected marked tests on the pure engine, once: each one's (outcome, report)."""
    nodeids = config.stash[SELECTED].get(path, [])
    root = Path(str(config.rootpath))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = dict(os.environ, TRAINGUARD_ENGINE_NATIVE="0")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", f"--junitxml={report}",
                               "-o", "junit_family=xunit1", *nodeids], cwd=root, env=env, capture_output=True,
                              text=True, timeout=1800, check=False)
        results: Dict[str, Tuple[str, str]] = {}
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                key = f"{case.get('classname')}.{case.get('name')}"
                outcome, text = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        outcome = child.tag
                        text = (child.get("message") or "") + "\n" + (child.text or "")
                        break
                results[key] = (outcome, text)
    tail = f"rc {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    return {nodeid: results.get(_junit_key(nodeid), ("error", "no result from the pure run: " + tail))
            for nodeid in nodeids}


def _pure_call(item: pytest.Item) -> None:
    """A selected marked test's run under the compiled engine: its outcome from the pure subprocess."""
    results = item.config.stash[RESULTS]
    if item.path not in results:
        results[item.path] = _run_pure(item.config, item.path)
    outcome, text = results[item.path][item.nodeid]
    if outcome == "skipped":
        pytest.skip(f"(pure engine) {text.strip()[:500]}")
    if outcome != "passed":
        pytest.fail(f"{item.nodeid} on the pure engine (TRAINGUARD_ENGINE_NATIVE=0): {outcome}\n{text}",
                    pytrace=False)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> Optional[pytest.Collector]:
    """The hook (see the module's docstring): a marked module under the compiled engine; else pytest's own."""
    if wants_pure(module_path) and compiled_engine():
        return PureEngineModule.from_parent(parent, path=module_path)
    return None
