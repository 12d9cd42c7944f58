"""Fixtures of the storage suites: a real Elasticsearch API (noida-db) and a real PostgreSQL server for the
session."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from tests.support.elasticsearch import NoidaElasticsearch
from tests.support.postgres import PostgresServer


@pytest.fixture(scope="session")
def elasticsearch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NoidaElasticsearch]:
    """One noida-db Elasticsearch endpoint on a free 127.0.0.1 port for the session; each test's store
    uses its own index prefix (and deletes its indices and template afterwards)."""
    server = NoidaElasticsearch(tmp_path_factory.mktemp("noida-es")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One throwaway PostgreSQL cluster (Debian's initdb + postgres) on a free 127.0.0.1 port for the
    session, with a database ``trainguard``; each test's stores use a schema of their own."""
    server = PostgresServer().start()
    server.create_database("trainguard")
    yield server
    server.stop()


def postgres_dsn(request: pytest.FixtureRequest) -> str:
    """The session server's DSN (starting it on first use: only the PostgreSQL cases pay for it)."""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.dsn("trainguard")


def fresh_schema() -> str:
    """A schema name no other test uses: the store creates and migrates it at open."""
    return "t_" + uuid.uuid4().hex[:16]
