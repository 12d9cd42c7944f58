#!/usr/bin/env python3
"""Put the dashboard's third-party JavaScript where the server serves it: ``python tools/fetch_assets.py``.

The dashboard and the API's ``/docs`` (Swagger UI) are served by the TrainGuard process itself and must work
offline (training clusters often are): no CDN at run time. This fetches the pinned packages from the npm
registry with ``npm pack`` at install time and copies the one file each needs into
``services/src/trainguard_server/dashboard/static/vendor/`` (git-ignored; the server wheel ships them).
Idempotent: a file already there with the pinned version's stamp is kept.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENDOR = REPO / "services" / "src" / "trainguard_server" / "dashboard" / "static" / "vendor"
ASSETS = (  # (npm package@version, file inside the package tarball, name served)
    ("echarts@6.1.0", "package/dist/echarts.min.js", "echarts.min.js"),
    # /docs (Swagger UI, served by the API itself: it renders offline)
    ("swagger-ui-dist@5.35.0", "package/swagger-ui-bundle.js", "swagger-ui-bundle.js"),
    ("swagger-ui-dist@5.35.0", "package/swagger-ui.css", "swagger-ui.css"),
)


def main() -> int:
    VENDOR.mkdir(parents=True, exist_ok=True)
    for spec, member, name in ASSETS:
        stamp = VENDOR / f"{name}.version"
        if (VENDOR / name).is_file() and stamp.is_file() and stamp.read_text().strip() == spec:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(["npm", "pack", spec, "--silent", "--pack-destination", tmp],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()
            tarball = Path(tmp) / out[-1]
            with tarfile.open(tarball) as tar:
                data = tar.extractfile(member)
                if data is None:
                    raise SystemExit(f"{member} not in {spec}")
                (VENDOR / name).write_bytes(data.read())
        stamp.write_text(spec + "\n")
        print(f"{spec}: {name} in {VENDOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
