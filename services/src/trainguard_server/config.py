"""Server settings: one pydantic-settings object, every field overridable as ``TRAINGUARD_<NAME>`` or a CLI
flag. Defaults run the embedded backend under ``./.data/trainguard``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything ``trainguard serve`` can be told."""

    model_config = SettingsConfigDict(env_prefix="TRAINGUARD_", extra="ignore")

    data_dir: Path = Field(Path(".data/trainguard"), description="where the embedded stores live")
    host: str = Field("127.0.0.1", description="interface to bind (0.0.0.0 to expose)")
    http_port: int = Field(4318, description="HTTP ingest + query API + dashboard")
    grpc_port: int = Field(4317, description="gRPC ingest")

    # --- auth ---------------------------------------------------------------------------------
    bootstrap_project: str = Field("default", description="project created at first start")
    bootstrap_ingest_token: Optional[str] = Field(
        None, description="ingest token for the bootstrap project (generated and printed if unset)")
    bootstrap_read_token: Optional[str] = Field(
        None, description="read token for the bootstrap project (generated and printed if unset)")

    # --- gateway limits ---------------------------------------------------------------------------
    max_batch_bytes: int = Field(8 * 2**20, description="largest request body / gRPC message")
    max_event_bytes: int = Field(1 * 2**20, description="largest single envelope")
    max_batch_events: int = Field(10_000, description="most envelopes in one request")
    max_frames: int = Field(512, description="most stack frames in one exception")
    max_string_length: int = Field(65_536, description="longest string field (tracebacks included)")
    max_id_length: int = Field(128, description="longest id field (event_id, run_id, project, ...)")
    max_future_skew_s: float = Field(300.0, description="events further in the future are rejected")
    max_past_age_s: float = Field(30 * 86400.0, description="events older than this are rejected")
    max_queue_depth: int = Field(50_000, description="unprocessed batches before ingest answers 429")
    retry_after_s: float = Field(1.0, description="Retry-After sent with 429 / RESOURCE_EXHAUSTED")

    # --- processor ----------------------------------------------------------------------------
    processor_batch: int = Field(256, description="queue records consumed per processing round")
    snapshot_every_s: float = Field(5.0, description="how often the processor snapshots its state")
    tick_interval_s: float = Field(1.0, description="how often processing-time timers run")
    detection_overrides: str = Field(
        "", description='JSON object of DetectionSettings overrides, e.g. {"stall_min_s": 5}')
