"""Open the stores ``Settings`` select: SQLite under the data directory by default; raw context on
Elasticsearch (``TRAINGUARD_EVENT_STORE=elasticsearch``) and metrics on ClickHouse
(``TRAINGUARD_METRIC_STORE=clickhouse``) for the scale-out deployment. Runs, incidents, clusters, workflow,
baselines, the processor's state and projects/tokens (small, transactional: DESIGN §2) are in SQLite, or in
PostgreSQL shared by every process (``TRAINGUARD_STATE_STORE=postgres``, docs/postgresql.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..config import Settings
from .base import EventStore, IncidentStore, MetricStore, ProjectStore
from .sqlite import (
    EVENTS_DB,
    INCIDENTS_DB,
    METRICS_DB,
    PROJECTS_DB,
    SqliteEventStore,
    SqliteIncidentStore,
    SqliteMetricStore,
    SqliteProjectStore,
)


@dataclass
class Stores:
    """The four store families a server uses."""

    events: EventStore
    metrics: MetricStore
    incidents: IncidentStore
    projects: ProjectStore

    def close(self) -> None:
        for store in (self.events, self.metrics, self.incidents, self.projects):
            store.close()


def open_event_store(settings: Settings, data_dir: Path) -> EventStore:
    """The raw-context store ``settings.event_store`` names."""
    if settings.event_store == "elasticsearch":
        from .elasticsearch import ElasticsearchEventStore  # the optional extra "elasticsearch"

        basic_auth: Optional[Tuple[str, str]] = None
        if settings.elasticsearch_username:
            basic_auth = (settings.elasticsearch_username, settings.elasticsearch_password or "")
        return ElasticsearchEventStore(
            hosts=[h.strip() for h in settings.elasticsearch_hosts.split(",") if h.strip()],
            api_key=settings.elasticsearch_api_key, basic_auth=basic_auth,
            verify_certs=settings.elasticsearch_verify_certs, ca_certs=settings.elasticsearch_ca_certs,
            index_prefix=settings.elasticsearch_index_prefix, shards=settings.elasticsearch_shards,
            replicas=settings.elasticsearch_replicas,
            retention_days=settings.elasticsearch_retention_days or None,
            manage_template=settings.elasticsearch_manage_template)
    return SqliteEventStore(data_dir / EVENTS_DB, sync_at_checkpoint=settings.sqlite_sync_at_checkpoint)


def open_metric_store(settings: Settings, data_dir: Path) -> MetricStore:
    """The metric store ``settings.metric_store`` names."""
    if settings.metric_store == "clickhouse":
        from .clickhouse import ClickHouseMetricStore  # the optional extra "clickhouse"

        options: Dict[str, Any] = {"database": settings.clickhouse_database,
                                   "retention_days": settings.clickhouse_retention_days}
        if settings.clickhouse_url:
            return ClickHouseMetricStore.open(dsn=settings.clickhouse_url, **options)
        return ClickHouseMetricStore.open(host=settings.clickhouse_host, port=settings.clickhouse_port,
                                          username=settings.clickhouse_user,
                                          password=settings.clickhouse_password,
                                          secure=settings.clickhouse_secure, **options)
    return SqliteMetricStore(data_dir / METRICS_DB, sync_at_checkpoint=settings.sqlite_sync_at_checkpoint)


def open_state_stores(settings: Settings, data_dir: Path) -> Tuple[IncidentStore, ProjectStore]:
    """The transactional stores ``settings.state_store`` names: (incidents, projects)."""
    if settings.state_store == "postgres":
        from .postgres import open_postgres_stores  # the optional extra "postgres"

        pg = open_postgres_stores(settings.postgres_dsn, schema=settings.postgres_schema,
                                  pool_size=settings.postgres_pool_size)
        return pg.incidents, pg.projects
    deferral = settings.sqlite_sync_at_checkpoint
    return (SqliteIncidentStore(data_dir / INCIDENTS_DB, sync_at_checkpoint=deferral),
            SqliteProjectStore(data_dir / PROJECTS_DB))


def open_stores(settings: Settings, data_dir: Path) -> Stores:
    """Every store of a server (created if needed)."""
    events = open_event_store(settings, data_dir)
    try:
        metrics = open_metric_store(settings, data_dir)
    except BaseException:
        events.close()
        raise
    try:
        incidents, projects = open_state_stores(settings, data_dir)
    except BaseException:
        events.close()
        metrics.close()
        raise
    return Stores(events=events, metrics=metrics, incidents=incidents, projects=projects)
