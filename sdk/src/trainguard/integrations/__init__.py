"""Integrations hook the SDK into Python, torch and trainers. Each refuses cleanly (DidNotEnable) when the
library it needs is missing, and undoes what it changed in ``teardown()``.

The trainer callbacks are reachable as attributes after a plain ``import trainguard`` --
``trainguard.integrations.lightning.TrainGuardCallback()``, ``trainguard.integrations.transformers.
TrainGuardCallback()`` -- imported on first use (PEP 562), so ``import trainguard`` never imports Lightning,
transformers or torch.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Submodules importable on attribute access (the others are internal and imported by the SDK itself).
LAZY = ("lightning", "transformers", "torch", "lora", "sequence", "cuda_memory")


def __getattr__(name: str) -> ModuleType:
    if name in LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
