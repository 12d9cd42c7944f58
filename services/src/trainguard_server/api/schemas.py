"""Response models (``*Public``) of the query API. Floats that may be NaN/Inf travel as the strings
"NaN"/"Infinity"/"-Infinity", as on the wire (docs/wire-format.md)."""

from __future__ import annotations

from typing import Any, Dict, Generic, List, Optional, TypeVar, Union

from pydantic import BaseModel, Field

T = TypeVar("T")
WireFloat = Union[float, str]


class PagePublic(BaseModel, Generic[T]):
    items: List[T]
    next_cursor: Optional[str] = Field(None, description="?cursor= for the next page; null at the end")


class RunPublic(BaseModel):
    project: str
    run_id: str
    run_name: str = ""
    trace_id: str = ""
    status: str = Field(description="running | finished | failed | stalled | lost")
    health: str = Field(description="healthy | warning | critical (worst open incident)")
    started_ns: int = 0
    last_event_ns: int = 0
    last_progress_ns: int = 0
    last_step: int = -1
    world_size: int = 1
    ranks: List[int] = []
    hosts: List[str] = []
    tags: Dict[str, str] = {}
    exit_codes: Dict[str, int] = {}
    open_incidents: int = 0
    step_time_s: float = 0.0


class EvidencePublic(BaseModel):
    rule: str
    description: str
    step: int = -1
    time_ns: int = 0
    rank: int = -1
    metric: str = ""
    threshold: Optional[WireFloat] = None
    value: Optional[Any] = None
    window: List[Dict[str, Any]] = []
    event_id: str = ""


class TimelineEntryPublic(BaseModel):
    time_ns: int
    step: int
    rank: int
    what: str


class IncidentPublic(BaseModel):
    incident_id: str
    project: str
    run_id: str
    category: str
    subtype: str
    severity: str
    status: str = Field(description="open | ongoing | resolved")
    title: str = ""
    summary: str = ""
    first_step: int = -1
    last_step: int = -1
    first_ns: int = 0
    last_ns: int = 0
    lead_rank: int = -1
    ranks: List[int] = []
    hosts: List[str] = []
    fingerprint: str = ""
    checks: List[str] = Field([], description="what to check first, cheapest first")
    evidence: List[EvidencePublic] = []
    timeline: List[TimelineEntryPublic] = []
    count: int = 1
    resolved_ns: int = 0
    duration_s: float = Field(0.0, description="last_ns - first_ns, seconds")
    related: Dict[str, Any] = Field({}, description="loss / grad_norm / lr / clip_rate / amp_scale / "
                                    "peak_memory_bytes / step_time_s around the incident's first step")
    trigger: Dict[str, Any] = Field({}, description="conditions at the first step: step, lr, lr_phase "
                                    "(rising | constant | decaying | zero), lr_growth, batch features")
    hypotheses: List[Dict[str, Any]] = Field([], description="ranked root-cause hypotheses: "
                                             "[{cause, confidence, why}], confidences sum to 1")
    consequences: List[str] = Field([], description="what it caused on other ranks (folded in)")
    explained_by: str = Field("", description="id of the incident this one is a consequence of")


class ClusterPublic(BaseModel):
    project: str
    fingerprint: str
    fingerprint_version: str
    exc_type: str
    message_template: str
    count: int
    first_ns: int
    last_ns: int
    runs: List[str] = []
    ranks: List[str] = []
    hosts: List[str] = []
    sample_event_id: str = ""
    sample: Dict[str, Any] = {}


class BucketPublic(BaseModel):
    step_start: int
    step_end: int
    count: int
    min: WireFloat
    max: WireFloat
    mean: WireFloat
    last: WireFloat
    nonfinite: int


class MetricSeriesPublic(BaseModel):
    run_id: str
    max_points: int
    series: Dict[str, Dict[str, List[BucketPublic]]] = Field(
        description="metric name → rank (as a string) → buckets, oldest first")


class MetricSummaryPublic(BaseModel):
    name: str
    count: int
    first_step: int
    last_step: int
    min: WireFloat
    max: WireFloat
    last: WireFloat
    nonfinite: int


class EventPublic(BaseModel):
    event_id: str
    run_id: str
    rank: int
    host: str
    kind: str
    severity: str
    step: int
    time_ns: int
    text: str
    payload: Dict[str, Any] = {}


class SearchHitPublic(BaseModel):
    event: EventPublic
    snippet: str
    score: float


class ErrorPublic(BaseModel):
    detail: str
