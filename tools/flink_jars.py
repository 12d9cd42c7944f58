#!/usr/bin/env python3
"""Put Flink's Kafka connector jars in a folder: ``python tools/flink_jars.py DEST``.

Downloads the wheel pinned in requirements/flink-connectors.txt with pip (``--no-deps``, no install) and
extracts ``flink-connector-kafka.jar`` and ``kafka-clients.jar`` from it into DEST, checking the connector's
manifest version. The Flink job adds every jar in DEST to its classpath (``pipeline.jars``). Idempotent:
an existing DEST with both jars is left as it is.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIN = REPO / "requirements" / "flink-connectors.txt"
JARS = ("flink-connector-kafka.jar", "kafka-clients.jar")
CONNECTOR_VERSION = "4.0.1-2.0"


def requirement() -> str:
    lines = [line.strip() for line in PIN.read_text().splitlines()]
    (req,) = [line for line in lines if line and not line.startswith("#")]
    return req


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0])
    if all((dest / name).is_file() for name in JARS):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                        "--no-deps", "-d", tmp, requirement()], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as whl:
            for name in JARS:
                (dest / name).write_bytes(whl.read(f"pyflink/lib/{name}"))
    with zipfile.ZipFile(dest / "flink-connector-kafka.jar") as jar:
        manifest = jar.read("META-INF/MANIFEST.MF").decode()
    if f"Implementation-Version: {CONNECTOR_VERSION}" not in manifest:
        print(f"unexpected connector version in {dest}: {manifest!r}", file=sys.stderr)
        return 1
    print(f"Kafka connector {CONNECTOR_VERSION} jars in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
