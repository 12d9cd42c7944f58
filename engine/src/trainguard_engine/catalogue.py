"""The classification catalogue, the exit-code decision path, and every detection threshold.

The catalogue is data: ``data/catalogue.toml`` in this package (its header documents every field), read
and validated once when this module is imported -- a malformed entry is a :class:`CatalogueError` naming
the entry and the field. Adding an incident kind is one ``[[kinds]]`` entry there (plus the detector or
classifier rule that opens it). What is here:

1. :data:`KINDS` -- every incident kind of DESIGN §4 (and of the seeds in ``/shared/seeds``): category,
   subtype, severity, a title template, what it means, the likely root causes (each with an id that
   :mod:`trainguard_engine.diagnosis` rules name), "what to check first", ordered **hardware → framework
   → model** (cheapest first; hardware checks rule out ~30% of cases), its roles in cross-rank
   correlation (:data:`ROLES`, :func:`kinds_with_role`) and its row of the README's table
   (:func:`readme_table`, written by ``tools/catalogue_table.py``).
2. The decision path for a process that ended (:data:`EXIT_RULES`, :func:`classify_exit`) and the
   exception-type rules (:data:`EXCEPTION_RULES`). The error-text classifier that uses them is
   :mod:`trainguard_engine.classify`; :func:`classify_exception` here is its ``(category, subtype)``.
3. :class:`DetectionSettings` -- every threshold and state bound of the pipeline with its documented
   default; :meth:`DetectionSettings.from_overrides` validates per-project overrides.

Subtype names: the DESIGN's hyphenated names (``rise-after-fall``, ``oom-or-cuda-error``), except
``loss/non_finite``, which mirrors the SDK's ``non_finite:<metric>`` alert.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields
from importlib import resources
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the engine's dependency on older interpreters
    import tomli as tomllib  # type: ignore[import-not-found,no-redef]

# ----------------------------------------------------------------------------------------------------
# Incident kinds

LAYERS = ("hardware", "framework", "model")
"""Check layers, in the order a person should go through them."""

SEVERITIES = ("info", "warning", "error", "critical")


@dataclass(frozen=True)
class Check:
    """One thing to check, in one layer (``hardware`` | ``framework`` | ``model``)."""

    layer: str
    text: str

    def render(self) -> str:
        """``"hardware: <text>"`` -- the form stored in ``Incident.checks``."""
        return f"{self.layer}: {self.text}"


@dataclass(frozen=True)
class IncidentKind:
    """One row of the catalogue.

    ``title`` is a :meth:`str.format` template; the pipeline passes ``step``, ``value``, ``detail``,
    ``rank`` and kind-specific fields (missing ones render as ``?``). A title of just ``{detail}`` (the
    kinds the error-text classifier opens) takes the producer's ``detail`` as the whole title: the
    classifier's headline, e.g. "CUDA OOM on GPU 0: tried to allocate 20.00 MiB with 3.19 MiB free of
    79.15 GiB". ``checks`` are ordered hardware → framework → model (enforced when the module is
    imported).
    """

    category: str
    subtype: str
    severity: str
    title: str
    description: str
    signals: str
    causes: Tuple[str, ...]
    checks: Tuple[Check, ...]
    detected: bool = False
    cause_ids: Tuple[str, ...] = ()          # the id of each cause, same order
    extra_causes: Tuple[Tuple[str, str], ...] = ()  # (id, text): causes only a diagnosis rule brings in
    roles: Tuple[str, ...] = ()              # cross-rank correlation roles (ROLES)
    numeric_strength: int = 0                # the numeric slot: a finding re-classifies only upwards
    row: str = ""                            # README table: kinds with one row id share a line
    fires_when: str = ""                     # README table: when it fires (on the row's first kind)
    settings: Tuple[str, ...] = ()           # README table: DetectionSettings fields whose defaults it shows

    @property
    def name(self) -> str:
        return f"{self.category}/{self.subtype}"

    def cause_text(self, cause_id: str) -> str:
        """The text of one of this kind's causes (or extra causes) by id; KeyError otherwise."""
        for cid, text in (*zip(self.cause_ids, self.causes), *self.extra_causes):
            if cid == cause_id:
                return text
        raise KeyError(f"{self.name} has no cause {cause_id!r}")

    def checklist(self) -> List[str]:
        """The checks as strings (``"framework: ..."``), cheapest layer first."""
        return [c.render() for c in self.checks]

    def render_title(self, values: Mapping[str, Any]) -> str:
        """The title with ``values`` filled in; a placeholder without a value renders as ``?``."""
        return self.title.format_map(_Defaulting(values))


class _Defaulting(dict):  # type: ignore[type-arg]
    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)

    def __missing__(self, key: str) -> str:
        return "?"


ROLES = ("cause", "consequence", "peer-failure", "comm-failure", "numeric")
"""A kind's parts in cross-rank correlation (:mod:`trainguard_engine.correlate`): ``cause`` -- it makes
the collectives of the other ranks fail; ``consequence`` -- the other ranks' view of a failure elsewhere;
``peer-failure`` -- a silent rank can explain it; ``comm-failure`` -- a communication failure;
``numeric`` -- it holds the run's numeric slot (one incident for NaN losses and exploding gradients)."""

DATA_FILE = "data/catalogue.toml"
"""The catalogue's data (kinds, shared checks, the exit decision path, exit reasons, signal names,
exception rules), inside this package; its header documents every field."""


class CatalogueError(ValueError):
    """The catalogue's data file is malformed: names the entry and the field."""


def _read_data() -> Dict[str, Any]:
    raw = resources.files("trainguard_engine").joinpath(DATA_FILE).read_bytes()
    try:
        data: Dict[str, Any] = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CatalogueError(f"{DATA_FILE}: {exc}") from None
    return data


def _table(where: str, value: Any, required: Mapping[str, Any],
           optional: Mapping[str, Any]) -> Dict[str, Any]:
    """``value`` checked to be a table with the ``required`` keys and no others than ``optional`` ones,
    each of its type (a type or a tuple of types)."""
    if not isinstance(value, dict):
        raise CatalogueError(f"{DATA_FILE}: {where}: expected a table, got {type(value).__name__}")
    for key in required:
        if key not in value:
            raise CatalogueError(f"{DATA_FILE}: {where}: missing field {key!r}")
    for key, item in value.items():
        want = required.get(key, optional.get(key))
        if want is None:
            known = ", ".join([*required, *optional])
            raise CatalogueError(f"{DATA_FILE}: {where}: unknown field {key!r} (known: {known})")
        if not isinstance(item, want) or (isinstance(item, bool) and bool not in _as_tuple(want)):
            raise CatalogueError(f"{DATA_FILE}: {where}: field {key!r} must be {_type_names(want)}, "
                                 f"got {type(item).__name__}")
    return value


def _as_tuple(want: Any) -> Tuple[type, ...]:
    return want if isinstance(want, tuple) else (want,)


def _type_names(want: Any) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(want))


def _strings(where: str, items: List[Any]) -> Tuple[str, ...]:
    if not all(isinstance(i, str) and i for i in items):
        raise CatalogueError(f"{DATA_FILE}: {where}: expected non-empty strings")
    return tuple(items)


def _split_kind(where: str, name: str) -> Tuple[str, str]:
    category, sep, subtype = name.partition("/")
    if not (sep and category and subtype):
        raise CatalogueError(f"{DATA_FILE}: {where}: kind must be 'category/subtype', got {name!r}")
    return category, subtype


def _check_of(where: str, item: Any, shared: Mapping[str, Check]) -> Check:
    if isinstance(item, str):
        if item not in shared:
            raise CatalogueError(f"{DATA_FILE}: {where}: no shared check {item!r} (known: {sorted(shared)})")
        return shared[item]
    entry = _table(where, item, {"layer": str, "text": str}, {})
    if entry["layer"] not in LAYERS:
        raise CatalogueError(f"{DATA_FILE}: {where}: layer must be one of {LAYERS}, got {entry['layer']!r}")
    return Check(entry["layer"], entry["text"])


def _causes(where: str, items: List[Any]) -> Tuple[Tuple[str, str], ...]:
    out = []
    for i, item in enumerate(items):
        entry = _table(f"{where}[{i}]", item, {"id": str, "text": str}, {})
        out.append((entry["id"], entry["text"]))
    return tuple(out)


_KIND_FIELDS = {"kind": str, "severity": str, "title": str, "description": str, "signals": str,
                "causes": list, "checks": list}
_KIND_OPTIONAL = {"extra_causes": list, "roles": list, "numeric_strength": int, "detected": bool,
                  "row": str, "fires_when": str, "settings": list}


def _load_kinds(data: Mapping[str, Any]) -> Tuple[IncidentKind, ...]:
    shared: Dict[str, Check] = {}
    raw_checks = data.get("checks", {})
    if not isinstance(raw_checks, dict):
        raise CatalogueError(f"{DATA_FILE}: checks: expected a table")
    for name, item in raw_checks.items():
        shared[name] = _check_of(f"checks.{name}", item, {})
    kinds: List[IncidentKind] = []
    for i, raw in enumerate(data.get("kinds", [])):
        where = f"kinds[{i}]"
        entry = _table(where, raw, _KIND_FIELDS, _KIND_OPTIONAL)
        where = f"kinds[{i}] ({entry['kind']})"
        category, subtype = _split_kind(where, entry["kind"])
        if entry["severity"] not in SEVERITIES:
            raise CatalogueError(f"{DATA_FILE}: {where}: severity must be one of {SEVERITIES}")
        causes = _causes(f"{where}.causes", entry["causes"])
        extra = _causes(f"{where}.extra_causes", entry.get("extra_causes", []))
        ids = [cid for cid, _t in (*causes, *extra)]
        if len(set(ids)) != len(ids):
            raise CatalogueError(f"{DATA_FILE}: {where}: cause ids repeat: {ids}")
        roles = _strings(f"{where}.roles", entry.get("roles", []))
        if not set(roles) <= set(ROLES):
            raise CatalogueError(f"{DATA_FILE}: {where}: roles must be among {ROLES}, got {roles}")
        checks = tuple(_check_of(f"{where}.checks[{j}]", c, shared) for j, c in enumerate(entry["checks"]))
        order = [LAYERS.index(c.layer) for c in checks]
        if order != sorted(order):
            raise CatalogueError(f"{DATA_FILE}: {where}: checks must be ordered hardware -> framework -> "
                                 f"model")
        kinds.append(IncidentKind(
            category, subtype, entry["severity"], entry["title"], entry["description"], entry["signals"],
            tuple(t for _c, t in causes), checks, detected=entry.get("detected", True),
            cause_ids=tuple(c for c, _t in causes), extra_causes=extra, roles=roles,
            numeric_strength=entry.get("numeric_strength", 0), row=entry.get("row", ""),
            fires_when=entry.get("fires_when", ""),
            settings=_strings(f"{where}.settings", entry.get("settings", []))))
    names = [k.name for k in kinds]
    if len(set(names)) != len(names):
        raise CatalogueError(f"{DATA_FILE}: kinds repeat: {sorted(n for n in names if names.count(n) > 1)}")
    return tuple(kinds)


