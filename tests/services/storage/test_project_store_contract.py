"""ProjectStore contract, written once against the ABC and run against every implementation.

Adding an implementation is one line in IMPLEMENTATIONS (factory: tmp_path, pytest request → empty store).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import pytest

from tests.services.storage.conftest import fresh_schema, postgres_dsn
from trainguard_server.storage.base import ProjectStore
from trainguard_server.storage.memory import MemoryProjectStore
from trainguard_server.storage.postgres import PostgresProjectStore
from trainguard_server.storage.sqlite import SqliteProjectStore

Factory = Callable[[Path, pytest.FixtureRequest], ProjectStore]
IMPLEMENTATIONS: Dict[str, Factory] = {
    "memory": lambda tmp_path, request: MemoryProjectStore(),
    "postgres": lambda tmp_path, request: PostgresProjectStore(postgres_dsn(request), schema=fresh_schema()),
    "sqlite": lambda tmp_path, request: SqliteProjectStore(tmp_path / "projects.db"),
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProjectStore]:
    impl = IMPLEMENTATIONS[request.param](tmp_path, request)
    yield impl
    impl.close()


def test_created_tokens_authenticate_with_their_project_and_kind(store: ProjectStore) -> None:
    ingest = store.create_token("alpha", "ingest", "training cluster")
    read = store.create_token("alpha", "read")
    assert ingest.startswith("tg_ingest_") and read.startswith("tg_read_") and ingest != read
    info = store.authenticate(ingest)
    assert info is not None
    assert (info.project, info.kind, info.description, info.revoked) == ("alpha", "ingest", "training cluster", False)
    assert info.token_id in ingest and info.created_ns > 0
    read_info = store.authenticate(read)
    assert read_info is not None and read_info.kind == "read"


def test_wrong_malformed_or_tampered_tokens_do_not_authenticate(store: ProjectStore) -> None:
    token = store.create_token("alpha", "ingest")
    prefix, secret = token[: -48], token[-48:]
    flipped = secret[:-1] + ("0" if secret[-1] != "0" else "1")
    for bad in [prefix + flipped, token.replace("tg_ingest_", "tg_read_"), token + "0", token[:-1], "",
                "tg_ingest_", "Bearer " + token, token.upper(), "tg_ingest_" + "0" * 16 + "_" + "0" * 48,
                "x" * 10_000, "tg_ingest_\x00"]:
        assert store.authenticate(bad) is None, bad
    assert store.authenticate(token) is not None


def test_revoked_tokens_stop_authenticating(store: ProjectStore) -> None:
    token = store.create_token("alpha", "read")
    other = store.create_token("alpha", "read")
    info = store.authenticate(token)
    assert info is not None
    assert store.revoke(info.token_id) is True
    assert store.authenticate(token) is None
    assert store.authenticate(other) is not None
    assert store.revoke(info.token_id) is True  # idempotent: the token exists and is revoked
    assert store.revoke("no-such-token") is False
    (listed,) = [t for t in store.list_tokens("alpha") if t.token_id == info.token_id]
    assert listed.revoked is True


def test_list_tokens_by_project_never_shows_secrets(store: ProjectStore) -> None:
    tokens = {store.create_token("alpha", "ingest"), store.create_token("beta", "read"),
              store.create_token("alpha", "read")}
    alpha = store.list_tokens("alpha")
    assert [t.kind for t in alpha] == ["ingest", "read"]  # creation order
    assert {t.project for t in alpha} == {"alpha"}
    assert [t.project for t in store.list_tokens("beta")] == ["beta"]
    assert len(store.list_tokens()) == 3 and store.list_tokens("gamma") == []
    shown = repr(store.list_tokens())
    for token in tokens:
        assert token[-48:] not in shown


@pytest.mark.parametrize("kind", ["admin", "", "INGEST"])
def test_unknown_token_kinds_are_value_errors(store: ProjectStore, kind: str) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.create_token("alpha", kind)


def test_empty_project_name_is_a_value_error(store: ProjectStore) -> None:
    with pytest.raises(ValueError, match="project"):
        store.create_token("", "ingest")


def test_operator_chosen_tokens_can_be_registered(store: ProjectStore) -> None:
    text = "tg_ingest_" + "ab" * 8 + "_" + "cd" * 24
    info = store.add_token("default", "ingest", text, "bootstrap")
    assert (info.project, info.kind, info.description, info.revoked) == ("default", "ingest", "bootstrap", False)
    assert info.token_id == "ab" * 8 and info.created_ns > 0
    authenticated = store.authenticate(text)
    assert authenticated is not None and authenticated.project == "default"
    assert [t.token_id for t in store.list_tokens("default")] == [info.token_id]
    assert store.authenticate("tg_ingest_" + "ab" * 8 + "_" + "ef" * 24) is None  # same id, other secret


@pytest.mark.parametrize("kind, text, message", [
    ("ingest", "tg_ingest_" + "ab" * 8 + "_" + "cd" * 24, "already exists"),
    ("ingest", "tg_ingest_" + "ab" * 8 + "_" + "ef" * 24, "already exists"),  # the id is taken
    ("read", "tg_ingest_" + "12" * 8 + "_" + "cd" * 24, "not a read token"),
    ("ingest", "dev-token", "must look like"),
    ("ingest", "tg_ingest_" + "AB" * 8 + "_" + "cd" * 24, "must look like"),
    ("ingest", "tg_ingest_" + "ab" * 7 + "_" + "cd" * 24, "must look like"),
    ("admin", "tg_admin_" + "ab" * 8 + "_" + "cd" * 24, "kind"),
])
def test_bad_or_existing_operator_tokens_are_value_errors(store: ProjectStore, kind: str, text: str,
                                                          message: str) -> None:
    store.add_token("default", "ingest", "tg_ingest_" + "ab" * 8 + "_" + "cd" * 24)
    with pytest.raises(ValueError, match=message):
        store.add_token("default", kind, text)


def test_a_revoked_operator_token_cannot_be_registered_again(store: ProjectStore) -> None:
    text = "tg_read_" + "0f" * 8 + "_" + "cd" * 24
    info = store.add_token("default", "read", text)
    store.revoke(info.token_id)
    with pytest.raises(ValueError, match="already exists"):
        store.add_token("default", "read", text)
    assert store.authenticate(text) is None


def test_concurrent_authentication_and_creation(store: ProjectStore) -> None:
    tokens = [store.create_token("alpha", "ingest") for _ in range(5)]
    failures: List[str] = []

    def worker(n: int) -> None:
        for _ in range(50):
            for token in tokens:
                if store.authenticate(token) is None:
                    failures.append(token)
            store.create_token(f"p{n}", "read")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(store.list_tokens()) == 5 + 4 * 50


def test_tokens_expire_and_say_so(store: ProjectStore) -> None:
    now = time.time_ns()
    past = store.create_token("alpha", "read", "ci", expires_ns=now - 10**9)
    future = store.create_token("alpha", "read", "laptop", expires_ns=now + 3600 * 10**9)
    forever = store.create_token("alpha", "ingest")
    assert store.authenticate(past) is None
    info = store.lookup(past)
    assert info is not None and info.expired() and store.expired_at(past) == now - 10**9
    ok = store.authenticate(future)
    assert ok is not None and not ok.expired() and store.expired_at(future) == 0
    assert store.authenticate(forever) is not None and store.lookup(forever).expires_ns == 0  # type: ignore[union-attr]
    store.revoke(store.lookup(past).token_id)  # type: ignore[union-attr]
    assert store.expired_at(past) == 0  # revoked says "revoked", not "expired"
    assert store.expired_at("tg_read_nonsense") == 0
    listed = {i.description: i for i in store.list_tokens("alpha")}
    assert listed["laptop"].expires_ns == now + 3600 * 10**9


def test_a_tokens_table_from_before_expiry_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "projects.db"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE projects (name TEXT PRIMARY KEY, created_ns INTEGER NOT NULL) WITHOUT ROWID;
        CREATE TABLE tokens (token_id TEXT PRIMARY KEY, project TEXT NOT NULL, kind TEXT NOT NULL,
            secret_sha256 TEXT NOT NULL, created_ns INTEGER NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
            description TEXT NOT NULL DEFAULT '') WITHOUT ROWID;
        PRAGMA user_version = 1;""")
    conn.close()
    store = SqliteProjectStore(path)
    try:
        token = store.create_token("alpha", "read")
        info = store.authenticate(token)
        assert info is not None and info.expires_ns == 0
    finally:
        store.close()
