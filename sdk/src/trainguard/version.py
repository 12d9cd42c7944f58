"""The SDK's name and version (every envelope's ``sdk`` field) and the torch releases it supports."""

from __future__ import annotations

import re
from typing import Optional, Tuple

SDK_NAME = "trainguard-python"
__version__ = "0.1.0"

#: torch releases ``watch()`` supports: from 2.1 (``register_post_accumulate_grad_hook``) up to, not
#: including, 3.0. The SDK never installs torch (it has no torch dependency or extra): it uses the job's.
TORCH_SUPPORTED: Tuple[Tuple[int, int], Tuple[int, int]] = ((2, 1), (3, 0))
#: What the tests and benchmarks ran: 2.13 (CPU, the suite), 2.11 (CUDA 13, H200 recordings).
TORCH_TESTED = "2.11 (CUDA), 2.13 (CPU)"


def torch_version_problem(version: str) -> Optional[str]:
    """One line saying why ``version`` (``torch.__version__``, e.g. ``2.13.0+cpu``) is not supported, or
    None when it is (see :data:`TORCH_SUPPORTED`)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    low, high = TORCH_SUPPORTED
    supported = f"{low[0]}.{low[1]} up to {high[0]}.0 (exclusive)"
    if match is None:
        return f"cannot read torch's version {version!r}; watch() supports torch {supported}"
    found = (int(match.group(1)), int(match.group(2)))
    if low <= found < high:
        return None
    return (f"torch {version} is outside the releases watch() supports ({supported}; tested "
            f"{TORCH_TESTED}): gradient and step signals may be missing. TrainGuard never installs torch: "
            f"upgrade it yourself")
