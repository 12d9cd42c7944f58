"""SDK options: every knob ``trainguard.init()`` accepts, with its documented default.

Each option can also come from the environment as ``TRAINGUARD_<NAME>`` (upper case); an explicit
``init()`` argument wins. Unknown options are reported once and ignored, never raised.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

from .core.events import safe_str, string_map


@dataclass
class Options:
    """All SDK options. Defaults are chosen so that the SDK costs < 1% of a training step."""

    #: Where events go: ``http(s)://host:port``, ``grpc://host:port`` (needs ``trainguard[grpc]``),
    #: ``file:///path.jsonl`` (offline). None (and no TRAINGUARD_ENDPOINT): the SDK is a no-op.
    endpoint: Optional[str] = None
    #: Project the events belong to; empty: the ingest token's project (the gateway fills it in).
    project: str = ""
    #: Ingest token, sent as ``Authorization: Bearer``.
    token: Optional[str] = None
    run_name: Optional[str] = None
    #: Base URL of the TrainGuard dashboard for the link ``init()`` prints (``http://host:4318``; the same
    #: variable, TRAINGUARD_DASHBOARD_URL, the server uses for its links). Default: the endpoint's host on
    #: HTTP port 4318.
    dashboard_url: Optional[str] = None
    #: Print one line with the run's dashboard link to stderr when ``init()`` starts reporting (rank 0 only).
    #: None (default): when stderr is a terminal, so a job's logs and crash output stay byte for byte what
    #: they are without the SDK; True: always (batch jobs' log files too); False: never.
    announce: Optional[bool] = None
    #: Free-form labels of the run (strings), sent with the start event.
    tags: Dict[str, str] = field(default_factory=dict)
    #: Hyper-parameters / config of the run, sent with the start event.
    config: Dict[str, str] = field(default_factory=dict)
    #: Override the identity read from the launcher's environment.
    run_id: Optional[str] = None
    trace_id: Optional[str] = None
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None

    # --- delivery -----------------------------------------------------------------------------
    #: Most metric events held in memory waiting for the worker; beyond it new ones are dropped (counted
    #: as ``queue_full``). With ``queue_reserve_events`` this bounds the SDK's memory whatever the backend
    #: does: a backend that hangs or is down costs at most this many queued events.
    max_queue_events: int = 10_000
    #: Extra queue room only rare events (exceptions, log records, memory snapshots, heartbeats) may use,
    #: so an exception is still kept when metrics have filled ``max_queue_events``; beyond
    #: ``max_queue_events + queue_reserve_events`` they are dropped too (counted). Lifecycle start/exit
    #: events (one each) always fit.
    queue_reserve_events: int = 100
    #: Most envelopes per request.
    max_batch_events: int = 500
    #: The worker sends at least this often (seconds) when anything is queued.
    flush_interval: float = 1.0
    #: Longest wait for a connection to the backend (TCP and TLS handshake), seconds. Beyond it the batch
    #: goes to the spool and is retried with backoff.
    connect_timeout: float = 3.0
    #: Longest the backend may stay silent while we send a request or wait for its answer, seconds: a
    #: backend that accepts a request and never answers fails over to the spool after this.
    read_timeout: float = 5.0
    #: The most one request may take in all (connect, upload, the whole answer), seconds, even against a
    #: backend that trickles its answer a byte at a time. gRPC: the call's deadline (it covers connecting).
    send_timeout: float = 10.0
    #: Retry backoff bounds (seconds); the server's Retry-After wins when it is longer.
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    #: Directory for the on-disk spool used while the backend is unreachable; "" disables spooling.
    #: Default: $TRAINGUARD_SPOOL_DIR or ~/.cache/trainguard/spool.
    spool_dir: Optional[str] = None
    #: Bound on the spool's size on disk; the oldest batches are evicted (and counted) beyond it.
    spool_max_bytes: int = 256 * 1024 * 1024
    #: Most urgent events (non-finite alerts, exceptions, the exit event) written to the spool directory
    #: *before* they are sent and not yet acknowledged (or spooled); a process killed right after one
    #: (SIGKILL, an abort, a native crash) leaves it there for the next SDK process or ``trainguard agent``
    #: to deliver. One small local write on the thread that logs the alert; 0 turns it off.
    write_ahead_max_pending: int = 64
    #: Seconds between looks for the spools of dead processes (same endpoint and project, this host), which
    #: the SDK then delivers after its own events; 0: only when it starts.
    orphan_scan_interval: float = 30.0
    #: How long ``shutdown()`` / exit may take (seconds): what cannot be delivered in this time (a backend
    #: down or hanging) is written to the spool, in flight requests included, so nothing is lost.
    shutdown_timeout: float = 5.0
    #: Most characters kept of any string (messages, tracebacks are bounded separately).
    max_string_length: int = 8_192
    max_traceback_chars: int = 64_000
    #: Most stack frames kept per exception (innermost kept).
    max_frames: int = 128

    # --- signals ------------------------------------------------------------------------------
    #: Seconds between heartbeats from the background thread (0 disables).
    heartbeat_interval: float = 15.0
    #: How many recent values per metric ride along when a non-finite value is reported at once.
    recent_metrics: int = 20
    #: Install sys.excepthook / threading.excepthook capture (the original hooks still run).
    capture_uncaught: bool = True
    #: Report a lifecycle exit event at interpreter exit and on SIGTERM.
    capture_exit: bool = True
    #: On a native crash (SIGSEGV, SIGABRT from ``os.abort()`` or a C++ ``std::terminate``, SIGBUS, SIGFPE,
    #: SIGILL) faulthandler writes the crashing thread's Python stack into the spool directory, delivered
    #: afterwards as an exception event; stderr and the exit status do not change. Not when faulthandler is
    #: already on (its output stays where you sent it) or without a disk spool.
    capture_fatal_signals: bool = True
    #: Loggers whose WARNING+ records are forwarded as log events ("" is the root logger).
    log_loggers: List[str] = field(default_factory=list)
    log_level: str = "WARNING"

    # --- torch (used by watch()) ---------------------------------------------------------------
    #: Report per-layer gradient norms every N optimizer steps (0 disables per-layer norms).
    per_layer_every: int = 50
    #: Sample CUDA memory every N optimizer steps (0 disables periodic sampling; OOM still captured).
    memory_every: int = 50
    #: ... and at least every this many seconds of training (0: by step count only), so that a run of a
    #: few hundred slow steps still gets enough samples for a leak verdict. One sample costs host-side
    #: allocator counters (no device call), so once a second is far inside the overhead goal.
    memory_interval_s: float = 1.0
    #: Module depth that defines a "layer" for per-layer norms (1 = top-level children of the model).
    layer_depth: int = 2
    #: Most of a step's time watch()'s gradient-norm pass may take; beyond it the global norm is read
    #: every few steps instead of every step (small models on CPU). 0: every step, whatever it costs.
    #: check_batch(every=None) uses the same budget to sample itself down (one batch in N, N <= 16).
    watch_overhead_budget: float = 0.005

    #: Internal: use an in-memory transport (tests). Not for users.
    debug: bool = False


def option_names() -> List[str]:
    """Every valid option name."""
    return [f.name for f in fields(Options)]


def _coerce(current: Any, raw: str) -> Any:
    """Convert an environment string to the type of the option's default."""
    if isinstance(current, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    if isinstance(current, list):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if isinstance(current, dict):
        out: Dict[str, str] = {}
        for part in raw.split(","):
            if "=" in part:
                key, value = part.split("=", 1)
                out[key.strip()] = value.strip()
        return out
    return raw


def build_options(explicit: Mapping[str, Any], env: Mapping[str, str]) -> Tuple[Options, List[str]]:
    """Options from ``init()`` keyword arguments over ``TRAINGUARD_*`` environment variables.

    Returns the options and a list of human-readable problems (unknown names, unparsable values),
    which the caller reports once. Never raises.
    """
    opts = Options()
    problems: List[str] = []
    names = set(option_names())
    for name in names:
        raw = env.get("TRAINGUARD_" + name.upper())
        if raw is None or raw == "":
            continue
        try:
            setattr(opts, name, _coerce(False if name == "announce" else getattr(opts, name), raw))
        except (TypeError, ValueError):
            problems.append(f"TRAINGUARD_{name.upper()}={raw!r} is not a valid {name}; using the default")
    for name, value in explicit.items():
        if name not in names:
            problems.append(f"unknown option {name!r} ignored")
            continue
        if value is None and name != "endpoint":
            continue
        default = getattr(Options(), name)
        if isinstance(default, dict):
            if not isinstance(value, Mapping):
                problems.append(f"option {name} must be a mapping; ignored")
                continue
            value = string_map(value)
        elif isinstance(default, list):
            value = [value] if isinstance(value, str) else [safe_str(v) for v in value]
        setattr(opts, name, value)
    if opts.endpoint is None:
        opts.endpoint = env.get("TRAINGUARD_ENDPOINT") or None
    problems.extend(misspelt_variables(env))
    for name in ("max_queue_events", "max_batch_events"):
        if getattr(opts, name) < 1:
            problems.append(f"option {name} must be >= 1; using the default")
            setattr(opts, name, getattr(Options(), name))
    for name in ("queue_reserve_events", "write_ahead_max_pending"):
        if getattr(opts, name) < 0:
            problems.append(f"option {name} must be >= 0; using the default")
            setattr(opts, name, getattr(Options(), name))
    if not opts.orphan_scan_interval >= 0:  # NaN too
        problems.append("option orphan_scan_interval must be >= 0 seconds; using the default")
        opts.orphan_scan_interval = Options().orphan_scan_interval
    for name in ("connect_timeout", "read_timeout", "send_timeout"):
        value = getattr(opts, name)
        if not (isinstance(value, (int, float)) and value > 0):  # 0 or NaN would mean "never give up"
            problems.append(f"option {name} must be a positive number of seconds; using the default")
            setattr(opts, name, getattr(Options(), name))
    return opts, problems


#: TRAINGUARD_* variables other parts of TrainGuard read (the server's settings, ``trainguard agent``):
#: never reported as misspelt SDK options. tests/sdk/test_options.py checks that no server setting is.
OTHER_VARIABLES: FrozenSet[str] = frozenset({
    "TRAINGUARD_SHUTDOWN_TIMEOUT_S", "TRAINGUARD_READ_TOKEN", "TRAINGUARD_MAX_ID_LENGTH",
    "TRAINGUARD_API_MAX_STREAMS", "TRAINGUARD_TICK_INTERVAL_S",
})
OTHER_PREFIXES: Tuple[str, ...] = (
    "TRAINGUARD_AGENT_", "TRAINGUARD_KAFKA_", "TRAINGUARD_ELASTICSEARCH_", "TRAINGUARD_CLICKHOUSE_",
    "TRAINGUARD_BOOTSTRAP_", "TRAINGUARD_WEBHOOK_", "TRAINGUARD_PROJECT_", "TRAINGUARD_FUZZ_",
    "TRAINGUARD_MEMORY_TRIM_")
#: How alike (difflib's ratio of the names after ``TRAINGUARD_``) an unknown variable must be to an option
#: to be called a typo of it.
MISSPELLING_CUTOFF = 0.8


def misspelt_variables(env: Mapping[str, str]) -> List[str]:
    """One problem per ``TRAINGUARD_*`` variable that is no SDK option but close to one (a typo such as
    ``TRAINGUARD_ENDPIONT``), naming the option meant. Variables of the server and the agent
    (:data:`OTHER_VARIABLES`, :data:`OTHER_PREFIXES`) and names like no option are left alone."""
    known = sorted(name.upper() for name in option_names())
    problems = []
    for name in sorted(env):
        if not name.startswith("TRAINGUARD_") or name in OTHER_VARIABLES or name.startswith(OTHER_PREFIXES):
            continue
        suffix = name[len("TRAINGUARD_"):]
        if suffix in known:
            continue
        close = difflib.get_close_matches(suffix, known, n=1, cutoff=MISSPELLING_CUTOFF)
        if close:
            problems.append(f"{name} is not a TrainGuard setting (ignored): did you mean "
                            f"TRAINGUARD_{close[0]}?")
    return problems


def default_spool_dir(env: Mapping[str, str] = os.environ) -> str:
    """Where the spool lives when ``spool_dir`` is not set."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trainguard", "spool")
