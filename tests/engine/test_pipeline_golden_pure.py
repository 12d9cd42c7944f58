"""The golden digests (tests/engine/test_pipeline_golden.py) on the PURE engine, the one wheels and the
Docker/Flink images ship, while ``make test`` runs the suite on the compiled one: under the compiled engine
this module runs in tests/support/engine_pure.py's subprocess (``TRAINGUARD_ENGINE_NATIVE=0``), so every
digest is asserted both compiled (in-process, test_pipeline_golden) and pure (here). Where this process runs
the pure engine already, test_pipeline_golden checked it and this module has nothing to add."""

from __future__ import annotations

import os

import pytest

from tests.engine.test_pipeline_golden import (
    test_every_stream_has_a_golden_digest,
    test_outputs_equal_the_golden_digest,
)
from trainguard_engine import _native

ENGINE_PURE = "the golden digests on the pure engine (what ships) beside the compiled run of the same tests"

__all__ = ["test_every_stream_has_a_golden_digest", "test_outputs_equal_the_golden_digest"]

pytestmark = pytest.mark.skipif(
    os.environ.get("TRAINGUARD_ENGINE_NATIVE", "").strip() != "0",
    reason="the engine is pure in this run already: test_pipeline_golden checked these digests on it")


def test_this_run_is_on_the_pure_engine() -> None:
    for name in _native.HOT:
        __import__("trainguard_engine." + name)
    assert not _native.ACTIVE and not any(_native.compiled_modules().values())
