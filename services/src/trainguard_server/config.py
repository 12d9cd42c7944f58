"""Server settings: one pydantic-settings object, every field overridable as ``TRAINGUARD_<NAME>`` or a CLI
flag. Defaults run the embedded backend under ``./.data/trainguard``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional, Tuple

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ROLES = ("gateway", "processor", "api")


def parse_roles(text: str) -> Tuple[str, ...]:
    """The roles of a ``roles`` setting, in canonical order; ValueError naming an unknown one."""
    wanted = [r.strip() for r in text.split(",") if r.strip()]
    unknown = sorted(set(wanted) - set(ROLES))
    if unknown or not wanted:
        raise ValueError(f"roles must be a comma list of {', '.join(ROLES)}; got {text!r}")
    return tuple(r for r in ROLES if r in wanted)


AUTO_WORKERS_SPARE_CORES = 2
"""``processor_workers=-1`` (auto, the default) leaves this many of the machine's cores to the processor
process (queue, stores, snapshots) and the gateway: ``cores - 2`` workers, at most :data:`AUTO_WORKERS_MAX`,
at least :data:`AUTO_WORKERS_MIN` from 2 cores on, none on one core."""
AUTO_WORKERS_MIN = 2
"""The fewest workers auto picks on a machine of 2 cores or more. Measured on a 2-core VM
(bench/results/processor_pool_stop46.txt, latency_issue15_stop49.txt): 2 workers drain ~1.5x the events per
second of the in-thread pipeline, and in ``serve`` beat it on every figure -- gRPC ingest +10-16 %, processor
alone +47 %, event -> incident p99 lower; 1 worker gains ~1.1x (its pipeline overlaps only the processor's own
part of the same chunk)."""
AUTO_WORKERS_MAX = 16
"""The most workers auto picks: the embedded queue's automatic partition count (queue.AUTO_PARTITIONS), one
partition per worker at most."""


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> Tuple[Path, ...]:
    """The CPU controller's directories of this process's cgroup, from its own up to ``root`` (v2: the
    unified hierarchy; v1: the ``cpu`` one); just ``root`` (or ``root/cpu``) when /proc/self/cgroup says
    nothing usable -- a container's own namespace shows its cgroup as the root."""
    v2 = (root / "cpu.max").is_file() or not (root / "cpu").is_dir()
    base = root if v2 else root / "cpu"
    rel = ""
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (v2 and controllers == "") or (not v2 and "cpu" in controllers.split(",")):
                rel = path.strip("/")
                break
    except (OSError, ValueError):
        rel = ""
    here = base / rel if rel and ".." not in rel.split("/") else base
    dirs = [here]
    while here != base:
        here = here.parent
        dirs.append(here)
    return tuple(dirs)


