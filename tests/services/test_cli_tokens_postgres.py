"""``trainguard token`` under ``TRAINGUARD_STATE_STORE=postgres`` works on the shared PostgreSQL state store
(where every API and gateway pod looks tokens up), not on a SQLite file in the pod's data directory: a
token created there authenticates through another process's store, list shows it, revoke takes it away
for everyone; a missing DSN is one line, exit 2. Against a real PostgreSQL server the fixture starts."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.postgres import PostgresServer
from trainguard_server.cli import main
from trainguard_server.storage.postgres import open_postgres_stores
from trainguard_server.storage.sqlite import PROJECTS_DB


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.stop()


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_token_commands_use_the_postgres_state_store(pg: PostgresServer, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    dsn = pg.create_database("t_" + uuid.uuid4().hex[:12])
    monkeypatch.setenv("TRAINGUARD_STATE_STORE", "postgres")
    monkeypatch.setenv("TRAINGUARD_POSTGRES_DSN", dsn)
    data = tmp_path / "pod-a"  # this pod's own data directory; the tokens must not land there
    code, out, err = run(capsys, "token", "create", "--project", "alpha", "--kind", "read",
                         "--description", "ci", "--expires-in", "30d", "--data-dir", str(data))
    assert code == 0, err
    token = out.strip()
    assert token.startswith("tg_read_")
    assert not (data / PROJECTS_DB).exists()

    other_pod = open_postgres_stores(dsn)  # what another API pod reads
    try:
        info = other_pod.projects.authenticate(token)
        assert info is not None and (info.project, info.kind, info.description) == ("alpha", "read", "ci")
        assert 29.99 < (info.expires_ns - info.created_ns) / 86400e9 < 30.01
        # a token made by the other pod is listed by the command run on this one
        theirs = other_pod.projects.create_token("alpha", "ingest", "from pod b")
        code, listing, _ = run(capsys, "token", "list", "--project", "alpha",
                               "--data-dir", str(tmp_path / "pod-c"))
        rows = {row.split("\t")[0]: row.split("\t") for row in listing.splitlines()}
        assert code == 0 and len(rows) == 2
        assert rows[info.token_id][2:4] == ["read", "active"]
        theirs_info = other_pod.projects.authenticate(theirs)
        assert theirs_info is not None and rows[theirs_info.token_id][5] == "from pod b"

        code, out, _ = run(capsys, "token", "revoke", "--token-id", info.token_id, "--data-dir", str(data))
        assert code == 0 and out.strip() == f"revoked {info.token_id}"
        assert other_pod.projects.authenticate(token) is None
        assert other_pod.projects.authenticate(theirs) is not None
        code, _, err = run(capsys, "token", "list", "--project", "beta", "--data-dir", str(data))
        assert code == 0 and err.strip() == "no tokens of project 'beta' in PostgreSQL schema 'trainguard'"
    finally:
        other_pod.close()


def test_postgres_without_a_dsn_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: Any) -> None:
    monkeypatch.setenv("TRAINGUARD_STATE_STORE", "postgres")
    monkeypatch.delenv("TRAINGUARD_POSTGRES_DSN", raising=False)
    code, out, err = run(capsys, "token", "list", "--data-dir", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == ("trainguard token: TRAINGUARD_STATE_STORE=postgres needs TRAINGUARD_POSTGRES_DSN (a libpq "
                   "connection string or postgresql:// URL)\n")
