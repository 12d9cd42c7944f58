"""Fixtures of the storage suites: a real Elasticsearch API (noida-db) for the session."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.elasticsearch import NoidaElasticsearch


@pytest.fixture(scope="session")
def elasticsearch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NoidaElasticsearch]:
    """One noida-db Elasticsearch endpoint on a free 127.0.0.1 port for the session; each test's store
    uses its own index prefix (and deletes its indices and template afterwards)."""
    server = NoidaElasticsearch(tmp_path_factory.mktemp("noida-es")).start()
    yield server
    server.stop()
