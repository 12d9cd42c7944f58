"""Wheel build hook: the dashboard's charting library ships inside ``trainguard-server``'s wheel.

``static/vendor/echarts.min.js`` is git-ignored (fetched from the npm registry by ``tools/fetch_assets.py``),
so hatchling would leave it out; ``artifacts`` in pyproject.toml takes it in, and this hook makes sure it is
there before a wheel is built: from a clone it runs ``tools/fetch_assets.py`` when the file is missing, and
otherwise refuses to build a dashboard without charts (one line saying how to fix it). Editable installs are
not checked (the Makefile fetches the asset after them).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ASSET = Path("src/trainguard_server/dashboard/static/vendor/echarts.min.js")


class VendorAssetHook(BuildHookInterface):  # type: ignore[misc]
    """Fetches (from a clone) or requires the vendored charting library before a standard wheel build."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: Dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        root = Path(self.root)
        asset = root / ASSET
        fetch = root.parent / "tools" / "fetch_assets.py"
        if not asset.is_file() and fetch.is_file():
            subprocess.run([sys.executable, str(fetch)], check=True)
        if not asset.is_file():
            raise RuntimeError(f"{asset} is missing: run `python tools/fetch_assets.py` (needs npm) in the "
                               "TrainGuard clone before building the trainguard-server wheel")
