"""The engine's pure-Python runs under its compiled build: tests marked ``@pytest.mark.engine_pure("<why>")``
and modules that say ``ENGINE_PURE = "<why>"`` run on the pure engine in a subprocess when the compiled one is
loaded (tests/support/engine_pure.py)."""

from tests.support.engine_pure import (
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_pycollect_makemodule,
)

__all__ = ["pytest_collection_modifyitems", "pytest_configure", "pytest_pycollect_makemodule"]