_DATA = _read_data()
_KIND_LIST: Tuple[IncidentKind, ...] = _load_kinds(_DATA)

KINDS: Dict[str, IncidentKind] = {k.name: k for k in _KIND_LIST}
"""Every incident kind, keyed ``"category/subtype"``."""


def kind(category: str, subtype: str) -> IncidentKind:
    """The catalogue row for ``category/subtype``; KeyError names the known kinds."""
    try:
        return KINDS[f"{category}/{subtype}"]
    except KeyError:
        raise KeyError(f"unknown incident kind {category}/{subtype}; known: {sorted(KINDS)}") from None


def kinds_with_role(role: str) -> Tuple[Tuple[str, str], ...]:
    """``(category, subtype)`` of every kind with ``role`` (:data:`ROLES`), in catalogue order."""
    if role not in ROLES:
        raise KeyError(f"unknown role {role!r}; known: {ROLES}")
    return tuple((k.category, k.subtype) for k in _KIND_LIST if role in k.roles)

# ----------------------------------------------------------------------------------------------------
# The decision path for a process that ended

@dataclass(frozen=True)
class ExitRule:
    """Exit codes / signals that mean one incident kind. ``refine``: an exception the rank reported
    just before exiting explains the exit better (its classification wins; the exit is evidence)."""

    codes: Tuple[int, ...]
    signals: Tuple[int, ...]
    category: str
    subtype: str
    meaning: str
    refine: bool = False


def _load_signals(data: Mapping[str, Any]) -> Dict[int, str]:
    raw = data.get("signals", {})
    if not isinstance(raw, dict) or not all(isinstance(v, str) and k.isdigit() for k, v in raw.items()):
        raise CatalogueError(f"{DATA_FILE}: signals: expected a table of number = \"NAME\"")
    return {int(k): v for k, v in raw.items()}


def _ints(where: str, items: List[Any]) -> Tuple[int, ...]:
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise CatalogueError(f"{DATA_FILE}: {where}: expected integers")
    return tuple(items)


def _load_exits(data: Mapping[str, Any]) -> Tuple[ExitRule, ...]:
    out = []
    for i, raw in enumerate(data.get("exits", [])):
        where = f"exits[{i}]"
        entry = _table(where, raw, {"codes": list, "signals": list, "kind": str, "meaning": str},
                       {"refine": bool})
        category, subtype = _split_kind(where, entry["kind"])
        kind(category, subtype)  # a known kind
        out.append(ExitRule(_ints(f"{where}.codes", entry["codes"]),
                            _ints(f"{where}.signals", entry["signals"]), category, subtype, entry["meaning"],
                            entry.get("refine", False)))
    return tuple(out)


SIGNAL_NAMES: Dict[int, str] = _load_signals(_DATA)
"""Linux signal numbers (the exit code of a process killed by signal n is 128 + n)."""

EXIT_RULES: Tuple[ExitRule, ...] = _load_exits(_DATA)
"""Seed 000 §3.5, in order; a signal match wins over a code match. Anything else non-zero: process/exit."""

def _load_exit_reasons(data: Mapping[str, Any]) -> Dict[str, str]:
    raw = data.get("exit_reasons", {})
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise CatalogueError(f"{DATA_FILE}: exit_reasons: expected a table of REASON = \"meaning\"")
    return dict(raw)


EXIT_REASON_MEANINGS: Dict[str, str] = _load_exit_reasons(_DATA)
"""What an EXIT's ``reason`` says beyond its code, when the one who saw the end knew (the agent reads
Kubernetes' termination reason from the pod); it replaces the code's generic meaning."""


@dataclass(frozen=True)
class ExitVerdict:
    """What an exit means. ``signal`` is the signal that ended the process (0 if none is known)."""

    category: str
    subtype: str
    exit_code: int
    signal: int
    meaning: str
    refine: bool

    def describe(self) -> str:
        """``"exit code 137, SIGKILL"``."""
        text = f"exit code {self.exit_code}"
        if self.signal:
            text += f", {SIGNAL_NAMES.get(self.signal, f'signal {self.signal}')}"
        return text


def signal_of_exit_code(code: int) -> int:
    """The signal a shell-convention exit code names (``128 + n``, n up to 64), else 0."""
    return code - 128 if 128 < code <= 192 else 0


def classify_exit(exit_code: int, signal: int = 0) -> Optional[ExitVerdict]:
    """The decision path for an exit: None for a clean exit (code 0, no signal).

    A negative ``exit_code`` -n (Python's ``subprocess`` convention, what a watchdog sees) means killed by
    signal n and is reported as 128 + n.
    """
    sig = signal if signal > 0 else 0
    code = exit_code
    if code < 0:
        sig = sig or -code
        code = 128 + sig
    if code == 0 and sig == 0:
        return None
    chosen: Optional[ExitRule] = None
    if sig:
        chosen = next((r for r in EXIT_RULES if sig in r.signals), None)
    if chosen is None:
        chosen = next((r for r in EXIT_RULES if code in r.codes), None)
    if chosen is None:
        meaning = "killed by " + SIGNAL_NAMES.get(sig, f"signal {sig}") if sig else "a non-zero exit code"
        return ExitVerdict("process", "exit", code, sig, meaning, refine=False)
    return ExitVerdict(chosen.category, chosen.subtype, code, sig, chosen.meaning, chosen.refine)


@dataclass(frozen=True)
class ExceptionRule:
    """An exception means ``category/subtype`` when its type is one of ``types`` (qualified, as the SDK
    sends them, or bare: the last dotted component) or ``pattern`` (a case-insensitive regex) matches its
    message. ``confidence`` is what the classifier reports for a match by type alone."""

    category: str
    subtype: str
    types: Tuple[str, ...] = ()
    pattern: str = ""
    confidence: float = 0.9


def _load_exception_rules(data: Mapping[str, Any]) -> Tuple[ExceptionRule, ...]:
    out = []
    for i, raw in enumerate(data.get("exception_rules", [])):
        where = f"exception_rules[{i}]"
        entry = _table(where, raw, {"kind": str}, {"types": list, "pattern": str, "confidence": (int, float)})
        category, subtype = _split_kind(where, entry["kind"])
        kind(category, subtype)
        if not entry.get("types") and not entry.get("pattern"):
            raise CatalogueError(f"{DATA_FILE}: {where}: needs types or a pattern")
        if entry.get("pattern"):
            try:
                re.compile(entry["pattern"])
            except re.error as exc:
                raise CatalogueError(f"{DATA_FILE}: {where}: pattern: {exc}") from None
        out.append(ExceptionRule(category, subtype, _strings(f"{where}.types", entry.get("types", [])),
                                 entry.get("pattern", ""), float(entry.get("confidence", 0.9))))
    return tuple(out)


EXCEPTION_RULES: Tuple[ExceptionRule, ...] = _load_exception_rules(_DATA)


def classify_exception(exc_type: str, message: str) -> Tuple[str, str]:
    """``(category, subtype)`` of an exception by the error-text classifier
    (:func:`trainguard_engine.classify.classify_exception`); ``("process", "exception")`` when nothing more
    specific matches."""
    from .classify import classify_exception as classify  # classify imports this module

    found = classify(exc_type, message)
    return found.category, found.subtype


# ----------------------------------------------------------------------------------------------------
# Detection settings


def _setting(default: Any, doc: str, *, minimum: Optional[float] = None,
             maximum: Optional[float] = None) -> Any:
    return field(default=default, metadata={"doc": doc, "min": minimum, "max": maximum})


