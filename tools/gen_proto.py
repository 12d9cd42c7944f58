#!/usr/bin/env python3
"""Generate the Python code for the wire schema: proto/trainguard/v1/*.proto -> sdk/src/trainguard/v1/.

Contract:
  * ``python tools/gen_proto.py`` regenerates ``<name>_pb2.py`` and ``<name>_pb2.pyi`` for every
    ``.proto`` under ``proto/trainguard/v1/``, plus ``<name>_pb2_grpc.py`` for those that declare a
    ``service``, and deletes stale generated files there. Hand-written files (``__init__.py``) are never
    touched. Files are rewritten only when their bytes change.
  * ``python tools/gen_proto.py --check`` generates into a temporary directory and compares byte for byte
    with the committed files: exit 0 when identical, exit 1 with a diff summary otherwise. It writes nothing
    into the repository.
  * Both modes need exactly the grpcio-tools version pinned in ``tools/requirements-proto.txt`` (protoc is
    bundled in that wheel, so the pin alone makes the output reproducible); any other version is exit 2
    with the command that fixes it.
  * The generator is a build tool, kept out of the dev/runtime venv: the pinned grpcio-tools requires
    protobuf < 6 while the dev venv runs protobuf 6/7 (protoc itself needs no protobuf runtime). It is
    looked up first in ``.venv-proto/`` (a ``pip install --target`` directory, git-ignored; override with
    ``$TRAINGUARD_PROTO_TOOLS``), then in the running interpreter. ``--install-tools`` creates that
    directory from the pin (``pip install --no-deps --only-binary=:all: --target .venv-proto``).

The generated modules import each other as ``from trainguard.v1 import events_pb2``: ``trainguard.v1`` is a
real subpackage of the SDK. Run from any directory; paths are resolved from this file.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("trainguard") / "v1"  # relative to both the proto root and the SDK source root
OUT_DIR = REPO_ROOT / "sdk" / "src" / PACKAGE_DIR
REQUIREMENTS = REPO_ROOT / "tools" / "requirements-proto.txt"
TOOLS_DIR = Path(os.environ.get("TRAINGUARD_PROTO_TOOLS") or REPO_ROOT / ".venv-proto")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
MAX_DIFF_LINES = 40  # per file, in --check output

_SERVICE_RE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)
_PIN_RE = re.compile(r"^\s*grpcio-tools\s*==\s*([0-9][^\s#;]*)", re.MULTILINE | re.IGNORECASE)


class GenError(Exception):
    """A precondition failed (wrong tool version, protoc error); the message says how to fix it."""


def pinned_version(requirements: Path = REQUIREMENTS) -> str:
    """The ``grpcio-tools==X`` version pinned in ``requirements``."""
    match = _PIN_RE.search(requirements.read_text(encoding="utf-8"))
    if not match:
        raise GenError(f"{requirements}: no 'grpcio-tools==<version>' line")
    return match.group(1)


def _installed_in(path: Path) -> Optional[str]:
    """The grpcio-tools version installed in the ``--target`` directory ``path``, or None."""
    for dist in metadata.distributions(path=[str(path)]):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == "grpcio-tools":
            return dist.version
    return None


def find_tools(pinned: str) -> Optional[Path]:
    """Where the pinned grpcio-tools is: TOOLS_DIR, or None for the running interpreter; else GenError."""
    fix = "python tools/gen_proto.py --install-tools"
    found = _installed_in(TOOLS_DIR) if TOOLS_DIR.is_dir() else None
    if found == pinned:
        return TOOLS_DIR
    try:
        here: Optional[str] = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        here = None
    if here == pinned:
        return None
    seen = "; ".join(f"{where}: grpcio-tools {version}" for where, version in
                     ((TOOLS_DIR, found), (sys.executable, here)) if version) or "not installed anywhere"
    raise GenError(f"the generated code is pinned to grpcio-tools=={pinned} ({REQUIREMENTS.name}); "
                   f"found {seen}. Other versions emit different code and raise the runtime floor of "
                   f"protobuf/grpcio. "
                   f"Fix: `{fix}` (installs the pin into {TOOLS_DIR.name}/, isolated from your venv)")


def install_tools() -> None:
    """(Re)create TOOLS_DIR with exactly the pinned grpcio-tools; raise GenError if pip fails."""
    if TOOLS_DIR.exists():
        shutil.rmtree(TOOLS_DIR)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--target", str(TOOLS_DIR), "-r", str(REQUIREMENTS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise GenError(f"could not install the pinned grpcio-tools (`{' '.join(cmd)}`):\n"
                       f"{proc.stderr.strip()}\n(no wheel for this Python? the pin has wheels for 3.8-3.12)")


def proto_files() -> List[Path]:
    """Every .proto of the package, relative to PROTO_ROOT, sorted (stable protoc input order)."""
    files = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not files:
        raise GenError(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    return [f.relative_to(PROTO_ROOT) for f in files]


def expected_outputs(protos: Sequence[Path]) -> List[str]:
    """File names (inside the package dir) that generation must produce for ``protos``."""
    names: List[str] = []
    for proto in protos:
        stem = proto.stem
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
        if _SERVICE_RE.search((PROTO_ROOT / proto).read_text(encoding="utf-8")):
            names.append(f"{stem}_pb2_grpc.py")
    return sorted(names)


def generate(dest: Path, tools: Optional[Path]) -> Dict[str, bytes]:
    """Run protoc (from ``tools``, or this interpreter when None) into scratch dir ``dest``.

    Returns {file name: bytes} of the expected outputs.
    """
    protos = proto_files()
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={dest}",
           f"--pyi_out={dest}", f"--grpc_python_out={dest}", *(str(p) for p in protos)]
    env = dict(os.environ)
    if tools is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tools), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(cmd, cwd=PROTO_ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise GenError(f"protoc failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    out: Dict[str, bytes] = {}
    for name in expected_outputs(protos):
        path = dest / PACKAGE_DIR / name
        if not path.is_file():
            raise GenError(f"protoc did not produce {PACKAGE_DIR / name}")
        out[name] = path.read_bytes()
    return out


def committed_outputs() -> Dict[str, bytes]:
    """{file name: bytes} of the generated-looking files currently in OUT_DIR."""
    if not OUT_DIR.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(OUT_DIR.iterdir())
            if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)}


def diff_summary(fresh: Dict[str, bytes], committed: Dict[str, bytes]) -> List[str]:
    """Human-readable lines describing how ``committed`` differs from ``fresh``; empty when identical."""
    lines: List[str] = []
    for name in sorted(set(fresh) | set(committed)):
        new, old = fresh.get(name), committed.get(name)
        rel = f"sdk/src/{PACKAGE_DIR / name}"
        if old is None:
            lines.append(f"missing:  {rel}")
        elif new is None:
            lines.append(f"stale:    {rel} (generated-looking file that no .proto produces)")
        elif new != old:
            diff = list(difflib.unified_diff(
                old.decode("utf-8", "replace").splitlines(), new.decode("utf-8", "replace").splitlines(),
                fromfile=f"committed/{name}", tofile=f"generated/{name}", lineterm="", n=1))
            added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
            removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
            lines.append(f"differs:  {rel} (+{added} -{removed} lines)")
            shown = diff[:MAX_DIFF_LINES]
            lines += ["    " + d[:160] for d in shown]
            if len(diff) > len(shown):
                lines.append(f"    ... {len(diff) - len(shown)} more diff lines")
    return lines


def write_outputs(fresh: Dict[str, bytes], committed: Dict[str, bytes]) -> List[str]:
    """Make OUT_DIR match ``fresh``; returns one line per file written or deleted."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    actions: List[str] = []
    for name, data in sorted(fresh.items()):
        if committed.get(name) != data:
            (OUT_DIR / name).write_bytes(data)
            actions.append(f"wrote    sdk/src/{PACKAGE_DIR / name}")
    for name in sorted(set(committed) - set(fresh)):
        (OUT_DIR / name).unlink()
        actions.append(f"deleted  sdk/src/{PACKAGE_DIR / name} (stale)")
    return actions


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 --check found differences, 2 error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true",
                        help="verify the committed generated code is reproducible; write nothing")
    parser.add_argument("--install-tools", action="store_true",
                        help=f"first install the pinned grpcio-tools into {TOOLS_DIR.name}/ (needs pip)")
    args = parser.parse_args(argv)
    try:
        if args.install_tools:
            install_tools()
        tools = find_tools(pinned_version())
        with tempfile.TemporaryDirectory(prefix="tg-gen-proto-") as tmp:
            fresh = generate(Path(tmp), tools)
    except GenError as exc:
        print(f"gen_proto: error: {exc}", file=sys.stderr)
        return 2
    committed = committed_outputs()
    if args.check:
        problems = diff_summary(fresh, committed)
        if problems:
            print("gen_proto --check: the committed generated code is out of date:", file=sys.stderr)
            for line in problems:
                print("  " + line, file=sys.stderr)
            print("fix: python tools/gen_proto.py  (then commit sdk/src/trainguard/v1/)", file=sys.stderr)
            return 1
        print(f"gen_proto --check: {len(fresh)} generated files up to date")
        return 0
    actions = write_outputs(fresh, committed)
    for line in actions:
        print(line)
    print(f"gen_proto: {len(fresh)} files, {len(actions)} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
