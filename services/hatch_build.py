"""Wheel build hook: the dashboard's charting library and /docs' Swagger UI ship inside the server's wheel.

``static/vendor/`` (echarts.min.js, swagger-ui-bundle.js, swagger-ui.css) is git-ignored (fetched from the
npm registry by ``tools/fetch_assets.py``), so hatchling would leave it out; ``artifacts`` in pyproject.toml
takes it in, and this hook makes sure the files are there before a wheel is built: from a clone it runs
``tools/fetch_assets.py`` when one is missing, and otherwise refuses to build a server whose dashboard or
/docs cannot render (one line saying how to fix it). Editable installs are not checked (the Makefile fetches
the assets after them).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

VENDOR = Path("src/trainguard_server/dashboard/static/vendor")
ASSETS = ("echarts.min.js", "swagger-ui-bundle.js", "swagger-ui.css")  # tools/fetch_assets.py's


class VendorAssetHook(BuildHookInterface):  # type: ignore[misc]
    """Fetches (from a clone) or requires the vendored charting library before a standard wheel build."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: Dict[str, Any]) -> None:
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
