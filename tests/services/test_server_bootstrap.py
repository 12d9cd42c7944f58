"""The bootstrap tokens when several roles start together on one data dir (Helm's split mode, ``--roles``):
every process ends with the same, working tokens; none fails registering an operator's token twice."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from trainguard_server.config import Settings
from trainguard_server.server import TOKENS_FILE, EmbeddedServer
from trainguard_server.storage.select import open_stores
from trainguard_server.storage.sqlite import open_sqlite_stores

PROCESSES = 6
OPERATOR_INGEST = "tg_ingest_" + "ab" * 8 + "_" + "cd" * 24
OPERATOR_READ = "tg_read_" + "ef" * 8 + "_" + "01" * 24


def _bootstrap(data_dir: str, explicit: bool, barrier: Any, out: Any) -> None:
    settings = Settings(data_dir=Path(data_dir),
                        bootstrap_ingest_token=OPERATOR_INGEST if explicit else None,
                        bootstrap_read_token=OPERATOR_READ if explicit else None)
    server = EmbeddedServer(settings)
    server.stores = open_stores(settings, server.data_dir)
    try:
        barrier.wait(30)
        tokens = server._bootstrap_tokens()
        out.put({"project": tokens.project, "ingest": tokens.ingest, "read": tokens.read})
    except Exception as exc:  # reported to the test, which fails on it
        out.put({"error": repr(exc)})
    finally:
        server.stores.close()


def _race(data_dir: Path, explicit: bool) -> List[Dict[str, str]]:
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(PROCESSES), ctx.Queue()
    data_dir.mkdir(parents=True)
    open_sqlite_stores(data_dir).close()  # the schema exists before the race, as after any first start
    procs = [ctx.Process(target=_bootstrap, args=(str(data_dir), explicit, barrier, out))
             for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    return results


@pytest.mark.parametrize("explicit", [False, True], ids=["generated", "operator-given"])
def test_roles_starting_together_agree_on_working_tokens(tmp_path: Path, explicit: bool) -> None:
    results = _race(tmp_path / "data", explicit)
    assert not [r for r in results if "error" in r], results
    assert len({json.dumps(r, sort_keys=True) for r in results}) == 1  # every role holds the same tokens
    saved: Dict[str, str] = json.loads((tmp_path / "data" / TOKENS_FILE).read_text())
    assert saved == results[0]
    if explicit:
        assert (saved["ingest"], saved["read"]) == (OPERATOR_INGEST, OPERATOR_READ)
    stores = open_sqlite_stores(tmp_path / "data")
    try:
        ingest: Optional[Any] = stores.projects.authenticate(saved["ingest"])
        read: Optional[Any] = stores.projects.authenticate(saved["read"])
        assert ingest is not None and read is not None
        assert (ingest.kind, read.kind) == ("ingest", "read")
        # one bootstrap token per kind, not one per process that raced
        assert len([t for t in stores.projects.list_tokens(saved["project"])
                    if t.description == "bootstrap"]) == 2
    finally:
        stores.close()
