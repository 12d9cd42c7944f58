"""Test modules marked ``ENGINE_PURE = "<why>"`` run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py)."""

from tests.support.engine_pure import pytest_pycollect_makemodule

__all__ = ["pytest_pycollect_makemodule"]
