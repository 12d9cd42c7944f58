"""Build the engine's compiled hot modules with mypyc, out of the source tree, into ``engine/build/native``
(git-ignored), with a manifest the package checks at import (``trainguard_engine/_native.py``): the build is
used only while every source it was typed against is unchanged. Standard library only at import (mypyc,
setuptools and a C compiler are needed only to build); ``make install`` and ``make test`` run it, and
``bench/processor.py`` builds the checkouts it measures with it.

Optional by design: without mypyc or a C compiler :func:`build` returns None (one warning line) and the
engine runs its pure-Python modules -- the same results, ~2x slower per event.

    python engine/native_build.py            # build when missing or stale (nothing to do: ~10 ms)
    python engine/native_build.py --force    # build again
    MYPYC_OPT_LEVEL=1 python engine/native_build.py   # a faster build of slower code (default 3)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import List, Optional

ENGINE = Path(__file__).resolve().parent
PACKAGE = ENGINE / "src" / "trainguard_engine"
SCRIPT = Path(__file__).resolve()
"""This script: its sha256 goes into the manifest (an edited recipe makes the build stale)."""
GROUP = "trainguard_engine.native"
"""mypyc's group: its shared library is ``trainguard_engine/native__mypyc<EXT_SUFFIX>``, found through the
package path like the modules."""
MYPY_CONFIG = """[mypy]
python_version = {version}
ignore_missing_imports = True
check_untyped_defs = True
follow_imports = silent
"""


def loader() -> ModuleType:
    """``trainguard_engine/_native.py`` loaded by path (its HOT list, digests and check), not imported as a
    package member (that would run the package's ``__init__``)."""
    spec = importlib.util.spec_from_file_location("_trainguard_engine_native", PACKAGE / "_native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup_script(sources: List[str], opt_level: str) -> str:
    """The setuptools script the stage runs: mypycify on the hot modules (one group: calls between them
    are direct C calls), every module its own C file (smaller units for the compiler)."""
    return (
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        "setup(name='trainguard-engine-native', script_args=['build_ext', '--inplace'],\n"
        f"      ext_modules=mypycify({sources!r} + ['--config-file', 'mypy.ini'], opt_level={opt_level!r}, "
        f"multi_file=True, group_name={GROUP!r}))\n")


def build(dest: Optional[Path] = None, force: bool = False, quiet: bool = True) -> Optional[Path]:
    """Compile the hot modules into ``dest`` (default ``engine/build/native``) unless a current build is
    there already; the build folder, or None when it could not be built (no mypyc, no compiler: the pure
    modules are used; one warning line). Builds into one ``dest`` run one at a time (``<dest>.build.lock``):
    a second waits, then finds the first's build current."""
    native = loader()
    dest = Path(dest) if dest is not None else Path(native.BUILD)
    dest.parent.mkdir(parents=True, exist_ok=True)
    serial = native.locked(shared=False, lock=dest.parent / (dest.name + ".build.lock"))
    try:
        return _build(native, dest, force, quiet)
    finally:
        if serial is not None:
            serial.close()


def _build(native: ModuleType, dest: Path, force: bool, quiet: bool) -> Optional[Path]:
    if not force and native.check(dest, PACKAGE, SCRIPT) is None:
        return dest
    started = time.monotonic()
    if importlib.util.find_spec("mypyc") is None:
        print("trainguard_engine: compiled engine not built (no mypyc: pip install mypy); pure Python is "
              "used", file=sys.stderr)
        return None
    stage = dest.parent / (dest.name + f".{os.getpid()}.stage")
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(PACKAGE, stage / "trainguard_engine", ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "*.pyd", "data"))
    digests = native.source_digests(stage / "trainguard_engine")
    recipe = native.script_digest(SCRIPT)  # (as it was when the build began)
    sources = [f"trainguard_engine/{m.replace('.', '/')}.py" for m in native.HOT]
    opt_level = os.environ.get("MYPYC_OPT_LEVEL", "3")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (stage / "mypy.ini").write_text(MYPY_CONFIG.format(version=version))
    (stage / "setup_native.py").write_text(_setup_script(sources, opt_level))
    env = dict(os.environ)
    # multi_file mode writes a dotted group's headers below build/<package>/ but includes only build/
    headers = "-Ibuild/" + GROUP.rsplit(".", 1)[0]
    env["CPPFLAGS"] = " ".join(p for p in (env.get("CPPFLAGS", ""), headers) if p)
    core = native.sdk_core()
    if core is not None:  # the SDK's wire schema, for the types
        env["MYPYPATH"] = os.pathsep.join(p for p in (str(core.parents[1]), env.get("MYPYPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "setup_native.py"], cwd=stage, env=env, capture_output=quiet,
                              timeout=1800, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        done = None
        print(f"trainguard_engine: compiled engine not built ({exc}); pure Python is used", file=sys.stderr)
    suffix = native.interpreter()["ext_suffix"]
    built = [stage / "trainguard_engine" / (m.replace(".", "/") + suffix) for m in native.HOT]
    if done is None or done.returncode != 0 or not all(p.is_file() for p in built):
        if done is not None:
            tail = (done.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] if quiet else []
            print("trainguard_engine: compiled engine not built (mypyc or the C compiler failed"
                  + (f": {tail[0]}" if tail else "") + "); pure Python is used", file=sys.stderr)
        shutil.rmtree(stage, ignore_errors=True)
        return None
    out = dest.parent / (dest.name + f".{os.getpid()}.new")
    shutil.rmtree(out, ignore_errors=True)
    for path in (stage / "trainguard_engine").rglob("*" + suffix):  # the modules and the group's library
        target = out / path.relative_to(stage)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    import mypy.version  # (present: mypyc is)

    manifest = {"interpreter": native.interpreter(), "modules": list(native.HOT), "sources": digests,
                "script": recipe,
                "mypyc": mypy.version.__version__, "opt_level": opt_level,
                "build_seconds": round(time.monotonic() - started, 1)}
    (out / native.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    old = dest.parent / (dest.name + f".{os.getpid()}.old")
    swap = native.locked(shared=False, lock=dest.parent / (dest.name + ".lock"))
    try:  # readers (the package's activate) hold it shared around their check and imports
        if dest.exists():
            os.replace(dest, old)
        os.replace(out, dest)  # the manifest moves with the modules it describes
    finally:
        if swap is not None:
            swap.close()
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(stage, ignore_errors=True)
    return dest


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="build even when a current build is there")
    parser.add_argument("--dest", type=Path, default=None, help="build folder (default engine/build/native)")
    parser.add_argument("--verbose", action="store_true", help="show mypyc's and the compiler's output")
    args = parser.parse_args(argv)
    started = time.monotonic()
    built = build(args.dest, force=args.force, quiet=not args.verbose)
    print(f"{built} ({time.monotonic() - started:.1f} s)" if built is not None else "not built")
    return 0 if built is not None else 1


if __name__ == "__main__":
    sys.exit(main())
