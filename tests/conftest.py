"""The engine's pure-Python runs under its compiled build: tests marked ``@pytest.mark.engine_pure("<why>")``
and modules that say ``ENGINE_PURE = "<why>"`` run on the pure engine in a subprocess when the compiled one is
loaded (tests/support/engine_pure.py).

In-process servers of the suite run the pipeline in the processor's thread (TRAINGUARD_PROCESSOR_WORKERS=0,
unless a test sets it): ~200 of them start, and auto's worker processes would add seconds to each. The
``trainguard serve`` subprocesses (tests/services/e2e/serve_process.py: the kill -9, fault, hostile and
shutdown tests) run the real default -- auto workers -- and the pool has its own tests
(tests/services/processor/test_pool_*.py)."""

import os

from tests.services.e2e.serve_process import WORKERS_PINNED
from tests.support.engine_pure import (
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_pycollect_makemodule,
)

__all__ = ["pytest_collection_modifyitems", "pytest_configure", "pytest_pycollect_makemodule"]

if "TRAINGUARD_PROCESSOR_WORKERS" not in os.environ:  # a run that sets it (e.g. 2) keeps it everywhere
    os.environ["TRAINGUARD_PROCESSOR_WORKERS"] = "0"
    os.environ[WORKERS_PINNED] = "1"
