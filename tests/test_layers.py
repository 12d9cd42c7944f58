"""The arrows of the data flow point one way: SDK (schema, fingerprints, hooks, transports) → engine (pure
detection) → server (gateway, queue, processor, stores, API). Read from the import statements of every
module (``ast``, so an import inside a function counts too):

* the SDK (``trainguard``) imports neither the engine nor the server: the training process never loads
  detection code;
* the engine (``trainguard_engine``) imports nothing of the server, and of the SDK only its wire-level
  core -- the schema and the fingerprints (``trainguard.core.events``, ``trainguard.core.fingerprint``
  and its reader of printed tracebacks ``trainguard.core.tracebacks``, ``trainguard.v1``); no I/O
  libraries either (the engine is pure);
* each distribution's pyproject declares the dependency the arrows need and no other of ours.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
SDK = REPO / "sdk" / "src" / "trainguard"
ENGINE = REPO / "engine" / "src" / "trainguard_engine"
SERVER = REPO / "services" / "src" / "trainguard_server"

ENGINE_MAY_USE_OF_SDK = ("trainguard.core.events", "trainguard.core.fingerprint", "trainguard.core.tracebacks",
                         "trainguard.v1")
IMPURE = ("socket", "sqlite3", "subprocess", "threading", "requests", "urllib", "http", "grpc", "asyncio")


def imports(package: Path) -> Iterator[Tuple[str, int, str]]:
    """(file, line, absolute module name) of every import in ``package`` (relative ones resolved)."""
    root = package.parent
    for path in sorted(package.rglob("*.py")):
        if "_pb2" in path.name:
            continue
        here = list(path.relative_to(root).with_suffix("").parts)[:-1]  # the package holding the module
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield str(path.relative_to(REPO)), node.lineno, alias.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1] if node.level > 1 else here
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                names = [f"{module}.{a.name}" for a in node.names] if not node.module else [module]
                for name in names:
                    yield str(path.relative_to(REPO)), node.lineno, name


def _offending(package: Path, allowed: Tuple[str, ...], forbidden: Tuple[str, ...]) -> List[str]:
    bad = []
    for where, line, module in imports(package):
        top = module.split(".")[0]
        if top in forbidden or (allowed and top == "trainguard" and not module.startswith(allowed)):
            bad.append(f"{where}:{line} imports {module}")
    return bad


def test_the_sdk_imports_neither_the_engine_nor_the_server() -> None:
    assert _offending(SDK, (), ("trainguard_engine", "trainguard_server")) == []


def test_the_engine_imports_only_the_sdks_wire_core_and_nothing_of_the_server() -> None:
    assert _offending(ENGINE, ENGINE_MAY_USE_OF_SDK, ("trainguard_server",)) == []


def test_the_engine_is_pure() -> None:
    bad = [f"{w}:{n} imports {m}" for w, n, m in imports(ENGINE) if m.split(".")[0] in IMPURE]
    assert bad == []


def test_the_resolver_sees_relative_imports() -> None:  # the checks above would pass vacuously otherwise
    found = {m for _w, _n, m in imports(ENGINE)}
    assert "trainguard_engine.catalogue" in found and "trainguard_engine.robust" in found
    assert "trainguard.core.events" in found


@pytest.mark.parametrize("dist, ours", [("sdk", set()), ("engine", {"trainguard"}),
                                        ("services", {"trainguard", "trainguard-engine"})])
def test_each_distribution_depends_on_what_its_arrows_need(dist: str, ours: set) -> None:  # type: ignore[type-arg]
    project = tomllib.loads((REPO / dist / "pyproject.toml").read_text())["project"]
    names = {d.split("[")[0].split("=")[0].split(">")[0].strip() for d in project.get("dependencies", [])}
    assert names & {"trainguard", "trainguard-engine", "trainguard-server"} == ours


@pytest.mark.parametrize("folder", ["storage", "queue"])
def test_production_backends_do_not_import_the_in_memory_test_doubles(folder: str) -> None:
    bad = [f"{w}:{n} imports {m}" for w, n, m in imports(SERVER / folder)
           if m.startswith(f"trainguard_server.{folder}.memory") and not w.endswith("/memory.py")]
    assert bad == []
