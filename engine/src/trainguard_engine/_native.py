"""Which engine modules run compiled: the mypyc build of the hot modules (engine/native_build.py), used only
when it was built from exactly these sources; else the pure-Python modules, which give the same results.

Standard library only (the build script loads this file by path). The package's ``__init__`` calls
:func:`activate`, which puts the build's folders first on ``trainguard_engine.__path__`` (and the detectors'
on theirs: :func:`detectors_path`) when

* ``TRAINGUARD_ENGINE_NATIVE`` is not ``0``, ``false``, ``no`` or ``off`` (any case: always pure, silently;
  another value than those and ``1``/``true``/``yes``/``on``: pure, one warning line),
* ``<engine>/build/native/manifest.json`` exists (no build: pure, silently -- a wheel install),
* the manifest names this interpreter (cache tag, extension suffix), the same hot modules and, for every
  source that shapes the compiled code (every ``.py`` of the package but ``classify/``, and the SDK's two
  wire-schema modules the engine reads), the sha256 of the file as it is now -- else one warning line and
  pure: an edited ``.py`` never runs as its stale compiled copy; and the build script
  (``engine/native_build.py``: its mypy config, group, flags) is the one that made it, where it is present,
* every compiled module and the group's library are there.

When it is used, :func:`activate` imports every hot module right away, while the check holds and under a
shared lock the build script takes exclusively around its swap (:data:`LOCK`): a build replaced or removed
later (a rebuild, ``rm -rf engine/build``) cannot leave this process half compiled, half pure. An import
that fails or loads a module from elsewhere drops them all again: pure, one warning line.

``classify/`` (the log classifier, pure Python, edited often) is left out of the digests: the compiled
``detectors.process`` calls it as any Python caller does, and the values it hands back are checked against
their annotations at that boundary (a type that drifted raises there; nothing is read differently).
The check reads and hashes ~0.8 MB (~2 ms at import; bench/results/processor_issue15_stop48.txt).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import IO, Dict, List, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock (builds there are the developer's own)
    fcntl = None  # type: ignore[assignment]

HOT = ("clusters", "correlate", "diagnosis", "extract", "incidents", "pipeline", "quotas", "records",
       "robust", "shards", "state", "detectors.adapter", "detectors.base", "detectors.gradient",
       "detectors.loss", "detectors.memory", "detectors.numeric", "detectors.process", "detectors.progress",
       "detectors.registry", "detectors.roles", "detectors.sequence", "detectors.straggler")
"""The compiled modules, under ``trainguard_engine``. Not the package ``__init__``s (they stay pure, so
that the package is always found in the source tree), nor ``catalogue``, ``classify``, ``envelope`` (the
processor's native reader builds its objects), ``run_part`` (a bytes subclass) or this module."""

PACKAGE = Path(__file__).resolve().parent
BUILD = PACKAGE.parents[1] / "build" / "native"
"""Where engine/native_build.py puts the build: ``engine/build/native`` of a source checkout (git-ignored)."""
MANIFEST = "manifest.json"
SCRIPT = PACKAGE.parents[1] / "native_build.py"
"""The build script, whose sha256 the manifest also holds (``engine/native_build.py`` of a checkout)."""
LOCK = BUILD.parent / "native.lock"
"""The lock file beside the build: the build script holds it exclusively around its swap, :func:`activate`
shared around its check and imports (a reader never sees the build half swapped; engine/native_build.py
serialises whole builds with another lock, ``native.build.lock``, that readers never wait on)."""
GROUP_LIBRARY = "native__mypyc"
"""The group's shared library below ``trainguard_engine`` (engine/native_build.py's ``GROUP``), which every
compiled module loads."""
OFF = ("0", "false", "no", "off")
ON = ("", "1", "true", "yes", "on")
"""``TRAINGUARD_ENGINE_NATIVE``'s values (any case): pure; the compiled build when it may be used."""
UNHASHED = ("classify/",)
"""Sources below the package left out of the digests (see the module's docstring)."""
SDK_MODULES = ("events.py", "fingerprint.py")
"""The SDK's modules (``trainguard.core``) whose types the compiled engine reads."""

ACTIVE = False
"""Whether :func:`activate` put the build on the package path (this process)."""
REASON = "not checked"
"""Why the build is or is not used, in words."""


def interpreter() -> Dict[str, str]:
    """What a build is tied to: the interpreter's cache tag and extension-module suffix."""
    return {"cache_tag": str(sys.implementation.cache_tag),
            "ext_suffix": str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")}


def sdk_core() -> Optional[Path]:
    """The folder of ``trainguard.core`` (the SDK), found without importing it; None when absent."""
    for entry in sys.path:
        folder = Path(entry or ".") / "trainguard" / "core"
        if (folder / SDK_MODULES[0]).is_file():
            return folder
    return None


def source_digests(package: Path = PACKAGE, core: Optional[Path] = None) -> Dict[str, str]:
    """sha256 of every source the compiled code was typed against: each ``.py`` under ``package`` (by its
    path below it) but those under :data:`UNHASHED`, and the SDK's :data:`SDK_MODULES` (as
    ``trainguard/core/<name>``)."""
    out: Dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if not name.startswith(UNHASHED):
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    core = core if core is not None else sdk_core()
    for name in SDK_MODULES:
        if core is not None and (core / name).is_file():
            out["trainguard/core/" + name] = hashlib.sha256((core / name).read_bytes()).hexdigest()
    return out


def script_digest(script: Path = SCRIPT) -> Optional[str]:
    """sha256 of the build script; None where it is absent (a copy of the package alone)."""
    try:
        return hashlib.sha256(script.read_bytes()).hexdigest()
    except OSError:
        return None


def check(build: Path = BUILD, package: Path = PACKAGE, script: Optional[Path] = None) -> Optional[str]:
    """None when ``build`` holds a build of exactly ``package``'s sources for this interpreter, made by the
    build script beside it (``script``, default ``<package>/../../native_build.py``, where present), else
    why not (``"no build"`` when there is none at all)."""
    try:
        manifest = json.loads((build / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no build"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if not isinstance(manifest, dict):
        return "unreadable manifest"
    if manifest.get("interpreter") != interpreter():
        return f"built for another interpreter ({manifest.get('interpreter')})"
    if manifest.get("modules") != list(HOT):
        return "built for another set of modules"
    built = manifest.get("sources")
    now = source_digests(package)
    if built != now:
        changed = sorted(k for k in set(now) | set(built or {}) if now.get(k) != (built or {}).get(k))
        return "stale: sources changed since the build (" + ", ".join(changed[:4]) + \
            (", ..." if len(changed) > 4 else "") + ")"
    recipe = script_digest(script if script is not None else package.parents[1] / "native_build.py")
    if recipe is not None and manifest.get("script") != recipe:
        return "stale: engine/native_build.py changed since the build"
    suffix = interpreter()["ext_suffix"]
    missing = [m for m in (*HOT, GROUP_LIBRARY)
               if not (build / "trainguard_engine" / (m.replace(".", "/") + suffix)).is_file()]
    if missing:
        return "incomplete build (" + ", ".join(missing[:4]) + ")"
    return None


def _warn(reason: str) -> None:
    sys.stderr.write(f"trainguard_engine: the compiled engine in {BUILD} is not used ({reason}); "
                     "running pure Python -- rebuild: python engine/native_build.py\n")


def locked(shared: bool, lock: Path = LOCK) -> Optional[IO[bytes]]:
    """:data:`LOCK` held (shared or exclusive) until the file returned is closed; None where there is no
    lock to take (no build folder, not POSIX)."""
    if fcntl is None:
        return None
    try:
        handle = open(lock, "a+b") if not shared else open(lock, "rb")
    except OSError:
        return None
    fcntl.flock(handle.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    return handle


def _load_all(path: List[str]) -> Optional[str]:
    """Import every hot module from the build now (:func:`activate`); None when each came from it, else why
    not -- the build's folders are taken off the paths and its modules forgotten (the pure ones load)."""
    folder = str(BUILD / "trainguard_engine")
    try:
        for name in HOT:
            __import__("trainguard_engine." + name)
        loaded = compiled_modules()
        reason = None if all(loaded.get(name) for name in HOT) else \
            "changed while loading (" + ", ".join(n for n in HOT if not loaded.get(n))[:200] + ")"
    except Exception as exc:  # whatever failed, the pure modules are the answer
        reason = f"cannot be loaded ({type(exc).__name__}: {exc})"
    if reason is None:
        return None
    for entry in (path, getattr(sys.modules.get("trainguard_engine.detectors"), "__path__", [])):
        while any(str(p).startswith(folder) for p in entry):
            entry.remove(next(p for p in entry if str(p).startswith(folder)))
    for name in [n for n in sys.modules if n.startswith("trainguard_engine.") and n != __name__]:
        del sys.modules[name]
    return reason


def activate(path: List[str]) -> bool:
    """Put the build first on ``path`` (``trainguard_engine.__path__``) and import every hot module from it
    when it may be used (see the module's docstring); whether it was. One warning line on stderr when a
    build exists and is not used, or ``TRAINGUARD_ENGINE_NATIVE`` has an unknown value."""
    global ACTIVE, REASON
    setting = os.environ.get("TRAINGUARD_ENGINE_NATIVE", "1").strip().lower()
    if setting in OFF:
        REASON = f"TRAINGUARD_ENGINE_NATIVE={setting}"
        return False
    if setting not in ON:
        REASON = f"TRAINGUARD_ENGINE_NATIVE={setting!r} is not one of {'/'.join(OFF + ON[1:])}"
        _warn(REASON)
        return False
    lock = locked(shared=True)
    try:
        reason = check()
        if reason is None:
            path.insert(0, str(BUILD / "trainguard_engine"))
            ACTIVE = True
            reason = _load_all(path)
            ACTIVE = reason is None
    finally:
        if lock is not None:
            lock.close()
    if reason is not None:
        REASON = reason
        if reason != "no build":
            _warn(reason)
        return False
    REASON = "compiled build in use"
    return True


def detectors_path(path: List[str]) -> None:
    """Put the build's detectors first on ``path`` (``trainguard_engine.detectors.__path__``) when
    :func:`activate` put the build on the package's."""
    if ACTIVE:
        path.insert(0, str(BUILD / "trainguard_engine" / "detectors"))


def source_path(module: str) -> Path:
    """The ``.py`` file of the engine module ``module`` (``"pipeline"``, ``"detectors.loss"``), compiled or
    not: a compiled module's ``__file__`` is its extension's (inspect.getsource finds no source there)."""
    return PACKAGE / (module.replace(".", "/") + ".py")


def compiled_modules() -> Dict[str, bool]:
    """For each of :data:`HOT` already imported, whether it was loaded from the compiled build."""
    suffix = interpreter()["ext_suffix"]
    out: Dict[str, bool] = {}
    for name in HOT:
        module = sys.modules.get("trainguard_engine." + name)
        if module is not None:
            out[name] = str(getattr(module, "__file__", "")).endswith(suffix)
    return out