@dataclass(frozen=True)
class DetectionSettings:
    """Every threshold and bound of the pipeline, with its documented default. Immutable.

    Build with keyword arguments or :meth:`from_overrides` (per-project overrides from the server's
    configuration, validated). :meth:`documentation` lists ``(name, default, doc)`` for the README.

    **Stall threshold, reconciled.** DESIGN §4 says "no progress for > 10 min (configurable; scale it to
    observed step time)"; the quality bar (§6) says "hang flagged within 2x the expected step time". A rank
    is stalled when its step has not advanced for longer than
    ``clamp(stall_factor x step_time, stall_min_s, stall_max_s)``: 2x the observed step time (the quality
    bar), never less than ``stall_min_s`` (a floor that absorbs heartbeat spacing, checkpoint saves and
    short evaluation pauses, which a 2x rule alone would flag for sub-second steps), and never more than
    ``stall_max_s`` = the DESIGN's 10 minutes, which is also the threshold while the step time is still
    unknown (no step completed yet). The floor is what makes fast runs' detection time: with the defaults a
    run of 0.5 s steps is flagged after 120 s of no progress (+ up to one heartbeat interval), a run of
    3-minute steps after 6 minutes, a run of unknown step time after 10 minutes. A demo sets
    ``stall_min_s`` to a few seconds. Runs with steps longer than ``stall_max_s / stall_factor`` should
    raise ``stall_max_s``.
    """

    # --- progress -------------------------------------------------------------------------------
    stall_factor: float = _setting(
        2.0, "A rank is stalled after stall_factor x its step time without progress (DESIGN §6: hang "
        "flagged within 2x the expected step time), clamped to [stall_min_s, stall_max_s].", minimum=1.0)
    stall_min_s: float = _setting(
        120.0, "Floor of the stall threshold, seconds: pauses shorter than this (heartbeat spacing, "
        "checkpoint saves, short evaluations) are never a stall. A demo uses a few seconds.", minimum=0.0)
    stall_max_s: float = _setting(
        600.0, "Ceiling of the stall threshold, seconds (DESIGN §4: 10 minutes); also the threshold "
        "while the run's step time is unknown.", minimum=0.0)
    rank_lost_grace_s: float = _setting(
        20.0, "Correlation: a rank that sent nothing since before its peers' collective failure began, "
        "and has not exited, is declared lost (comm/rank-lost, leading) once the failure is this many "
        "seconds old -- or 2.5x the rank's own heartbeat interval, if longer.", minimum=0.0)
    oom_explains_s: float = _setting(
        60.0, "Correlation: a memory exhaustion (memory/oom, a process/killed by the OOM killer) explains "
        "a communication failure, a rank loss or a died DataLoader worker that began within this many "
        "seconds of it, before or after (an OOM-killer report is printed after the kill, one rank's "
        "allocation failure beside its peers' lost connections); 0: only those after it.", minimum=0.0)
    device_fault_explains_s: float = _setting(
        60.0, "Correlation: a CUDA device fault (memory/cuda-error: an illegal address, a device-side "
        "assert, a launch failure, an ECC or Xid error) explains a collective timeout, a communication "
        "failure or a rank loss that began within this many seconds before it (the faulting rank stops "
        "entering collectives and its peers' watchdogs report it; pasted ranks' lines are in no time "
        "order); any time after it, by rule 1, as before. 0: only those after it.", minimum=0.0)
    lost_after_s: float = _setting(
        300.0, "A run that has not exited and sent no event at all for this long (by the processor's "
        "clock, see Pipeline.advance) is lost: 20 missed heartbeats at the SDK's 15 s default.",
        minimum=1.0)
    # --- loss / gradient ------------------------------------------------------------------------
    loss_metrics: Tuple[str, ...] = _setting(
        ("loss", "train/loss", "train_loss", "training_loss"),
        "Metric names that are the training loss (a non-finite value opens loss/non_finite).")
    grad_norm_metrics: Tuple[str, ...] = _setting(
        ("grad/global_norm", "grad_norm", "train/grad_norm"),
        "Metric names that are the global gradient norm (used to tell gradient/explosion from "
        "loss/non_finite).")
    explosion_jump_factor: float = _setting(
        6.0, "The loss went non-finite after a gradient explosion when the grad norm peaked at >= this "
        "many times its running median in the window before (DESIGN §4: 4.5x ResNet-like, 6x BERT-like; "
        "the conservative end).", minimum=1.0)
    explosion_window_steps: int = _setting(
        50, "How many steps before the first non-finite loss are searched for a grad-norm climb or a "
        "non-finite grad norm (seed 000 §3.5: the norm climbed for 50 steps before the NaN).", minimum=1)
    explosion_min_points: int = _setting(
        4, "Finite grad-norm values needed in that window to judge a climb.", minimum=2)
    # --- loss curve and gradient detectors (core/detectors/loss.py, gradient.py) ----------------------
    # shared ---------------------------------------------------------------------------------------
    trend_z: float = _setting(
        2.33, "Mann-Kendall |z| that makes a trend significant (one-sided p ~ 0.01); used by every "
        "trend test below.", minimum=0.0)
    confirm_checks: int = _setting(
        3, "Consecutive steps a loss-curve or clip-stale condition must hold before it opens an incident "
        "(seed: 'after 3 steps').", minimum=1)
    # --- loss curve -----------------------------------------------------------------------------------
    loss_window: int = _setting(
        40, "Loss values (the rank's last ones, one per step) judged by the oscillation and plateau tests; "
        "at most DetectionSettings.history_len.", minimum=8)
    loss_baseline_points: int = _setting(
        5, "The run's initial loss level is the median of its first this-many finite loss values.", minimum=1)
    oscillation_min_cv: float = _setting(
        0.3, "loss/oscillation: robust spread 1.4826 x MAD / median of the window >= this (violent swings).")
    oscillation_min_level: float = _setting(
        0.8, "loss/oscillation: the window's median >= this x the initial level (swinging at a high "
        "level, no real progress); here the lower of the first value and the initial median, since a "
        "far-too-high LR moves the loss from the first update on.")
    oscillation_noise_factor: float = _setting(
        4.0, "loss/oscillation: judged against the run's own noise, a window swings from this x the robust "
        "spread of the run's first 2 x loss_baseline_points loss values (when that is below "
        "oscillation_min_cv; never below oscillation_calm_min_cv): a loss calm at the start that swings "
        "at 4x that spread swings (the plateau rule's spread test uses the same bar).", minimum=1.0)
    oscillation_calm_min_cv: float = _setting(
        0.2, "loss/oscillation: the lowest robust spread that swings (see oscillation_noise_factor; ~ an "
        "interquartile range of a quarter of the level).", minimum=0.0)
    oscillation_max_rise: float = _setting(
        1.5, "loss/divergence settles into loss/oscillation when, over a full loss_window, the loss swings "
        "with no trend and no longer rises, at a level at most this x the level of the run's first full "
        "loss_window (no trend relative to where the run started: a loss thrown up within its first window "
        "swings there; one that climbed far above its early level later and swings there kept diverging). "
        "The oscillation rule itself fails on a window whose median is above this x both that first "
        "window's level and the initial level, its values significantly higher than that window's (rank "
        "test, z >= trend_z): swings on a level that climbs window after window are a rising loss.",
        minimum=1.0)
    oscillation_min_fall: float = _setting(
        0.85, "loss/oscillation fails on a window whose median is under this x the level of the run's "
        "first full loss_window, its values significantly lower than that window's (rank test, z >= "
        "trend_z): noise on a level still falling window after window is a loss converging (0: off).",
        minimum=0.0)
    oscillation_min_serial: float = _setting(
        0.4, "loss/oscillation (0: off; on by default since stop 50, gated by oscillation_shape_new_factor "
        "and units the updates killed -- docs/detectors.md). When > 0, "
        "a window with a heavy upper tail (oscillation_heavy_tail) opens only on swings with a shape: the "
        "lag-1 rank autocorrelation of its values (in step order) at least this in size -- the loss runs in "
        "stretches or alternates -- unless its lower quartile is >= oscillation_iid_level x the initial "
        "level. Independent draws of a noisy loss give ~0 +- 0.16 over 40 values (~1 % of windows reach "
        "0.4). 0.4 with oscillation_heavy_tail 1 (every window) quiets tuning43/44's and heldout43's healthy "
        "heavy-tailed oscillations (healthy right: tuning43 3/6 -> 3/6 but 3 fewer oscillations, tuning44 "
        "5/7 -> 7/7, heldout43 6/8 -> 8/8) but also loses dev corpus verdicts (r201, r794: LR-too-high "
        "runs whose updates killed units; r645's transient oscillation; r709's knob test); with "
        "oscillation_heavy_tail 2.5 the corpus keeps them and most of the gain is gone. Stop 45's "
        "pre-registered heldout45: on = off (7/8 healthy, 5/8 faults). Stop 50: with the two gates the "
        "dev corpus keeps every verdict and tuning44 goes 5/7 -> 7/7.",
        minimum=0.0, maximum=1.0)
    oscillation_heavy_tail: float = _setting(
        1.0, "loss/oscillation asks a shape (oscillation_min_serial, when on) only of a window with a heavy "
        "upper tail: its 0.9 quantile (nearest rank) >= this x its median (1: of every window).", minimum=1.0)
    oscillation_iid_level: float = _setting(
        2.0, "loss/oscillation (oscillation_min_serial on): a heavy-tailed window opens without a shape when "
        "its LOWER QUARTILE is >= this x the initial level (the rule's own, see oscillation_min_level): the "
        "whole window thrown up far above the start, not a wide tail over a start that a few lucky first "
        "values set low (tuning36-44's LR-too-high runs with unshaped swings: lower quartile 2.0-33x; the "
        "healthy heavy-tailed ones 0.4-1.8x, their medians up to 3.8x).", minimum=0.0)
    oscillation_shape_new_factor: float = _setting(
        3.0, "loss/oscillation (oscillation_min_serial on): a heavy-tailed window opens without a shape "
        "when its robust spread is >= this x the robust spread of the run's first 2 x loss_baseline_points "
        "values (or that early spread is unknown): swings the run did not have at its start are new -- an "
        "LR that started throwing a calm loss about -- not the run's own noise (0: never; stop 50: "
        "tuning43/44's healthy heavy-tailed runs 0.6-1.8x, the dev corpus's LR-too-high runs that started "
        "calm r201 5.4-8.3x, r645 4.3-4.8x; 2 to 3 keep every verdict, 1.5 and 4 do not).", minimum=0.0)
    oscillation_held_points: int = _setting(
        40, "loss/oscillation gives way to loss/divergence when, on this many values in a row (a full "
        "loss_window's worth), the oscillation rule no longer holds (the loss stopped swinging, or trends) "
        "while the divergence rule does (its level >= divergence_factor x the base): a loss thrown about "
        "at first, then held far above where it started.", minimum=1)
    plateau_min_level: float = _setting(
        0.9, "loss/plateau: the window's median >= this x the initial level (fell by less than 10% since "
        "the start: a run that fell and then flattened is converging, not on a plateau).")
    plateau_stalled_min_level: float = _setting(
        0.8, "loss/plateau: a window's median below plateau_min_level but >= this x the initial level is "
        "still a plateau when the run stopped learning: the window's median global grad norm <= "
        "plateau_grad_collapse x the norm's early level (a run that fell a little, then its gradient "
        "collapsed and the loss went flat, has not learned), or the norm climbed into a gradient "
        "explosion flagged before any non-finite value.")
    plateau_grad_collapse: float = _setting(
        0.1, "loss/plateau: the window's median global grad norm <= this x the median of the run's first "
        "loss_baseline_points grad-norm values means the gradient collapsed (see "
        "plateau_stalled_min_level).", minimum=0.0)
    plateau_max_change: float = _setting(
        0.1, "loss/plateau: |Theil-Sen slope (through 4-value block medians)| x window <= this x the "
        "window's median (flat), with no significant Mann-Kendall trend and a spread below "
        "oscillation_min_cv.")
    plateau_converged_level: float = _setting(
        0.01, "loss/plateau: a window's median <= this x the initial level has converged, never a plateau, "
        "whatever its gradients (they vanish at a minimum: an exact fit sits at ~1e-13 with a grad norm of "
        "~1e-6, which plateau_small_grad alone would read as 'optimisation stuck'). 0: off.", minimum=0.0)
    plateau_small_grad: float = _setting(
        1e-2, "loss/plateau verdict: a median global grad norm below this, a layer with exactly zero "
        "gradient (last per-layer report) or an LR of 0 means 'optimisation stuck' (saturated or dead "
        "units, zero LR); otherwise 'capacity or data'.")
    plateau_min_steps: int = _setting(
        100, "loss/plateau: the flat stretch must span at least this many steps before it opens (a warmup "
        "from ~0 LR or a slow start is flat for a few dozen steps, then falls).", minimum=1)
    plateau_moved_min_steps: int = _setting(
        50, "loss/plateau: the flat stretch needs only this many steps (instead of plateau_min_steps) when "
        "it began after the loss had left its start: the median of rise_held_points values in a row "
        "more than plateau_resolve_drop away from the initial level (a far-too-high LR threw it up, or "
        "it fell, and it came back). A slow start is flat from the first steps; a loss that moved and "
        "came back to sit at its start has been moved by the optimiser and learns nothing. Never above "
        "plateau_min_steps.", minimum=1)
    plateau_resolve_drop: float = _setting(
        0.2, "loss/plateau resolves (and the run's health recovers) when the loss level falls this far "
        "(a fraction) below the plateau's level.", minimum=0.0)
    divergence_factor: float = _setting(
        2.0, "loss/divergence: the loss level (rolling median of rise_smooth values) >= this x the run's "
        "initial level (the lower of the first value and the first values' median).", minimum=1.0)
    divergence_min_points: int = _setting(
        5, "loss/divergence: values in a row the level must stay diverged (with a rising trend or a "
        "spread below oscillation_min_cv: a loss swinging at a high level with no trend is an oscillation).",
        minimum=1)
    divergence_far_factor: float = _setting(
        5.0, "loss/divergence: a level >= this x the base is diverged however rough the loss is, while the "
        "global grad norm grows with it (see divergence_corroborated_points) and either the loss rose on "
        "every value since it last was in its band (3+) or, before a divergence is open, the norm's latest "
        "reading is >= explosion_jump_factor x its median; below it a rough loss with no trend since it "
        "left its band is the oscillation rule's (a geometric blow-up doubles each step: rough, not "
        "swinging).", minimum=1.0)
    divergence_corroborated_points: int = _setting(
        3, "loss/divergence: values in a row enough instead of divergence_min_points when the global grad "
        "norm corroborates it (its latest reading >= explosion_onset_factor x the median of the earlier "
        "half of its readings in the last explosion_window_steps): a loss leaving its band while the "
        "gradients grow is the start of an explosion, where every step of warning counts (the norm may be "
        "read only every few steps, too seldom for the explosion rule's own confirmation).", minimum=1)
    divergence_blowup_factor: float = _setting(
        1000.0, "loss/divergence opens at once, with no streak, when one finite loss value was >= this x the "
        "run's divergence base (divergence_factor's: the lower of the first value and the first values' "
        "median), the run's first values included, and the latest is back under that: a blow-up the loss "
        "came back from (one still up there is the far divergence's or the non-finite rule's) -- often to "
        "a flat, dead model sitting at its start, with spikes -- is an LR far too high whatever the rolling "
        "level does afterwards (the dev half's healthy runs peak at 46x, a planted one-batch spike). 0: off.",
        minimum=0.0)
    divergence_early_blowup_factor: float = _setting(
        10.0, "loss/divergence opens at once, from the blown-up value's step, when one of the run's first "
        "divergence_early_blowup_values loss values was >= this x the run's divergence base and the whole "
        "loss_window of values after the last such value sat dead near the start: its lower quartile >= "
        "plateau_min_level x the base (it never learned below where it started) and its median under "
        "divergence_factor x the base (back in its band: one still out of it is the divergence rule's). A "
        "far-too-high LR on the first updates that left a dead, constant-predictor model read as a "
        "vanishing gradient or a plateau (stop 36: bench/unseen tuning encoder, Adam 0.2 beside clip 0.5, "
        "1.35 -> 19 -> ~1.4). The dev half's healthy runs peak at 2.3x their first value on their first "
        "10 values (two noisy ones at 20-30x go on learning). 0: off.", minimum=0.0)
    divergence_early_blowup_values: int = _setting(
        10, "How many of the run's first loss values divergence_early_blowup_factor looks at (the first "
        "updates).", minimum=1)
    divergence_beside_stale: bool = _setting(
        True, "loss/divergence is still judged while a gradient/clip-stale, gradient/vanishing or "
        "adapter/lora-grad-break incident of the rank is open (the other loss-curve rules stay muted: a "
        "flat loss is that incident's own symptom; a loss leaving its band is not, and an LR too high "
        "beside clipping shows that way). False: muted as well, as before stop 36.")
    rise_smooth: int = _setting(
        5, "loss/rise-after-fall: the loss level is a rolling median of this many values.", minimum=1)
    rise_min_fall: float = _setting(
        0.5, "loss/rise-after-fall: the level first fell by >= this x the initial level (to at most half of "
        "it: a real learning phase; the dips of a flat, noisy loss reach ~30%). Lower it for fine-tuning "
        "runs that start near their optimum.")
    rise_min_rise: float = _setting(
        0.5, "loss/rise-after-fall: then rose again by >= this x that fall above its lowest level.")
    rise_held_points: int = _setting(
        20, "loss/rise-after-fall: the fall must also hold over this many values in a row (the lowest "
        "median of that many, half a loss_window, taken every rise_smooth values): a rebound from a level "
        "the run reached, not from one dip of a swinging loss's rolling level.", minimum=1)
    rise_calm_min_fall: float = _setting(
        0.3, "loss/rise-after-fall, held rebound only (the last loss_window values calm above the rebound "
        "bar): the fall held over rise_held_points values may be this x the initial level instead of "
        "rise_min_fall -- a calm rebound to a held level after a calm fall is not a swinging loss's dip "
        "(the label's own 30 % fall); 0.5 (= rise_min_fall) turns it off.", minimum=0.0)
    rise_min_points: int = _setting(
        8, "loss/rise-after-fall: the fewest values in the Mann-Kendall test of the rebound (z >= "
        "trend_z), and how many values in a row the rebound must hold (a short spike is not a rebound).",
        minimum=3)
    # --- gradient explosion before the NaN --------------------------------------------------------------
    explosion_sustain: int = _setting(
        3, "gradient/explosion (before NaN): the last this-many grad norms all >= explosion_jump_factor x "
        "the running median (one spike is not an explosion).", minimum=1)
    explosion_trend_points: int = _setting(
        10, "gradient/explosion (before NaN): the last this-many grad norms rise (Mann-Kendall "
        "z >= trend_z).", minimum=3)
    explosion_climb_quantile: float = _setting(
        0.75, "gradient/explosion (before NaN): the last explosion_sustain grad norms must also all be above "
        "this quantile of the norms of the window's earlier half (the half the running median is taken "
        "from): a climb leaves the range the norm already had. A heavy-tailed norm -- a converged model's, "
        "its median collapsed to ~1e-4 while hard batches still give ~1 -- reaches explosion_jump_factor x "
        "that median on every spike without leaving its range (stop 38's tuning set). 0: off.",
        minimum=0.0, maximum=1.0)
    explosion_onset_factor: float = _setting(
        2.0, "gradient/explosion: first_step is where the norm last rose above this x its running median "
        "and stayed there.", minimum=1.0)
    explosion_resolve_points: int = _setting(
        20, "gradient/explosion flagged before any non-finite value resolves (the run's health recovers) "
        "when this many grad-norm readings in a row are back below explosion_onset_factor x the median the "
        "climb was measured from, the loss finite and in its band: a spike that recovered.", minimum=1)
    explosion_recovered_level: float = _setting(
        1.0, "gradient/explosion flagged before any non-finite value also resolves when the loss has "
        "recovered -- its rolling level <= this x where it started (the median of its first values, or the "
        "first value when lower) -- and "
        "the median of the last explosion_resolve_points grad-norm readings since the climb is below "
        "explosion_onset_factor x the median the climb was measured from: the norm is back on the whole, "
        "however spiky (an adaptive optimizer at a high LR after a blow-up it learned through), and the run "
        "is learning below where it started. 0: off.", minimum=0.0)
    explosion_settled_spread: float = _setting(
        2.0, "gradient/explosion flagged before any non-finite value also resolves when the norm stopped "
        "climbing at a new level: its last explosion_resolve_points readings since the climb show no "
        "rising trend (Mann-Kendall z < trend_z) and their largest is <= this x their median, while the loss "
        "is finite, in its band and its rolling level <= explosion_settled_level x where it started -- one "
        "bad batch that threw an adaptive optimizer's state off leaves the norm a few times higher for good "
        "while the run trains on (stop 40's held-out Lightning VAE, Adam, one batch x1000: the norm 0.4 -> "
        "5-12 to the end, the loss 4.2 at the start, 0.22 before the batch, 1.2-2.0 after; the explosion "
        "had stayed open to the end). A later climb or non-finite value opens the slot again. 0: off.",
        minimum=0.0)
    explosion_settled_level: float = _setting(
        0.85, "... (the settled rule's loss level, as a multiple of where the loss started: the run "
        "learned -- bench/unseen's trace rule for a run that learned, 0.85; a loss flat a little under "
        "its start beneath a clipped norm that stopped climbing, an LR too high held by the clip, is not "
        "a run that learned through a blow-up: dev r415).", minimum=0.0)
    explosion_diverged_points: int = _setting(
        40, "gradient/explosion flagged before any non-finite value is re-classified in place as "
        "loss/divergence when, on this many loss values in a row (a loss_window's worth), the loss stays out "
        "of its band (its rolling level >= divergence_factor x its base) and nothing non-finite came: the "
        "climb was the gradient of a loss that left its band, and the run goes on far above it without "
        "blowing up. A later non-finite value re-classifies it back (same incident, the climb's lead kept). "
        "0: off.", minimum=0)
    spike_factor: float = _setting(
        8.0, "loss/spike (warning) opens on one finite loss value >= this x the median of the spike_window "
        "values before it (and >= spike_over_max x their largest): one bad batch that hit the run (stop 41's "
        "GRU, residual MLP and LoRA Llama: the loss 100-7,750x for ONE step, then normal, and no incident). "
        "With spike_over_max and spike_start_level, no healthy shape of tuning36/38/39/41/42 has a value "
        "over all three bars at 5, 8 or 10; tuning42's clipped Lightning CNN's x100 batch is 11.4x. "
        "10 -> 8 at stop 43, once spike_over_record and spike_tail_power keep heavy-tailed noise out: "
        "a batch x10 on a falling curve is under 10x the median of the 40 higher values before it "
        "(simulated log-normal curves, sigma 0.05: 0 of 5 caught at 10, 5 of 5 at 8; tuning43's "
        "noisy-label CNN at batch 32: 10.0x). Not 7: healthy runs with 1 % natural hard batches of 3-8x on "
        "tight noise got it on 3 of 10 simulated runs at 7, 0 at 8 (hR). No healthy shape of tuning36-43 "
        "gets one. 0: off.",
        minimum=0.0)
    spike_over_max: float = _setting(
        3.0, "... and >= this x the LARGEST of those values: a value of the range the loss already had "
        "(a hard batch that comes back now and then, a heavy-tailed loss) is not a spike.", minimum=1.0)
    spike_start_level: float = _setting(
        1.0, "... and >= this x the run's initial loss level (the median of its first loss_baseline_points "
        "values, or the first when lower): the bad batch undid what the run had learned. A converged "
        "classifier's one hard batch is far above its collapsed median but far below its start (tuning36's "
        "healthy ViT: 0.002 -> 0.07 at 0.04x its start, 32-50x its median; tuning41's GRU bad batch: 2.2x "
        "its start, the others 100x and more). 0: off.", minimum=0.0)
    spike_over_record: float = _setting(
        3.0, "... and its ratio to the loss's rolling level (the median of rise_smooth values) >= this x the "
        "largest such ratio of the run's earlier values (its record; none taken while the numeric slot is "
        "open, none from a value taken as a spike): a heavy-tailed healthy loss (tiny batches, "
        "heavy-tailed targets, noisy labels, sparse rewards) shows how far its own noise reaches, and a bad "
        "batch must go further (stop 43: a loss of iid Pareto(2-3) noise got loss/spike on ~2 of 3 runs of "
        "3,000 steps; with this bar and spike_tail_power, 1-3 of 20). 0: off.", minimum=0.0)
    spike_tail_power: float = _setting(
        2.0, "... and >= the window's median x (its spike_tail_quantile value / its median) ** this: the bar "
        "scales with the window's own spread (for a Pareto tail of any index, a healthy value passes it with "
        "probability ~0.5 x 5^-power at quantile 0.9; the spread of 40 values is a noisy estimate, hence "
        "the record bar beside it). A smooth run's spread (~1.1-1.3) leaves spike_factor the binding bar. "
        "5 -> 2 within stop 43 on its tuning set: a loss with two modes (batch 1, 10 % random rows) has a "
        "spread of ~6 that is no tail -- at 5 the LoRA GPT-2's x20 batch (120x its median, 10x its record) "
        "was missed; simulated Pareto runs gave the same false alarms at 0, 2 and 5 (the record does the "
        "work there). 0: off.", minimum=0.0)
    spike_tail_quantile: float = _setting(
        0.9, "The quantile of the spike_window values that spike_tail_power measures the window's spread "
        "with (nearest rank).", minimum=0.5, maximum=1.0)
    spike_window: int = _setting(
        40, "The loss values before a value that loss/spike measures it against (at least half of them "
        "needed: the first values of a run are not judged).", minimum=4)
    spike_resolve_points: int = _setting(
        3, "An open loss/spike resolves after this many finite loss values in a row below the larger of "
        "spike_over_max x the largest value before the spike and 1/spike_factor of the spike: the one bad "
        "value is behind the run (a run that stays high is then the loss-curve rules' to judge).", minimum=1)
    layer_norm_warn: float = _setting(
        10.0, "Per-layer grad norm above which a layer is named in explosion evidence (seed: > 10 warns).")
    clip_rate_warn: float = _setting(
        0.3, "Clip-trigger rate over the explosion window above which it is named in explosion evidence "
        "(seed: clipping on > 30% of steps).")
    # --- vanishing ----------------------------------------------------------------------------------------
    vanishing_ratio: float = _setting(
        1000.0, "gradient/vanishing: L2 grad norm of the last third of layers / of the first third >= this "
        "(seed: 3 orders of magnitude).", minimum=1.0)
    vanishing_min_layers: int = _setting(3, "gradient/vanishing: layers needed in a per-layer report.",
        minimum=3)
    vanishing_min_reports: int = _setting(
        3, "gradient/vanishing: consecutive per-layer reports over the ratio.", minimum=1)
    # --- clip-stale ---------------------------------------------------------------------------------------
    clip_stale_window: int = _setting(
        5, "gradient/clip-stale: steps whose grad norm is compared with the clip threshold (seed: 5).",
            minimum=1)
    clip_stale_norm_ratio: float = _setting(
        0.98, "gradient/clip-stale: mean pre-clip grad norm of the window > this x tau (seed: 0.98) when tau "
        "is reported; otherwise every step of the window clipped.")
    clip_stale_curvature: float = _setting(
        1e-5, "gradient/clip-stale: loss curvature (2nd derivative / loss level, per step^2) below this, or "
        "within trend_z standard errors of 0 (seed: < 1e-5).")
    clip_stale_curve_window: int = _setting(
        40, "gradient/clip-stale: loss values judged: no Mann-Kendall trend either way (|z| < trend_z: a "
        "falling loss is learning, a rising one diverging) and the curvature test.", minimum=4)
    clip_stale_min_ratio: float = _setting(
        10.0, "gradient/clip-stale: with the clip threshold tau reported (the SDK sends it), a flat loss is "
        "starved by clipping when the mean pre-clip norm >= this x tau; otherwise (tau unknown, or clipped "
        "by less) only while the loss is still >= plateau_min_level x its initial level.", minimum=1.0)
    clip_stale_growth: float = _setting(
        0.05, "Adaptive clip threshold recommended when stale: tau <- tau x (1 + this x stale_count) (seed).")
    clip_onset_growth: float = _setting(
        1.2, "Adaptive clip threshold at an explosion onset: tau <- min(this x tau, clip_max_tau) (seed).",
            minimum=1.0)
    clip_max_tau: float = _setting(10.0, "Cap of the adaptive clip threshold at an explosion onset (seed).")
    clip_threshold_metrics: Tuple[str, ...] = _setting(
        ("grad/clip_threshold", "grad/max_norm"),
        "Metric names carrying the clip threshold tau (max_norm), when the job reports it; without one, "
        "tau is bounded by the smallest clipped pre-clip norm.")
    # --- memory detectors (core/detectors/memory.py) ----------------------------------------------------
    frag_mild: float = _setting(0.2, "memory/fragmentation: (reserved - active) / reserved below this is "
                                "healthy (DESIGN §4).", minimum=0.0, maximum=1.0)
    frag_severe: float = _setting(0.5, "memory/fragmentation: above this is severe (DESIGN §4).",
                                  minimum=0.0, maximum=1.0)
    frag_sustain_samples: int = _setting(3, "memory/fragmentation: samples in a row above frag_severe before "
                                         "it opens.", minimum=1)
    frag_peak_headroom: float = _setting(0.5, "memory/fragmentation: (reserved - peak allocated) / reserved "
                                         "needed before anything opens (memory never needed even at the "
                                         "peak; a training step's own cached buffers are not fragmentation).",
                                         minimum=0.0, maximum=1.0)
    frag_warn: float = _setting(0.7, "memory/fragmentation early warning: fragmentation above this ...",
                                minimum=0.0, maximum=1.0)
    frag_warn_std: float = _setting(0.15, "... with its standard deviation over frag_window_s above this "
                                    "(DESIGN §4).", minimum=0.0)
    frag_window_s: float = _setting(60.0, "memory/fragmentation early-warning window, seconds (DESIGN §4).",
                                    minimum=1.0)
    frag_min_samples: int = _setting(5, "Fewest samples the early-warning standard deviation is computed on.",
                                     minimum=2)
    frag_max_samples: int = _setting(256, "Fragmentation samples kept per rank.", minimum=8)
    frag_update_step: float = _setting(0.05, "Rise in fragmentation that refreshes an open incident.",
                                       minimum=0.0)
    amp_overflow_consecutive: int = _setting(10, "memory/amp-overflow: GradScaler overflow steps in a row "
                                             "(scale halving each time) that open it.", minimum=2)
    amp_overflow_episodes: int = _setting(4, "memory/amp-overflow: separate overflow episodes within "
                                          "amp_overflow_window steps that open it (the scale collapsing "
                                          "repeatedly).", minimum=2)
    amp_overflow_window: int = _setting(200, "Steps over which overflow episodes are counted.", minimum=1)
    amp_reserved_ratio: float = _setting(
        0.9, "memory/amp-overflow near capacity (DESIGN §4): reserved / capacity above which an overflow "
        "episode counts as happening near capacity.", minimum=0.0, maximum=1.0)
    amp_near_capacity_episodes: int = _setting(
        2, "memory/amp-overflow near capacity: overflow episodes after the scaler's calibration, each "
        "starting with reserved > amp_reserved_ratio x capacity, within amp_overflow_window steps.",
        minimum=1)
    frag_l2_rate: float = _setting(
        5e9, "memory/fragmentation level 2 (DESIGN §4): allocation rate above this, bytes/s ...",
        minimum=0.0)
    frag_l2_split_share: float = _setting(
        0.5, "... with at least this share of the free cached memory in split blocks (few large free "
        "blocks).", minimum=0.0, maximum=1.0)
    leak_window: int = _setting(
        48, "memory/leak: samples (of allocated device memory, else host RSS) in the trend window; also "
        "the most coarse points kept.", minimum=8)
    leak_min_samples: int = _setting(12, "memory/leak: fewest samples before a window is judged.", minimum=4)
    leak_skip_samples: int = _setting(
        2, "memory/leak: first samples of each series not judged (allocator warm-up, optimizer state "
        "created at the first step).", minimum=0)
    leak_z: float = _setting(3.0, "memory/leak: Mann-Kendall z the window must reach.", minimum=0.0)
    leak_min_growth_bytes: float = _setting(
        67108864.0, "memory/leak: least Theil-Sen growth over the window, bytes (64 MiB); also the "
        "growth that refreshes an open incident.", minimum=0.0)
    leak_min_growth_ratio: float = _setting(
        0.1, "memory/leak: least growth relative to the first block's floor.", minimum=0.0)
    leak_blocks: int = _setting(4, "memory/leak: blocks of the window whose floors (minima) must each rise.",
                                minimum=2)
    leak_tail_z: float = _setting(
        3.0, "memory/leak: Mann-Kendall z the window's last half must reach by itself (the growth goes on "
        "to the window's end; a level shift -- RSS stepping up once when a rank's work grows, then flat -- "
        "does not). 0: off.", minimum=0.0)
    leak_peak_ratio: float = _setting(
        2.0, "memory/leak working-set rule: the all-time peak (mem/reserved on the metrics-only path) may "
        "rise at most this many times as fast as allocated memory (growing inputs are not a leak).",
        minimum=1.0)
    leak_coarse_every: int = _setting(
        8, "memory/leak: samples folded into one coarse point (median), for slow leaks.", minimum=2)
    context_leak_memory_ratio: float = _setting(
        0.005, "memory/context-leak (DESIGN §4): other processes' memory on the rank's GPU above this "
        "share of capacity is level medium; another CUDA context listed by NVML is level high.",
        minimum=0.0, maximum=1.0)
    context_leak_allowance: float = _setting(
        1073741824.0, "memory/context-leak without NVML: bytes of the driver's 'used' allowed to this "
        "process beyond what its allocator reserved (its own context, cuBLAS/NCCL workspaces): 1 GiB.",
        minimum=0.0)
    context_leak_samples: int = _setting(
        2, "memory/context-leak: consecutive samples of one device before it opens.", minimum=1)
    # --- sequence / adapter (the SDK's check_batch and watch_lora reports) -------------------------
    seq_window_checks: int = _setting(
        10, "sequence/truncation: check_batch reports (not sampled out) a rule is judged over.", minimum=1)
    seq_confirm_checks: int = _setting(
        3, "sequence/truncation: reports within the window on which a rule must hold.", minimum=1)
    seq_pad_attended_max: float = _setting(
        0.0, "sequence/truncation: seq/pad_attended_frac above this on a report is padding attended.",
        minimum=0.0, maximum=1.0)
    seq_mask_mismatch_max: float = _setting(
        0.0, "sequence/truncation: seq/mask_mismatch_frac above this: the mask disagrees with the padding.",
        minimum=0.0, maximum=1.0)
    seq_labels_on_pad_max: float = _setting(
        0.0, "sequence/truncation: seq/labels_on_pad_frac above this: the loss is computed on padding.",
        minimum=0.0, maximum=1.0)
    seq_eos_cut_min_frac: float = _setting(
        0.05, "sequence/truncation EOS cut off: the window's mean share of rows cut at max_length without "
        "EOS must reach this ...", minimum=0.0, maximum=1.0)
    seq_eos_kept_min_frac: float = _setting(
        0.9, "... while at least this share of the rows that were not cut end in EOS (the data has one).",
        minimum=0.0, maximum=1.0)
    lora_grad_min: float = _setting(
        1e-6, "adapter/lora-grad-break: both adapter gradient means (lora/grad_mean_A, _B) below this "
        "(DESIGN §4), or adapter parameters without a gradient ...", minimum=0.0)
    lora_confirm_reports: int = _setting(
        5, "... on this many watch_lora reports in a row ...", minimum=1)
    lora_loss_window: int = _setting(
        32, "... while the loss still moves: Mann-Kendall |z| >= trend_z over the last this-many loss "
        "values since the break began ...", minimum=4)
    lora_loss_min_points: int = _setting(8, "... and at least this many of them.", minimum=3)
    # --- performance: stragglers, throughput, data wait, throttling (detectors/straggler.py) -----
    perf_warmup_steps: int = _setting(
        10, "Performance detectors: a rank's first this-many timed steps are warm-up (allocator, DDP bucket "
        "rebuild, compilation, peers still starting) and never judged.", minimum=0)
    perf_window: int = _setting(
        8, "Performance detectors: each rank's step phases are judged as medians over its last this-many "
        "steps (an isolated checkpoint or evaluation step moves no median).", minimum=3)
    perf_min_points: int = _setting(
        5, "Performance detectors: steps a rank needs in its window before it is compared.", minimum=2)
    straggler_ratio: float = _setting(
        1.7, "perf/straggler, a sign test on a per-step paired comparison: at each judged step (every rank "
        "reported it) a rank's own time (data wait + forward + optimizer: the phases without a collective) "
        "is compared with the median of the other ranks' own times at that same step -- the same step "
        "shares the host's load and the job's input, so the job slowing together cancels out; the rank is "
        "over at that step when its own time >= this x theirs ...", minimum=1.0)
    straggler_window: int = _setting(
        28, "... over a rank's last this-many judged steps ...", minimum=3)
    straggler_steps: int = _setting(
        18, "... it is a straggler candidate when it was over on at least this many of them (a rank "
        "persistently slower, not one preempted for a stretch: on a loaded 2-core host the ranks of 26 "
        "recorded healthy 4-rank runs reached at most 15 of 28 at 1.7x, and a rank pinned to a core shared "
        "with a spinning process, only ~10 ms a step slower, reached 18 within 28 steps of the contention "
        "in each of 11 runs; bench/straggler.py) ...", minimum=1)
    straggler_noise_k: float = _setting(
        2.0, "... on a steady host a lower bar too: once the job's steady state is known (regression_"
        "baseline_steps judged steps after warm-up), a rank is also over at a step when its own time >= "
        "1 + this x the steady state's spread of every rank's per-step paired ratio (1.4826 x its median "
        "absolute deviation), when that is below straggler_ratio -- on a quiet host ranks differ by a few "
        "per cent and a rank 1.4-1.6x slower than its peers is plain, on an oversubscribed one the spread "
        "keeps the bar at straggler_ratio (steady-state spread 0.05-0.34 on a quiet 16-core host, 0.42-0.89 "
        "with four ranks on two cores; bench/results/straggler_stop32.txt) ...", minimum=0.0)
    straggler_shift_ratio: float = _setting(
        1.35, "... that lower bar is never below this ...", minimum=1.0)
    straggler_shift_growth: float = _setting(
        1.25, "... and a rank over it (not over straggler_ratio) is a candidate only when the median of its "
        "window's paired ratios is >= this x its own in the steady state: it became slower (a rank a "
        "host's layout makes 1.3x slower from the start is not held against it) ...", minimum=1.0)
    straggler_shift_peers_growth: float = _setting(
        1.25, "... nor while the other ranks' own time at the same steps (the median over its window) is >= "
        "this x theirs in the steady state: the whole job's own work moved (every rank slowed together -- "
        "a throughput regression --, or a new phase of the job), so the lower bar measured on the steady "
        "state no longer holds; straggler_ratio still does (at their first candidate step, real stragglers' "
        "peers ran at 0.86-1.09x their steady own time, every rank of a job slowed 2.5x together at "
        "1.4-2.8x; bench/results/straggler_stop33.txt, round 2; 0: off) ...", minimum=0.0)
    straggler_runqueue_share: float = _setting(
        0.1, "... CPU contention (where the SDK reports time/runqueue_s, the training thread's run-queue "
        "delay per step: Linux): a rank is also a candidate when its training thread waited for a core >= "
        "this share of the step on >= straggler_runqueue_steps of its last straggler_window judged steps -- "
        "a rank pinned to a core shared with a busy process waits 0.34-0.50 of every step, every rank with a "
        "core of its own 0.000 on a quiet 16-core host (bench/results/straggler_stop36.txt) ...",
        minimum=0.0, maximum=1.0)
    straggler_runqueue_steps: int = _setting(
        10, "... (that many: not straggler_steps, the delay is evidence of its own -- on a quiet 16-core "
        "host a contended rank waited on 28 of every 28 window steps, no healthy rank on more than 2, in 22 "
        "tuning runs; a burst of preemption shorter than this names nobody; "
        "bench/results/straggler_stop38.txt) ...", minimum=1)
    straggler_runqueue_peers: float = _setting(
        0.05, "... while the other ranks' median share (each over its window) is <= this (they had cores: "
        "on an oversubscribed host every rank waits, and the delay names nobody) ...", minimum=0.0,
        maximum=1.0)
    straggler_runqueue_ratio: float = _setting(
        1.15, "... and the median of its per-step paired ratios (own time over the others' median at the "
        "same step) over the window's steps on which it waited is >= this: its own work is slower -- never "
        "a straggler from the delay alone; the excess and wait tests below still apply, over those steps "
        "too ...", minimum=1.0)
    straggler_min_share: float = _setting(
        0.05, "... its median excess over the others at the same step is >= this share of the job's step "
        "time (a rank 2x slower in a phase that takes 1% of the step holds nobody back) ...",
        minimum=0.0, maximum=1.0)
    straggler_wait_share: float = _setting(
        0.5, "... and the other ranks' remaining time (backward + all-reduce wait) exceeds the rank's own "
        "at the same step by >= this x the excess (median over the window): they waited for it. A "
        "candidate is named at once (the window is the confirmation).", minimum=0.0)
    straggler_hold_steps: int = _setting(
        10, "... while a rank is over on this many of its window's steps (a straggler forming), no "
        "perf/throughput-regression is opened (the job is slower because of that rank) ...", minimum=1)
    straggler_clear_steps: int = _setting(
        14, "... while a rank is over on this many of its window's steps a named straggler is not resolved "
        "(on a loaded host a healthy rank reaches straggler_hold_steps on ~1 judged step in 4, this on "
        "~1 in 60) ...", minimum=1)
    straggler_confirm: int = _setting(
        10, "... it resolves after this many judged steps in a row with no rank at straggler_clear_steps. "
        "Also the confirmation of perf/data-bottleneck (judged steps in a row).", minimum=1)
    regression_ratio: float = _setting(
        1.5, "perf/throughput-regression: the job's step time (median over ranks of their window medians) "
        ">= this x its earlier steady state (or a logged throughput metric <= 1/this of it) ...",
        minimum=1.0)
    regression_min_delta_s: float = _setting(
        0.1, "... and by at least this many seconds per step -- waived in a job of >= 2 ranks whose every "
        "rank's own time (data + forward + optimizer) is >= regression_ratio x its own steady state (the "
        "job slowed together in its own work): a shared host's load triples one process's 30 ms CPU step "
        "for tens of steps (a healthy demo run; healthy runs of the varied corpus) and hits processes "
        "unevenly, while a regression worth an alert in a single process costs 100 ms a step and more; "
        "lower it for fast-step jobs on dedicated nodes ...", minimum=0.0)
    regression_noise_k: float = _setting(
        3.0, "... and by at least this many times the steady state's own noise: the robust spread (1.4826 x "
        "the median absolute deviation) of the job's per-step time over its regression_baseline_steps "
        "steady-state steps, whether the step time or a logged throughput shows it (a floor relative to the "
        "step's own noise: a step that jumps about needs a bigger shift than a steady one) ...",
        minimum=0.0)
    regression_baseline_steps: int = _setting(
        10, "... the steady state being the median of the first this-many judged steps after warm-up ...",
        minimum=1)
    regression_confirm: int = _setting(
        8, "... on this many judged steps in a row, with no straggler forming (a job held back by one "
        "rank is that rank's incident).", minimum=1)
    regression_runqueue_share: float = _setting(
        0.5, "... and not while the job's training threads waited for a core >= this share of their step "
        "(where the SDK sends time/runqueue_s, Linux: the median over ranks of each rank's median of "
        "time/runqueue_s / time/step_s over its window): the host's CPU is oversubscribed -- other jobs, "
        "co-tenants -- and the slower step is the machine's, not the job's; an open regression resolves "
        "(after regression_confirm judged steps) while it holds, as when the step time comes back. Stop "
        "41's tuning set on the shared 2-core VM at load 6-12: a healthy run slowed 10-100x beside two "
        "spinning processes waited 0.64-0.91 (8-step medians) while slowed; a run slowed for real by a "
        "0.3 s per-step upload 0.03-0.32 in its upload's first 70 steps (flagged), then 0.43-0.68 as the "
        "host's load rose (on a host that oversubscribed a regression is not told apart). On a quiet "
        "host the share is ~0 and nothing changes. 0: off.", minimum=0.0, maximum=1.0)
    data_wait_share: float = _setting(
        0.4, "perf/data-bottleneck: the median rank's data wait (time/data_s) >= this share of its step "
        "time, for straggler_confirm judged steps (one rank's slow loader is a straggler, phase 'data').",
        minimum=0.0, maximum=1.0)
    data_wait_min_s: float = _setting(
        0.05, "... and that wait is >= this many seconds per step: the time from one step's end to the next "
        "forward also holds the loop's own logging, pacing and bookkeeping, which in a small job on CPU is "
        "most of its step without any loader problem; like regression_min_delta_s, a bottleneck worth an "
        "alert costs tens of milliseconds a step.", minimum=0.0)
    throttle_confirm: int = _setting(
        3, "perf/throttling: NVML samples in a row (gpu/throttle_reasons) with a thermal, hardware-slowdown "
        "or power-brake reason.", minimum=1)
    throughput_metrics: Tuple[str, ...] = _setting(
        ("tokens_per_s", "samples_per_s", "throughput/tokens_per_s", "throughput/samples_per_s",
         "train/tokens_per_second", "train_samples_per_second"),
        "Metric names that are a throughput the job logs (higher is better): judged by "
        "perf/throughput-regression beside the step time.")
    # --- exceptions -----------------------------------------------------------------------------
    incident_on_handled_exceptions: bool = _setting(
        False, "Open a process/exception incident for exceptions the job caught and reported "
        "(capture_exception); by default they only count in their cluster.")
    # --- error text -----------------------------------------------------------------------------
    log_text_incidents: bool = _setting(
        True, "Classify the text of log records (NCCL/gloo/CUDA errors a process prints, forwarded by the "
        "logging integration or an agent's log tailer) and open or join comm/* and memory/* incidents "
        "from them.")
    log_min_confidence: float = _setting(
        0.6, "Least classifier confidence (0..1) for a log record to open or join an incident; generic "
        "phrases score ~0.5, exact PyTorch/NCCL messages ~0.9. Exceptions always open an incident.",
        minimum=0.0, maximum=1.0)
    diagnosis_lr_high: float = _setting(
        0.1, "A learning rate at or above this, held constant or decaying (not a warmup), makes 'learning "
        "rate too high' a lead hypothesis of an explosion, a non-finite loss, a divergence or an "
        "oscillation: 10-100x the usual Adam/AdamW range, and the top of what plain SGD on normalised "
        "models runs at.",
        minimum=0.0)
    diagnosis_clip_stale_loss_rise: float = _setting(
        2.0, "A clip-stale incident whose rank's loss reached this many times its start (the lower of its "
        "first value and its first values' median; the highest finite loss the rank's kept history holds) "
        "ranks 'learning rate too high' first: a loss that went up while every step clipped was moved by "
        "updates too large for the model, and a higher clip threshold would let them through. 0: off.",
        minimum=0.0)
    amp_text_max_scale: float = _setting(
        1.0, "A job's log line saying its fp16 loss scale moved to this value or lower (DeepSpeed "
        "'OVERFLOW! ... reducing to S', fairseq 'setting loss scale to S', apex, a printed loss_scale) opens "
        "memory/amp-overflow for a job that sends no metrics; a healthy run prints a few overflows while its "
        "scaler calibrates from 2^16, but a scale at or below 1 no longer scales the gradients up at all.",
        minimum=0.0)
    amp_text_collapse_reductions: int = _setting(
        5, "Reductions of the fp16 loss scale in a row on one rank, each line's scale lower than the last "
        "one's (none grown back in between) and below amp_text_calibration_scale, that open "
        "memory/amp-overflow for a job that sends no metrics: a scaler halves on every overflowing step and "
        "skips it, so 5 in a row is a scale 32x under the usual 2^16 start, with that many steps skipped -- "
        "past the few halvings of a healthy calibration (DeepSpeed's hysteresis first, then 2-4 halvings).",
        minimum=1)
    amp_text_calibration_scale: float = _setting(
        65536.0, "Reductions of the fp16 loss scale to this value or above do not count towards "
        "amp_text_collapse_reductions: 2^16 is the usual initial scale (torch GradScaler, apex, DeepSpeed's "
        "initial_scale_power 16); halvings above it are the scaler searching down from a larger start "
        "(2^32).",
        minimum=0.0)
    aborts_together_timeout_ranks: int = _setting(
        1, "Distinct ranks a launcher reports ended by SIGABRT with no error of their own (torchrun's "
        "failure summary, 'failed (exitcode: -6)', 'Signal 6 (SIGABRT) received by PID', mp.spawn's "
        "'process N terminated with signal SIGABRT') at which the aborts are read as the NCCL watchdog's "
        "teardown after a collective timeout (comm/timeout) instead of memory/oom-or-cuda-error. 1 (the "
        "default): one rank's bare abort already is -- a CUDA OOM or CUDA error raised in Python exits 1 "
        "with its message, and every wild-corpus thread that settles a one-rank bare abort says a "
        "collective timed out (or the network under it failed); 2: only several ranks aborting on their own "
        "together (the launcher stops the others at the first failure, so they died at one collective's "
        "deadline). Never on a rank where CUDA is known not to be in use. 0: off (every bare abort stays "
        "memory/oom-or-cuda-error).", minimum=0)
    amp_text_overflow_notice: bool = _setting(
        True, "An fp16 overflow line that is no collapse (a scaler's calibration, a few skipped steps at a "
        "healthy scale, an overflow line naming no scale) opens memory/amp-overflow at severity info for a "
        "job that sends no metrics -- what the log shows, said as probably harmless, without making the run "
        "unhealthy; a collapse later on the run raises it to the kind's severity. False: such lines open "
        "nothing.")
    # --- evidence and history bounds --------------------------------------------------------------
    history_metrics: Tuple[str, ...] = _setting(
        ("lr", "opt/lr", "amp/*", "grad/clip_triggered", "time/step_s", "seq/*", "batch/*"),
        "Metrics kept in the per-rank history besides the loss and grad-norm metrics; 'prefix*' "
        "matches a prefix.")
    history_len: int = _setting(
        64, "Steps kept per (rank, metric) history series: at least the last history_len, at most twice "
        "as many (trimmed in bulk).", minimum=4)
    history_max_series: int = _setting(32, "Most history series per rank (first come).", minimum=1)
    evidence_window: int = _setting(
        20, "Values around the trigger kept in an evidence window.", minimum=1)
    max_evidence: int = _setting(
        20, "Evidence entries per incident; beyond it the entry in the middle goes, so the first ones "
        "(how it started) and the latest (how it goes) stay.",
        minimum=2)
    max_timeline: int = _setting(
        50, "Timeline entries per incident (same policy as max_evidence).", minimum=2)
    max_incident_ranks: int = _setting(4096, "Ranks and hosts listed per incident.", minimum=1)
    max_incidents_per_run: int = _setting(
        100, "Incidents per run; further ones are counted (incidents_suppressed), not opened.", minimum=1)
    # --- clusters -------------------------------------------------------------------------------
    cluster_max_members: int = _setting(
        100, "Runs, 'run:rank' entries and hosts listed per cluster (first seen first).", minimum=1)
    max_clusters: int = _setting(
        10_000, "Clusters kept in state, all projects together; beyond it the least recently seen cluster of "
        "the project holding the most clusters is evicted (never another project's).", minimum=1)
    sample_traceback_chars: int = _setting(
        8_000, "Characters of traceback kept in a cluster's sample (the innermost part).", minimum=0)
    # --- run state bounds -----------------------------------------------------------------------
    dedupe_ids_per_run: int = _setting(
        10_000, "Event ids remembered per run to drop replayed duplicates of exceptions, lifecycle, "
        "logs and alerts (plain metrics and heartbeats are idempotent by construction).", minimum=1)
    max_runs: int = _setting(
        10_000, "Runs kept in state, all projects together; beyond it a run of the project holding the most "
        "runs is evicted (never another project's): one of its ended runs, else its least recently active.",
        minimum=1)
    max_ranks_per_run: int = _setting(16_384, "Ranks tracked per run; events of further ranks are "
                                      "counted (ranks_dropped), not tracked.", minimum=1)
    ended_run_ttl_s: float = _setting(
        3600.0, "An ended run (every rank exited) is evicted this long after its last event.", minimum=0.0)
    idle_run_ttl_s: float = _setting(
        7 * 86400.0, "A run that never ended is evicted this long after its last event.", minimum=0.0)
    evicted_runs_remembered: int = _setting(
        10_000, "Evicted runs remembered, all projects together, so that late events for them are dropped "
        "rather than starting a new, partial record; shared fairly: when full, the project remembered most "
        "forgets its own oldest (docs/security.md H48).", minimum=0)
    # --- per-project quotas (issue 18: one project cannot evict another's live runs) ------------------
    project_max_runs: int = _setting(
        10_000, "Runs of one project kept in state; a new run beyond it evicts one of that project's own "
        "(an ended one, else its least recently active), counted as the project hitting its 'runs' quota.",
        minimum=1)
    project_max_clusters: int = _setting(
        10_000, "Stack-fingerprint clusters of one project kept in state; a new one beyond it evicts that "
        "project's least recently seen cluster (its record stays in the store).", minimum=1)
    project_max_incidents: int = _setting(
        100_000, "Incidents held in state for one project's runs; beyond it the project's least recently "
        "active other runs holding incidents are evicted (their records stay in the store).", minimum=1)
    project_max_state_bytes: int = _setting(
        1024 * 2**20, "Serialised state of one project's runs, as measured at the last incremental "
        "checkpoint; beyond it, at the next timer tick, the project's ended (then least recently active) "
        "runs are evicted until it fits.", minimum=1)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = type(_default_of(f))
            if (kind is float and type(value) is int) or (kind is tuple and type(value) is list):
                value = kind(value)  # as from_overrides takes them: the compiled engine reads floats, tuples
                object.__setattr__(self, f.name, value)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if lo is not None and value < lo:
                raise ValueError(f"detection setting {f.name} must be >= {lo}, got {value!r}")
            if hi is not None and value > hi:
                raise ValueError(f"detection setting {f.name} must be <= {hi}, got {value!r}")
        if self.stall_min_s > self.stall_max_s:
            raise ValueError(f"detection setting stall_min_s ({self.stall_min_s}) must be <= stall_max_s "
                             f"({self.stall_max_s})")
        object.__setattr__(self, "_history_memo", {})  # name -> keeps_history(name); not a field

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any], base: Optional[DetectionSettings] = None
                       ) -> DetectionSettings:
        """``base`` (default: the defaults) with ``overrides`` applied, flat (``{"leak_window": 64}``) or
        by section (``{"memory": {"leak_window": 64}}``, :data:`SECTIONS`). Raises ValueError naming the
        setting for an unknown name (with the closest known one), a setting under the wrong section, a
        value of the wrong type (booleans are not numbers; ints are accepted for floats; lists of
        strings for tuples) or out of range."""
        if not isinstance(overrides, Mapping):
            raise ValueError(f"detection overrides must be a mapping, got {type(overrides).__name__}")
        known = {f.name: f for f in fields(cls)}
        values = asdict(base) if base is not None else {}
        flat: List[Tuple[str, Any]] = []
        for name, value in overrides.items():
            if name in SECTIONS and isinstance(value, Mapping):
                for inner, inner_value in value.items():
                    if SECTION_OF.get(str(inner)) != name:
                        where = SECTION_OF.get(str(inner))
                        hint = f" (it is in {where!r})" if where else ""
                        raise ValueError(f"detection setting {inner!r} is not in section {name!r}{hint}")
                    flat.append((inner, inner_value))
            else:
                flat.append((name, value))
        for name, value in flat:
            if name not in known:
                close = difflib.get_close_matches(str(name), list(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown detection setting {name!r}{hint}")
            values[name] = _coerce_setting(name, _default_of(known[name]), value)
        return cls(**values)

    def overrides(self) -> Dict[str, Any]:
        """The settings that differ from the defaults (what a project configured)."""
        default = DetectionSettings()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def to_dict(self) -> Dict[str, Any]:
        """Every setting (tuples as lists), JSON-ready."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def documentation(cls) -> List[Tuple[str, Any, str]]:
        """``(name, default, doc)`` for every setting, in declaration order."""
        return [(f.name, _default_of(f), str(f.metadata.get("doc", ""))) for f in fields(cls)]

    # --- derived --------------------------------------------------------------------------------
    def stall_threshold_s(self, step_time_s: float) -> float:
        """clamp(stall_factor x step_time_s, stall_min_s, stall_max_s); stall_max_s when unknown (<= 0)."""
        if step_time_s <= 0:
            return self.stall_max_s
        return min(max(self.stall_factor * step_time_s, self.stall_min_s), self.stall_max_s)

    def is_loss(self, name: str) -> bool:
        return name in self.loss_metrics

    def is_grad_norm(self, name: str) -> bool:
        return name in self.grad_norm_metrics

    def keeps_history(self, name: str) -> bool:
        """Whether ``name`` gets a per-rank history series (loss, grad norm, or history_metrics)."""
        memo: Dict[str, bool] = self._history_memo  # type: ignore[attr-defined]
        known = memo.get(name)
        if known is not None:
            return known
        keep = name in self.loss_metrics or name in self.grad_norm_metrics or any(
            name.startswith(p[:-1]) if p.endswith("*") else name == p for p in self.history_metrics)
        if len(memo) < 4096:
            memo[name] = keep
        return keep


SECTIONS: Dict[str, Tuple[str, ...]] = {
    "common": ("loss_metrics", "grad_norm_metrics", "clip_threshold_metrics", "history_metrics", "trend_z",
               "confirm_checks", "evidence_window"),
    "loss_gradient": (
        "explosion_jump_factor", "explosion_window_steps", "explosion_min_points", "explosion_sustain",
        "explosion_climb_quantile", "explosion_trend_points", "explosion_onset_factor",
        "explosion_resolve_points", "explosion_recovered_level", "explosion_settled_spread",
        "explosion_settled_level", "explosion_diverged_points", "spike_factor", "spike_over_max",
        "spike_start_level", "spike_over_record", "spike_tail_power", "spike_tail_quantile", "spike_window",
        "spike_resolve_points", "loss_window",
        "loss_baseline_points",
        "oscillation_min_cv", "oscillation_min_level", "oscillation_noise_factor",
        "oscillation_calm_min_cv", "oscillation_max_rise", "oscillation_min_fall", "oscillation_min_serial",
        "oscillation_heavy_tail", "oscillation_iid_level", "oscillation_shape_new_factor",
        "oscillation_held_points",
        "plateau_min_level",
        "plateau_stalled_min_level", "plateau_grad_collapse", "plateau_max_change",
        "plateau_converged_level", "plateau_small_grad", "plateau_min_steps", "plateau_moved_min_steps",
        "plateau_resolve_drop",
        "divergence_factor",
        "divergence_min_points", "divergence_far_factor", "divergence_corroborated_points",
        "divergence_blowup_factor", "divergence_early_blowup_factor", "divergence_early_blowup_values",
        "divergence_beside_stale",
        "rise_smooth", "rise_min_fall", "rise_held_points", "rise_calm_min_fall",
        "rise_min_rise", "rise_min_points",
        "layer_norm_warn", "clip_rate_warn", "vanishing_ratio", "vanishing_min_layers",
        "vanishing_min_reports", "clip_stale_window", "clip_stale_norm_ratio", "clip_stale_curvature",
        "clip_stale_curve_window", "clip_stale_min_ratio", "clip_stale_growth", "clip_onset_growth",
        "clip_max_tau"),
    "memory": (
        "frag_mild", "frag_severe", "frag_sustain_samples", "frag_peak_headroom", "frag_warn",
        "frag_warn_std", "frag_window_s", "frag_min_samples", "frag_max_samples", "frag_update_step",
        "amp_overflow_consecutive", "amp_overflow_episodes", "amp_overflow_window", "amp_reserved_ratio",
        "amp_near_capacity_episodes", "frag_l2_rate", "frag_l2_split_share", "leak_window",
        "leak_min_samples", "leak_skip_samples", "leak_z", "leak_min_growth_bytes", "leak_min_growth_ratio",
        "leak_blocks", "leak_tail_z", "leak_peak_ratio", "leak_coarse_every", "context_leak_memory_ratio",
        "context_leak_allowance", "context_leak_samples"),
    "sequence": ("seq_window_checks", "seq_confirm_checks", "seq_pad_attended_max", "seq_mask_mismatch_max",
                 "seq_labels_on_pad_max", "seq_eos_cut_min_frac", "seq_eos_kept_min_frac"),
    "adapter": ("lora_grad_min", "lora_confirm_reports", "lora_loss_window", "lora_loss_min_points"),
    "progress": ("stall_factor", "stall_min_s", "stall_max_s", "lost_after_s"),
    "correlation": ("rank_lost_grace_s", "oom_explains_s", "device_fault_explains_s"),
    "perf": ("perf_warmup_steps", "perf_window", "perf_min_points", "straggler_ratio", "straggler_window",
             "straggler_steps", "straggler_noise_k", "straggler_shift_ratio", "straggler_shift_growth",
             "straggler_shift_peers_growth", "straggler_runqueue_share", "straggler_runqueue_steps",
             "straggler_runqueue_peers", "straggler_runqueue_ratio",
             "straggler_min_share", "straggler_wait_share", "straggler_hold_steps",
             "straggler_clear_steps", "straggler_confirm", "regression_ratio", "regression_min_delta_s",
             "regression_noise_k", "regression_baseline_steps",
             "regression_confirm", "regression_runqueue_share", "data_wait_share", "data_wait_min_s",
             "throttle_confirm",
             "throughput_metrics"),
    "process": ("incident_on_handled_exceptions", "log_text_incidents", "log_min_confidence",
                "amp_text_max_scale", "amp_text_collapse_reductions", "amp_text_calibration_scale",
                "amp_text_overflow_notice", "aborts_together_timeout_ranks"),
    "diagnosis": ("diagnosis_lr_high", "diagnosis_clip_stale_loss_rise"),
    "state": ("history_len", "history_max_series", "max_evidence", "max_timeline", "max_incident_ranks",
              "max_incidents_per_run", "cluster_max_members", "max_clusters", "sample_traceback_chars",
              "dedupe_ids_per_run", "max_runs", "max_ranks_per_run", "ended_run_ttl_s", "idle_run_ttl_s",
              "evicted_runs_remembered", "project_max_runs", "project_max_clusters", "project_max_incidents",
              "project_max_state_bytes"),
}
""":class:`DetectionSettings` by detector family: each detector reads its own section plus ``common``
(metric names, shared statistics) and ``state`` (the pipeline's bounds). Overrides may be given flat
(``{"leak_window": 64}``) or by section (``{"memory": {"leak_window": 64}}``)."""

SECTION_OF: Dict[str, str] = {name: section for section, names in SECTIONS.items() for name in names}


def _check_sections() -> None:
    names = [f.name for f in fields(DetectionSettings)]
    listed = [n for ns in SECTIONS.values() for n in ns]
    if sorted(names) != sorted(listed):
        missing = sorted(set(names) - set(listed))
        extra = sorted(set(listed) - set(names))
        raise AssertionError(f"SECTIONS must list every setting once: missing {missing}, unknown {extra}, "
                             f"repeated {sorted(n for n in set(listed) if listed.count(n) > 1)}")
    if set(SECTIONS) & set(names):
        raise AssertionError("a section may not share its name with a setting")


_check_sections()


def _default_of(f: Any) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def _coerce_setting(name: str, default: Any, value: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"detection setting {name} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"detection setting {name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"detection setting {name} must be a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"detection setting {name} must be finite, got {value!r}")
        return float(value)
    if isinstance(default, tuple):
        if isinstance(value, str) or not isinstance(value, Sequence) or \
                not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"detection setting {name} must be a list of non-empty strings, got {value!r}")
        return tuple(value)
    raise ValueError(f"detection setting {name}: unsupported type")  # pragma: no cover


def settings_table() -> List[Dict[str, Any]]:
    """The settings as rows ``{"name", "section", "default", "doc"}`` (the README table)."""
    return [{"name": n, "section": SECTION_OF[n], "default": d, "doc": doc}
            for n, d, doc in DetectionSettings.documentation()]


# ----------------------------------------------------------------------------------------------------
# The README's table, from the data

README_BEGIN = "<!-- catalogue table: generated from engine/src/trainguard_engine/data/catalogue.toml -->"
README_END = "<!-- end of catalogue table (python tools/catalogue_table.py rewrites it) -->"


def _show_default(name: str, value: Any) -> str:
    if isinstance(value, float) and name.endswith("_bytes") and value >= 2**20 and value % 2**20 == 0:
        return f"{value / 2**20:g} MiB"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _readme_rows() -> Dict[str, List[IncidentKind]]:
    """The kinds by README row (a kind without ``row`` is a row of its own), in catalogue order."""
    rows: Dict[str, List[IncidentKind]] = {}
    for k in _KIND_LIST:
        rows.setdefault(k.row or k.name, []).append(k)
    return rows


def readme_table() -> str:
    """The "What it detects" table: one row per ``row`` of the data (a kind alone when it has none), in
    catalogue order of the row's first kind with ``fires_when``; defaults read from
    :class:`DetectionSettings`, so a changed default changes the table."""
    defaults = DetectionSettings()
    rows = _readme_rows()
    lines = ["| kind | fires when | main defaults |", "|---|---|---|"]
    owners = [(next(k for k in members if k.fires_when), members) for members in rows.values()]
    for owner, members in sorted(owners, key=lambda om: _KIND_LIST.index(om[0])):
        others = sorted((k for k in members if k is not owner), key=lambda k: k.category != owner.category)
        names = [owner.name] + [k.subtype if k.category == owner.category else k.name for k in others]
        shown = ", ".join(f"`{s}` {_show_default(s, getattr(defaults, s))}" for s in owner.settings) or "—"
        cell = owner.fires_when.replace("|", "\\|")
        lines.append(f"| {', '.join(names)} | {cell} | {shown} |")
    return "\n".join(lines)


def _check_readme_rows() -> None:
    known = {f.name for f in fields(DetectionSettings)}
    for row, members in _readme_rows().items():
        owners = [k.name for k in members if k.fires_when]
        if len(owners) != 1:
            raise CatalogueError(f"{DATA_FILE}: row {row!r}: exactly one kind needs fires_when, got {owners}")
    for k in _KIND_LIST:
        unknown = [s for s in k.settings if s not in known]
        if unknown:
            raise CatalogueError(f"{DATA_FILE}: {k.name}: settings {unknown} are not DetectionSettings "
                                 f"fields")


_check_readme_rows()
