"""Wheel build hook: the dashboard's charting library and /docs' Swagger UI ship inside the server's wheel.

``static/vendor/`` (echarts.min.js, swagger-ui-bundle.js, swagger-ui.css) is git-ignored (fetched from the
npm registry by ``tools/fetch_assets.py``), so hatchling would leave it out; ``artifacts`` in pyproject.toml
takes it in, and this hook makes sure the files are there before a wheel is built: from a clone it runs
``tools/fetch_assets.py`` when one is missing, and otherwise refuses to build a server whose dashboard or
/docs cannot render (one line saying how to fix it). Editable installs are not checked (the Makefile fetches
the assets after them).

An editable install (``make install``, the CI's) also builds the processor's native reader in place
(src/trainguard_server/processor/native.py compiles _fastread.c with Python's C compiler, -O2): a compile that
fails prints one warning line and leaves the protobuf path (processor/decode.py), which reads every record
the same, slower. Wheels stay pure Python (``py3-none-any``: the Docker and Flink images, which have no C
compiler, read through protobuf); they carry the C source, so ``python -m trainguard_server.processor.native``
builds it where the package is installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

VENDOR = Path("src/trainguard_server/dashboard/static/vendor")
ASSETS = ("echarts.min.js", "swagger-ui-bundle.js", "swagger-ui.css")  # tools/fetch_assets.py's
NATIVE_BUILDER = Path("src/trainguard_server/processor/native.py")
"""Builds the processor's optional native reader (standard library only: loaded by path, before any
dependency is installed)."""


class VendorAssetHook(BuildHookInterface):  # type: ignore[misc]
    """Fetches (from a clone) or requires the vendored charting library before a standard wheel build."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: Dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "editable":
            self._build_native()
        if self.target_name != "wheel" or version == "editable":
            return
        root = Path(self.root)
        fetch = root.parent / "tools" / "fetch_assets.py"
        if any(not (root / VENDOR / name).is_file() for name in ASSETS) and fetch.is_file():
            subprocess.run([sys.executable, str(fetch)], check=True)
        missing = [str(root / VENDOR / name) for name in ASSETS if not (root / VENDOR / name).is_file()]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} missing: run `python tools/fetch_assets.py` (needs "
                               "npm) in the TrainGuard clone before building the trainguard-server wheel")

    def _build_native(self) -> None:
        """The processor's native reader, compiled in place for an editable install (optional: a warning)."""
        path = Path(self.root) / NATIVE_BUILDER
        spec = importlib.util.spec_from_file_location("_trainguard_native_build", path)
        if spec is None or spec.loader is None:
            return
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        if builder.build() is None:
            print(f"warning: {NATIVE_BUILDER.with_name('_fastread.c')} (the processor's native reader) did "
                  "not compile -- no C compiler or Python headers? -- records are read through protobuf "
                  "(the same, slower)", file=sys.stderr)