def _quota_cores(directory: Path) -> Optional[int]:
    """The cores the CPU quota set on ``directory`` allows, rounded up; None without one or unreadable."""
    try:
        v2 = directory / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1") or not period:
            return None
        q, p = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return max(1, -(-q // p)) if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Optional[int]:
    """The cores this process's CPU quota allows -- a container's ``--cpus``, a pod's CPU limit, a systemd
    unit's CPUQuota: the lowest quota on its cgroup or any above it (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), rounded UP (1.5 CPUs count as 2: the workers then
    share them with the processor and the gateway); None without a quota or where none can be read."""
    limits = [c for c in map(_quota_cores, _cgroup_dirs(root, proc_cgroup)) if c is not None]
    return min(limits) if limits else None


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity (else os.cpu_count()), at most its cgroup's quota."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return min(cores, limit) if limit is not None else cores


def auto_workers(cores: Optional[int] = None) -> int:
    """The worker count ``processor_workers=-1`` stands for on a machine with ``cores`` usable cores (None:
    :func:`usable_cores` -- the CPU affinity, capped by a container's CPU quota)."""
    if cores is None:
        cores = usable_cores()
    if cores < 2:
        return 0
    return max(AUTO_WORKERS_MIN, min(AUTO_WORKERS_MAX, cores - AUTO_WORKERS_SPARE_CORES))


class Settings(BaseSettings):
    """Everything ``trainguard serve`` can be told."""

    model_config = SettingsConfigDict(env_prefix="TRAINGUARD_", extra="ignore")

    data_dir: Path = Field(Path(".data/trainguard"), description="where the embedded stores live")
    host: str = Field("127.0.0.1", description="interface to bind (0.0.0.0 to expose)")
    http_port: int = Field(4318, description="HTTP ingest + query API + dashboard")
    grpc_port: int = Field(4317, description="gRPC ingest")
    http_header_timeout_s: float = Field(
        10.0, gt=0, description="an HTTP connection must complete its request head within this many seconds "
        "of opening (or of the head's first byte): 408 and close otherwise, however slowly bytes trickle")
    http_body_timeout_s: float = Field(
        30.0, gt=0, description="an HTTP request body that stops arriving for this long is answered 408 and "
        "the connection closed")
    http_keep_alive_s: float = Field(5.0, gt=0, description="an idle HTTP connection between requests is "
                                     "closed after this many seconds")

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
    project_new_runs_per_s: float = Field(
        50.0, ge=0, description="new runs one project may start per second at one gateway process (a token "
        "bucket; 0: no limit); a request that would start more is refused with 429 and Retry-After before "
        "anything of it is queued, so a tenant flooding the server with tiny runs cannot take the processor "
        "from the others. Runs already sending are never limited")
    project_new_runs_burst: int = Field(
        1000, ge=1, description="the bucket's size: new runs a project may start at once (a sweep launching "
        "hundreds of jobs together)")
    project_known_runs: int = Field(
        50_000, ge=1, description="run ids per project a gateway process remembers as already started "
        "(least recently seen forgotten first; a forgotten run seen again costs one new-run token)")
    project_max_backlog_events: int = Field(
        100_000, ge=0, description="events of one project that may wait in the queue for the processor "
        "of the same process, a metric batch counting one per point (0: no limit); a request that would add "
        "to a project already at this is refused with 429 and Retry-After before anything of it is queued, "
        "so a tenant sending faster than "
        "the processor works delays the other projects' incidents by about this many points' processing "
        "(~2-3 s on one core) instead of its whole backlog, and can never fill max_queue_depth (50,000 "
        "records of at least one event) for them. A project with nothing waiting is always admitted. "
        "Bursts above it from one project are retried by the SDK (it spools meanwhile). Counted only where "
        "the gateway, the processor and the embedded queue share a process (serve's defaults)")
    run_max_metric_names: int = Field(
        5_000, ge=0, description="distinct metric names one run may have (each is a series per rank, a row "
        "of its summary and detector state); an envelope that would add names past it is rejected alone "
        "(code too_many_metric_names, naming the run and the count) and the rest of the request is queued; "
        "envelopes of names the run already has are always accepted. 0: no limit. Counted per gateway "
        "process, starting from the names the metric store already holds for the run")
    metric_names_memory_bytes: int = Field(
        32 * 2**20, ge=1, description="memory a gateway process may use to remember runs' metric names for "
        "run_max_metric_names (each name: its length + 80 bytes); the least recently active runs are "
        "forgotten first and read again from the metric store when they come back")
    max_metric_name_length: int = Field(
        1024, ge=0, description="longest metric name, in characters: a metric batch with a longer one is "
        "rejected alone (too_large, naming the point); 0: only max_string_length applies")
    ingest_max_inflight_bytes: int = Field(
        64 * 2**20, ge=0, description="bytes of ingest requests this process may hold at once (HTTP bodies "
        "being read or decoded, a gzip body at its inflated size; gRPC messages waiting for a worker or "
        "being decoded; decoding takes about six times a body's size); a request past it is answered 429 "
        "with Retry-After (before its body is read when its Content-Length says so) or RESOURCE_EXHAUSTED, "
        "so clients sending big batches together cannot take the server's memory. A request is never "
        "refused while nothing is held, nor while its project holds nothing else or stays within its fair "
        "share (this bound over the projects holding bytes), so no tenant can starve another. 0: no bound "
        "(gateway/inflight.py)")
    project_max_inflight_bytes: int = Field(
        32 * 2**20, ge=0, description="the same bound for the requests of one project: one tenant's big "
        "batches are answered 429 while the others' are admitted; a project holding nothing is never refused "
        "by it. 0: no bound")
    project_max_baselines: int = Field(
        1000, ge=0, description="gate baselines one project may hold (PUT /api/v1/baselines/{name}); "
        "defining one more is answered 409 naming this setting -- redefine one or delete one (DELETE "
        "/api/v1/baselines/{name}) first; redefining an existing name is always allowed. Each is stored "
        "with its profile (2-6 KB), so a read token could otherwise fill the incident store without bound "
        "(docs/security.md). Concurrent definitions may pass it by how many run at once. 0: no bound")
    project_max_http_bodies: int = Field(
        256, ge=0, description="HTTP ingest bodies of one project being read at once: one more is "
        "answered 429 with Retry-After and Connection: close before its body is read, so one tenant's slow "
        "uploads (each may trickle a byte just inside http_body_timeout_s for as long as it likes) hold at "
        "most this many connections, not the server's descriptors: 1,100 such bodies took a server with "
        "1,024 open files to 500s on every new connection's token check (docs/security.md H43; "
        "gateway/body_count.py). 0: no bound")
    http_body_pressure_timeout_s: float = Field(
        5.0, gt=0, description="while the ingest bytes in flight leave no room under "
        "ingest_max_inflight_bytes for one more max_batch_bytes body, an HTTP ingest body holding bytes "
        "that sends no byte for this long is answered 408 (Connection: close) and its bytes given back, "
        "instead of holding them for http_body_timeout_s (stalled uploads no longer keep the server's memory "
        "while others wait for it)")
    max_gzip_members: int = Field(
        16, ge=1, description="most gzip members in one gzip-encoded HTTP ingest body (the SDK sends one); "
        "more is refused with 400 before inflating them, so concatenated empty members cannot burn CPU")
    max_frames: int = Field(512, description="most stack frames in one exception")
    max_string_length: int = Field(65_536, description="longest string field (tracebacks included)")
    max_id_length: int = Field(128, description="longest id field (event_id, run_id, project, ...)")
    max_future_skew_s: float = Field(300.0, description="events further in the future are rejected")
    max_past_age_s: float = Field(30 * 86400.0, description="events older than this are rejected")
    clock_skew_correct_s: float = Field(
        30.0, ge=0, description="a request whose x-trainguard-sent-at (its sender's clock when sent) is at "
        "least this many seconds off the gateway's clock has its event times shifted by the difference "
        "before validation (a host clock that is wrong, from its first batch; gateway/sent_at.py); 0: never")
    max_queue_depth: int = Field(50_000, description="unprocessed batches before ingest answers 429")
    queue_lanes: int = Field(
        65_536, ge=1, description="the embedded queue's (SQLite) lanes: a run's records go to the lane its "
        "id hashes to, each lane in order, the lanes holding records served in turn, one record each -- so "
        "one run's backlog does not delay another run's alert beyond one processing chunk, unless both "
        "hash to one lane (1 in queue_lanes). May change between starts while the queue has one partition; "
        "fixed with queue_partitions above 1 (queue/sqlite.py)")
    queue_partitions: int = Field(
        0, ge=0, le=1024, description="partitions of the embedded queue (SQLite): a run's records go to "
        "partition (its lane modulo queue_partitions) and the processor keeps one detection state per "
        "partition, so partitions can be processed in parallel (processor_workers). 0: auto -- 1 (one "
        "state, as before) without processor_workers, else 16. Fixed when the queue file first holds a "
        "count above 1 (like a Kafka topic's partitions): a later different value is ignored with a "
        "warning (queue/sqlite.py)")
    min_free_disk_bytes: int = Field(
        128 * 2**20, ge=0, description="/readyz answers 503 (disk nearly full) when the file system of "
        "data_dir has less free space than this, or refuses a 64 KiB test write (0: neither is checked)")
    retry_after_s: float = Field(1.0, description="Retry-After sent with 429 / RESOURCE_EXHAUSTED")
    # gRPC fairness (gateway/grpc.py): idle streams hold no thread and cannot starve other clients
    grpc_workers: int = Field(8, ge=1, description="threads running gRPC ingest's blocking work (validation, "
                              "queue publish), a message at a time; a call waiting for its client holds none")
    grpc_workers_per_project: int = Field(
        4, ge=0, description="gRPC ingest work (validation, queueing) one project may run on the "
        "grpc_workers threads at once; the projects with work take turns, so one project's many calls "
        "delay another's by about one job; 0: no bound (docs/security.md H34)")
    grpc_max_connections: int = Field(
        0, ge=0, description="gRPC connections the server accepts at once; past it a new connection is "
        "closed at once. 0: half this process's open-files limit, so idle gRPC connections (no token "
        "needed) cannot take the descriptors HTTP, the stores and the queue need (docs/security.md H38)")
    memory_trim_interval_s: float = Field(
        30.0, ge=0, description="every this many seconds trainguard serve gives freed heap memory back to "
        "the operating system (glibc malloc_trim) when its resident memory grew by memory_trim_min_growth_mb "
        "since the last give-back: a burst (an HTTP/2 header or SETTINGS flood on the gRPC port, a batch of "
        "big bodies) otherwise leaves the process at its peak for the rest of its life (docs/security.md "
        "H42). A give-back takes ~0.1-0.2 s with the allocator locked. 0: never")
    memory_trim_min_growth_mb: int = Field(
        64, ge=1, description="see memory_trim_interval_s: the growth of resident memory (MB) since the last "
        "give-back that makes the next one worth its pause")
    grpc_max_streams_per_connection: int = Field(
        100, ge=1, description="concurrent gRPC calls one connection may have open (HTTP/2 "
        "MAX_CONCURRENT_STREAMS; the client queues more)")
    grpc_max_streams_per_token: int = Field(
        16, ge=1, description="open IngestService/Stream calls per ingest token; one more is refused with "
        "RESOURCE_EXHAUSTED and retry-after")
    grpc_stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="a gRPC Stream that receives no message for this long ends with "
        "DEADLINE_EXCEEDED (what it sent before stays queued); so does a Send whose message does not arrive "
        "within it")
    grpc_max_waiting_per_project: int = Field(
        256, ge=0, description="gRPC calls of one project waiting for room under the bounds on ingest "
        "bytes in flight (a Send before its message is read, a Stream before its next); one more is "
        "refused at once with RESOURCE_EXHAUSTED + retry-after: each waiting call's HTTP/2 stream holds up "
        "to 64 KiB the server has received (100 connections x 100 Sends of one token held 197 MiB "
        "outside every bound); 0: no bound (docs/security.md H37)")
    grpc_receive_wait_s: float = Field(
        5.0, gt=0, description="a gRPC Send reserves max_batch_bytes under ingest_max_inflight_bytes / "
        "project_max_inflight_bytes before its message is read (gRPC's core would otherwise hold the whole "
        "message before it is counted); one finding no room waits this long, its message unread, then is "
        "answered RESOURCE_EXHAUSTED with retry-after (docs/security.md H34)")

    # --- query API ------------------------------------------------------------------------------
    api_stream_auth_recheck_s: float = Field(
        5.0, gt=0, description="how often a live run stream (server-sent events) re-checks its read token: a "
        "revoked token's stream ends with an error event within this time, an expired one's when it expires")
    api_max_streams: int = Field(
        100, ge=1, description="live run streams open at once in the API (each reads the stores every "
        "interval); one more is answered 503 with Retry-After")
    api_max_streams_per_token: int = Field(10, ge=1, description="live run streams open at once per read "
                                           "token; one more is answered 429")
    api_stream_min_interval_s: float = Field(
        1.0, gt=0, description="a live run stream checks for changes at most this often (a smaller "
        "?interval= is raised to it)")
    api_max_requests_per_project: int = Field(
        8, ge=0, description="query-API requests one project (its read tokens together) may have in flight "
        "at once, a run's live streams aside (they have their own bounds); more wait for one of its slots "
        "on the event loop, holding no thread, at most api_request_wait_s, then get 429 with Retry-After. "
        "One project's readers then cannot starve another's of the process they share. 0: no limit")
    api_request_wait_s: float = Field(
        5.0, ge=0, description="longest a project's query-API request waits for one of its "
        "api_max_requests_per_project slots before its 429")
    api_answer_write_timeout_s: float = Field(
        30.0, gt=0, description="longest one 64 KiB piece of a query-API answer may wait for its client to "
        "read the one before (the request holds one of its project's api_max_requests_per_project slots "
        "meanwhile); past it the connection is closed without the rest of the answer and the slot given "
        "back, so clients that never read cannot keep their project's slots")
    api_max_concurrent_queries: int = Field(
        4, ge=1, description="metric reads (series, summary) running at once; more wait for a slot, holding "
        "no thread, at most api_query_timeout_s, then get 503 with Retry-After")
    api_max_concurrent_queries_per_project: int = Field(
        2, ge=1, description="of those slots, the most one project's metric reads hold at once (its others "
        "wait the same way), so one project's heavy reads leave the others a slot")
    api_query_timeout_s: float = Field(
        10.0, gt=0, description="longest a metric read may run (the SQLite metric store stops it; 503) and "
        "wait for a slot")
    api_max_page_bytes: int = Field(
        8 * 2**20, ge=0, description="a page of a run's events (GET /api/v1/runs/{run}/events) or of "
        "search hits ends once its events pass this many bytes (their text and payload), with fewer than "
        "limit items and a next_cursor going on from there: events are legal up to max_event_bytes, so 500 "
        "of them made one answer of hundreds of MB. 0: pages of limit items whatever their size")
    api_max_metric_buckets: int = Field(
        50_000, ge=1, description="most buckets in one metrics answer over all its series: max_points per "
        "series is lowered to fit (the answer says the number used); more series than this is a 400")

    # --- processor ----------------------------------------------------------------------------
    processor_batch: int = Field(
        256, description="queue records taken per consume; over a one-partition queue a round of small "
        "records consumes again until it holds processor_round_events envelopes")
    processor_round_events: int = Field(8192, ge=1, description="most envelopes per pipeline call and per "
                                        "store write (a round's records are cut into such chunks)")
    processor_round_target_s: float = Field(
        0.1, ge=0, description="how long one processing chunk (one pipeline call and one write per store) "
        "should take: the processor takes only as many queue records as its recent rate processes in about "
        "this long, so a record published now waits for about one such chunk before the fair queue hands it "
        "out, not for a whole processor_round_events chunk (~2-3 s under load); 0: chunks of "
        "processor_round_events (processor/embedded.py DEFAULT_ROUND_TARGET_S)")
    processor_workers: int = Field(
        -1, ge=-1, le=256, description="worker processes that run the detection "
        "pipeline, each for its share of the queue's partitions (-1, the default: auto -- over the embedded "
        "queue the machine's cores less 2, at least 2 from 2 cores on, at most 16, none on one core, read "
        "once at start; none over Kafka, where processors scale out as a consumer group, nor with the Flink "
        "runtime; 0: the "
        "pipeline runs in the processor's own thread, over a queue of one partition unless "
        "queue_partitions says otherwise). The "
        "processor process keeps the queue, the stores, snapshots, notifications and the per-project "
        "backlog; a worker gets its partitions' records and returns their detection output "
        "(processor/pool.py). More workers help a stream of many runs; one run is one partition's work")

    @model_validator(mode="after")
    def _resolve_auto_workers(self) -> Settings:
        """-1 (auto) becomes :func:`auto_workers` for this machine over the embedded queue and runtime; 0
        over Kafka (a consumer group spreads the partitions over processes and hosts) and with Flink."""
        if self.processor_workers == -1:
            embedded = self.queue == "sqlite" and self.processor_runtime == "embedded"
            self.processor_workers = auto_workers() if embedded else 0
            self._workers_auto = True
        return self

    _workers_auto: bool = PrivateAttr(False)

    @property
    def processor_workers_auto(self) -> bool:
        """Whether ``processor_workers`` is auto's pick (the default), not a count someone asked for."""
        return self._workers_auto

    processor_pool_isolate_after: int = Field(
        2, ge=1, description="with processor_workers: after this many processing chunks failed in a row "
        "(a worker died on each), the next chunk is run one run at a time, and a run whose records end its "
        "worker is left out of detection (its events are still stored; logged) so the other runs go on "
        "(processor/pool.py ISOLATE_AFTER)")
    processor_pool_left_out_s: float = Field(
        60.0, ge=0, description="with processor_workers: a run left out of detection (its records ended the "
        "pipeline worker alone, twice, after fresh rebuilds) is given to detection again at the first "
        "successful checkpoint at least this many seconds later; while left out /readyz names it in its "
        "notes and /metrics counts it (processor/left_out.py HOLD_S)")
    processor_pool_call_timeout_s: float = Field(
        0.0, ge=0, description="with processor_workers: above 0, a pipeline-worker call whose replies take "
        "longer than this fails as a dead worker's would (the hung worker is replaced; a run that hangs it "
        "every time is left out as above); 0: no bound (a hung worker stalls every partition until stop). "
        "Use generous values: a rebuild replays up to snapshot_every_s of records in one call")
    processor_uncommitted_max_mb: int = Field(
        256, ge=1, description="the most megabytes of records the processor holds taken and not yet "
        "committed (until the next checkpoint; with processor_workers the pool keeps the same records to "
        "rebuild a dead worker); over it the processor checkpoints ahead of snapshot_every_s and, while "
        "checkpoints fail, takes no new records (the queue keeps them; the gateway's backlog bound pushes "
        "back) instead of growing without bound")
    processor_metric_write_chunks: int = Field(
        1, ge=1, description="the metric points of this many processor chunks are written to the metric "
        "store in one transaction (1, the default: one per chunk; more: a listed run may show no metrics "
        "for up to processor_metric_write_delay_s, for fewer transactions); held points are written "
        "before an output with incidents is applied, before every checkpoint's store sync (so before any "
        "queue commit), on stop, when a round finds nothing and after processor_metric_write_delay_s "
        "(processor/embedded.py METRIC_WRITE_CHUNKS)")
    processor_metric_write_delay_s: float = Field(
        0.5, ge=0, description="the longest the processor holds metric points before writing them (0: every "
        "chunk writes its own): a run's live metrics reach the query API at most about this much later")
    processor_gc_gen0_threshold: int = Field(
        50_000, ge=0, description="young-generation collection threshold in a process that runs a "
        "processor (processor/embedded.py GC_GEN0_THRESHOLD: Python's 700 made the collector walk the "
        "pipeline's long-lived state 8-15 % of a round's CPU); 0 or below the interpreter's: kept")
    processor_gc_pause: bool = Field(
        True, description="the cyclic collector rests during each processing round (EmbeddedProcessor "
        "pause_gc; garbage is collected between rounds)")
    snapshot_every_s: float = Field(5.0, description="how often the processor snapshots its state")
    tick_interval_s: float = Field(1.0, description="how often processing-time timers run")
    shutdown_timeout_s: float = Field(
        45.0, gt=0, description="SIGTERM/SIGINT: the longest the shutdown (stop listening, drain the queue "
        "through the processor, checkpoint, close) may take; when it fails or overruns, the process exits "
        "with code 1 and logs what was not committed (it stays queued and is processed at the next start). "
        "Keep it below the orchestrator's grace period (the Helm chart gives processor pods 60 s)")
    quota_log_interval_s: float = Field(
        60.0, ge=0, description="a project hitting a per-project quota (detection settings project_max_runs, "
        "project_max_clusters, project_max_incidents, project_max_state_bytes) is logged at most this often "
        "per project and quota, with the evictions since the last line; every eviction is counted on "
        "/metrics (trainguard_project_quota_evictions_total)")
    detection_overrides: str = Field(
        "", description='JSON object of DetectionSettings overrides, e.g. {"stall_min_s": 5}')
    processor_runtime: Literal["embedded", "flink"] = Field(
        "embedded", description="embedded: the processor runs the pipeline; flink: the Flink job runs it "
        "(python -m trainguard_server.processor.flink_main --kafka) and the processor stores raw context and "
        "metric points from the ingest topic and the job's results from kafka_results_topic (needs "
        "queue=kafka)")

    # --- notifications --------------------------------------------------------------------------------
    webhook_url: str = Field("", description="POST new incidents here as Slack-compatible JSON ({\"text\"}); "
                             "empty: off. De-duplicated per incident, rate-limited (notify.py)")
    webhook_min_severity: Literal["warning", "error", "critical"] = Field(
        "critical", description="the least severe incident that is notified")
    webhook_max_per_minute: int = Field(
        10, ge=1, description="messages per minute, all projects together; more are summarised. Shared "
        "fairly: the project with the fewest messages in the minute goes first, and only projects past their "
        "share are summarised (docs/security.md H51)")
    dashboard_url: str = Field("", description="public base URL of the dashboard, for links in notifications")

    roles: str = Field(
        "gateway,processor,api", description="what this process runs: any of gateway (gRPC + HTTP ingest), "
        "processor (queue -> pipeline -> stores) and api (query API); `trainguard serve` runs all three, "
        "`trainguard gateway|processor|api` one each (they share the queue -- Kafka -- and the stores)")
    # --- store backends -----------------------------------------------------------------------------
    sqlite_sync_at_checkpoint: bool = Field(
        True, description="SQLite stores: the processor's per-round writes commit at synchronous=NORMAL and "
        "every store is synced once per checkpoint, before the queue offsets are committed (durable before "
        "what covers them is: docs/reliability.md 'Durability of the embedded stores'); false: every commit "
        "fsynced (synchronous=FULL), as before")
    event_store: Literal["sqlite", "elasticsearch"] = Field(
        "sqlite", description="raw context (tracebacks, logs, envelopes): sqlite under data_dir (FTS5), or "
                              "Elasticsearch")
    elasticsearch_hosts: str = Field("http://127.0.0.1:9200",
                                     description="comma-separated Elasticsearch URLs")
    elasticsearch_api_key: Optional[str] = Field(None, description="API key (instead of username/password)")
    elasticsearch_username: Optional[str] = Field(None, description="basic auth user")
    elasticsearch_password: Optional[str] = Field(None, description="basic auth password")
    elasticsearch_verify_certs: bool = Field(True, description="verify the cluster's TLS certificate")
    elasticsearch_ca_certs: Optional[str] = Field(None, description="CA bundle for the cluster's TLS")
    elasticsearch_index_prefix: str = Field("trainguard",
                                            description="indices are <prefix>-events-YYYY.MM.DD")
    elasticsearch_retention_days: int = Field(30, ge=0,
                                              description="drop daily indices older than this (0: keep)")
    elasticsearch_shards: int = Field(1, ge=1, description="primary shards of new daily indices")
    elasticsearch_replicas: int = Field(1, ge=0, description="replicas of new daily indices")
    elasticsearch_manage_template: bool = Field(
        True, description="put the index template at first write (false: an operator manages it)")
    metric_store: Literal["sqlite", "clickhouse"] = Field(
        "sqlite", description="metrics and aggregates: sqlite under data_dir, or ClickHouse")
    clickhouse_url: str = Field(
        "", description="http[s]://user:password@host:port of a ClickHouse server, or chdb:///dir for the "
                        "in-process engine (one process per directory); empty: host/port/user/password")
    clickhouse_host: str = Field("127.0.0.1", description="ClickHouse host (when clickhouse_url is empty)")
    clickhouse_port: Optional[int] = Field(None, description="ClickHouse HTTP(S) port (default 8123 / 8443)")
    clickhouse_user: str = Field("default", description="ClickHouse user")
    clickhouse_password: str = Field("", description="ClickHouse password")
    clickhouse_secure: bool = Field(False, description="HTTPS to ClickHouse")
    clickhouse_database: str = Field("trainguard", description="database of the tables (created if absent)")
    clickhouse_retention_days: int = Field(90, ge=0, description="TTL of metric points (0: keep)")
    state_store: Literal["sqlite", "postgres"] = Field(
        "sqlite", description="transactional state -- runs, incidents, clusters, incident workflow, gate "
        "baselines, the processor's state, projects and tokens: sqlite under data_dir (one node), or "
        "PostgreSQL (shared by every gateway/processor/API process; docs/postgresql.md)")
    postgres_dsn: str = Field(
        "", description="state_store=postgres: a libpq connection string or postgresql://user@host:5432/db "
                        "URL (the password may come from PGPASSWORD or ~/.pgpass instead)")
    postgres_schema: str = Field("trainguard", description="the schema of the tables (created if absent)")
    postgres_pool_size: int = Field(8, ge=1, description="connections per store family and process, at most")

    # --- queue backend ------------------------------------------------------------------------------
    queue: Literal["sqlite", "kafka"] = Field(
        "sqlite", description="sqlite: the embedded durable queue under data_dir; kafka: a Kafka topic")
    kafka_bootstrap_servers: str = Field("127.0.0.1:9092", description="host:port[,host:port...] of brokers")
    kafka_topic: str = Field("trainguard.ingest", description="ingest topic (created if absent)")
    kafka_dead_letter_topic: str = Field(
        "", description="where undecodable records go, with the reason in a header (default: <topic>.dlq)")
    kafka_partitions: int = Field(12, ge=1, description="partitions of the ingest topic when it is created")
    kafka_replication_factor: int = Field(
        -1, description="replication factor of created topics (-1: the broker's default.replication.factor)")
    kafka_retention_ms: int = Field(7 * 86400 * 1000, description="retention.ms of created topics")
    kafka_group_id: str = Field("trainguard-processor", description="the processors' consumer group")
    kafka_results_topic: str = Field(
        "trainguard.results", description="processor_runtime=flink: the Flink job's results (JSON upserts); "
        "one partition keeps each record's updates in order (created if absent)")
    kafka_session_timeout_ms: int = Field(10_000, description="consumer group session timeout")
    kafka_delivery_timeout_s: float = Field(
        30.0, description="longest a publish waits for the brokers' acknowledgement before failing (503)")
    kafka_create_topics: bool = Field(True, description="create the topics at start when they are absent")
    kafka_client_config: str = Field(
        "", description='JSON object of librdkafka properties for every Kafka client, e.g. '
                        '{"security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512", '
                        '"sasl.username": "tg", "sasl.password": "...", "ssl.ca.location": "/etc/ca.pem"}')
