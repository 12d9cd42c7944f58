"""Test modules that check the engine's pure-Python internals, run on the pure engine when the compiled one is
loaded (engine/native_build.py; trainguard_engine/_native.py).

Some tests watch the engine from inside: they wrap or replace a module's function to count its calls or to
compare it with an oracle (``loss._track_level``, ``correlate.waits_open``), or subclass a detector. In the
compiled engine, calls between compiled modules are bound at build time and its classes take no Python
subclasses, so such a test would watch nothing. A module that says so -- a line ``ENGINE_PURE = "<why>"`` at
its top level -- is then run whole in a subprocess on the pure modules (``TRAINGUARD_ENGINE_NATIVE=0``, the
same sources), as one test item that fails with the subprocess's report; it is never skipped. Without the
compiled engine it is collected and run as usual. The compiled engine's own results are checked by
everything else (golden digests, the differential tests), which runs compiled.

tests/conftest.py hooks it in for the whole suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^ENGINE_PURE = ", re.M)
"""How a test module asks for the pure engine (a top-level assignment, read from its text: the module
itself may not import under the compiled engine, e.g. a subclass of a compiled detector)."""


def compiled_engine() -> bool:
    """Whether this process runs the engine's compiled build."""
    from trainguard_engine import _native

    return bool(_native.ACTIVE)


def wants_pure(path: Path) -> bool:
    """Whether the test module at ``path`` asks for the pure engine (:data:`MARK`)."""
    try:
        return bool(MARK.search(path.read_text(encoding="utf-8")))
    except OSError:
        return False


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


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> Optional[pytest.Collector]:
    """The hook (see the module's docstring): a marked module under the compiled engine; else pytest's own."""
    if wants_pure(module_path) and compiled_engine():
        return PureEngineModule.from_parent(parent, path=module_path)
    return None
