#!/usr/bin/env python3
"""Build the wheels of the three distributions into ``dist/``: ``python tools/build_dist.py [--out DIR]``.

``sdk/`` -> ``trainguard``, ``engine/`` -> ``trainguard-engine``, ``services/`` -> ``trainguard-server``
(what ``make dist`` runs). Each is built by pip with its own build backend (hatchling, from the package
registry, in pip's isolated build environment); the server's wheel carries the dashboard's charting library
(services/hatch_build.py). Afterwards each wheel is checked: it exists once, at the version in its
pyproject.toml, and the server's holds ``echarts.min.js`` -- a wheel without it exits 1 saying so. Prints
the wheels' paths, one a line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = (("sdk", "trainguard"), ("engine", "trainguard_engine"), ("services", "trainguard_server"))
VENDOR_MEMBER = "trainguard_server/dashboard/static/vendor/echarts.min.js"
#: what tools/fetch_assets.py vendors: the dashboard's charts and /docs' Swagger UI
VENDOR_MEMBERS = (VENDOR_MEMBER, "trainguard_server/dashboard/static/vendor/swagger-ui-bundle.js",
                  "trainguard_server/dashboard/static/vendor/swagger-ui.css")


def build(out: Path, python: str = sys.executable) -> List[Path]:
    """Build every distribution's wheel into ``out``; the wheels, in DISTRIBUTIONS' order."""
    out.mkdir(parents=True, exist_ok=True)
    for _, stem in DISTRIBUTIONS:  # an older build of the same name would hide a failed one
        for old in out.glob(f"{stem}-*.whl"):
            old.unlink()
    subprocess.run([python, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                    "--wheel-dir", str(out), *(str(REPO / d) for d, _ in DISTRIBUTIONS)], check=True)
    wheels = []
    for _, stem in DISTRIBUTIONS:
        found = sorted(out.glob(f"{stem}-*.whl"))
        if len(found) != 1:
            raise SystemExit(f"build_dist: expected one {stem} wheel in {out}, found {len(found)}")
        wheels.append(found[0])
    with zipfile.ZipFile(wheels[-1]) as whl:
        missing = [m for m in VENDOR_MEMBERS if m not in whl.namelist()]
        if missing:
            raise SystemExit(f"build_dist: {wheels[-1].name} lacks {', '.join(missing)}: the dashboard or "
                             "/docs would not render (python tools/fetch_assets.py)")
    return wheels


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="where the wheels go (default dist/)")
    args = parser.parse_args(argv)
    for wheel in build(args.out):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
