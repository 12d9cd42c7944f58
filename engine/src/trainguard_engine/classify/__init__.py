"""The error-text classifier: what a piece of error text means, as a catalogue kind with parsed facts.

::

    c = classify_text(log_tail)                       # Classification | None
    c = classify_exception("torch.OutOfMemoryError", message)   # always a Classification
    c.kind, c.rule, c.confidence, c.facts, c.headline, c.lines

**Contract.**

* *Input*: any text -- one log line, a log tail, an exception message, a whole stderr capture; launcher
  prefixes (``[rank1]:``, ``[default0]:``) are stripped in place (a multi-line C++ message carries the
  prefix on its first line only) and name the rank when the text itself does not; ``\\r\\n`` and ``\\r``
  are newlines. Texts longer than :data:`MAX_TEXT_CHARS` are read as their first
  :data:`HEAD_CHARS` and the rest of the budget from the end (errors come last).
* *Output*: ``None`` when nothing in the text is recognised (a plain log line, garbage); otherwise the
  :class:`Classification` of the **most causal** rule that matched (the order of :data:`RULES`: a launcher
  summary naming the root cause, then memory and CUDA errors, then collective mismatches, then timeouts and
  lost peers, then generic communication and rendezvous errors, then model-side errors, then numerical
  failures stated in words, then a plain Python traceback). Facts of the enriching rules
  (:data:`ENRICHING_RULES`: desync report, PG status, flight recorder stack, monitored barrier) of the same
  category are merged in; the names of the other rules that matched are in ``also``. Exceptions are read
  as Python prints them, ``"Type: message"``.
* ``category``/``subtype`` are always a row of :data:`trainguard_engine.catalogue.KINDS`. Model-side errors
  (shape / device / index) stay ``process/exception``: they are ordinary Python exceptions whose triage is
  the traceback; the ``rule`` (``model.shape-mismatch`` ...) and ``facts`` say which, and the incident
  summary carries the specific advice. An index error *on CUDA* surfaces as a device-side assert and is
  ``memory/cuda-error`` (the DESIGN puts device-side asserts in the memory category).
* *Facts* are JSON-ready (str, int, float, bool, None, lists, dicts with str keys); sizes are bytes.
* *Bounded and linear*: every regex is precompiled and applied only to a bounded window around an
  occurrence of a literal needle (found with ``str.find``), at most :data:`MAX_HITS` occurrences per
  needle; no pattern starts with an unbounded wildcard. A 1 MB line costs a few ``find`` passes.
* *One shared pre-scan*: each rule lists its needles (:data:`GATES`); a text is scanned once for all of
  them (:data:`SCAN`, ``_Text.present``), a rule none of whose needles occurs is not run, and the rules'
  own needle look-ups are answered from the scan (tests/engine/test_classify_prescan.py: no result
  changes with it on or off, on every line and log of the wild corpus).
* Pure: no I/O, stdlib only.

**Rules**: one module per source -- :mod:`.cuda`, :mod:`.nccl`, :mod:`.gloo`, :mod:`.c10d`,
:mod:`.torchrun`, :mod:`.rpc`, :mod:`.horovod`, :mod:`.hccl`, :mod:`.tfcollective`, :mod:`.python`,
:mod:`.numeric` -- each rule
with its text (:data:`RULE_DOCS`), in one ordered list
(:data:`RULES`); the table of what each recognises is docs/classifier.md, written from them by
``python tools/classifier_table.py`` (a test keeps it in sync). The shared machinery is
:mod:`.text`.

Survivors' views follow the fixtures: gloo ``Connection reset by peer`` is what a rank sees when its peer
aborted (``gloo_size_mismatch_peer.txt``: the peer died of a gloo enforce failure) or was SIGKILLed, so it
is ``comm/rank-lost``; ``Timed out waiting ... for recv`` is what ranks see of a live straggler
(``gloo_timeout_rank*.txt``), so it is ``comm/timeout``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from trainguard.core.tracebacks import parse_traceback_text

from . import c10d, cuda, gloo, hccl, horovod, nccl, numeric, python, rpc, tfcollective, torchrun, vocab
from .c10d import (
    _rule_collective_mismatch,
    _rule_desync_report,
    _rule_rendezvous,
)
from .cuda import (
    _rule_cuda_error,
    _rule_cuda_error_cut,
    _rule_cuda_oom,
    _rule_cuda_oom_plain,
    _rule_device_assert,
    _rule_rocm_fault,
    _rule_xid,
    format_size,
    parse_size,
)
from .gloo import (
    _rule_gloo_connect,
    _rule_gloo_peer_lost,
    _rule_gloo_size_mismatch,
    _rule_gloo_timeout,
    _rule_monitored_barrier,
)
from .nccl import (
    _rule_dump_signal,
    _rule_heartbeat_stuck,
    _rule_ib_error,
    _rule_nccl_comm_aborted,
    _rule_nccl_debug,
    _rule_nccl_error,
    _rule_nccl_watchdog,
    _rule_watchdog_status,
    _rule_watchdog_teardown,
)
from .numeric import (
    _rule_check_numerics,
    _rule_grad_norm_non_finite,
    _rule_loss_non_finite,
    _rule_loss_scale,
    _rule_loss_scale_minimum,
)
from .python import (
    _bare,
    _rule_anomaly_nan,
    _rule_dataloader,
    _rule_device_mismatch,
    _rule_fatal,
    _rule_index,
    _rule_ray_wrapped,
    _rule_shape,
)
from .text import (
    _TYPE_RULES,
    MAX_LINE_CHARS,
    MAX_LINES,
    MAX_TEXT_CHARS,
    TRACEBACK_TAIL_CHARS,
    Classification,
    Facts,
    _first_line,
    _Hit,
    _rank_of,
    _ranks_text,
    _Rule,
    _shorten,
    _Text,
)
from .torchrun import (
    _rule_launcher_signal,
    _rule_torchrun,
    _rule_worker_failed,
    launcher_teardown,
)

# ----------------------------------------------------------------------------------------------------
# The engine


RULES: Tuple[Tuple[str, _Rule], ...] = (
    ("cuda.oom", _rule_cuda_oom),
    ("cuda.oom-plain", _rule_cuda_oom_plain),
    ("cuda.device-assert", _rule_device_assert),
    ("rocm.gpu-fault", _rule_rocm_fault),
    ("nvidia.xid", _rule_xid),
    ("cuda.error", _rule_cuda_error),
    ("c10d.collective-mismatch", _rule_collective_mismatch),
    ("gloo.size-mismatch", _rule_gloo_size_mismatch),
    ("horovod.mismatch", horovod._rule_mismatch),
    ("tensorflow.collective-shape-mismatch", tfcollective._rule_shape_mismatch),
    ("nccl.watchdog-timeout", _rule_nccl_watchdog),
    ("hccl.timeout", hccl._rule_hccl_timeout),
    ("c10d.desync-report", _rule_desync_report),
    ("gloo.monitored-barrier", _rule_monitored_barrier),
    ("nccl.dump-signal", _rule_dump_signal),
    ("nccl.watchdog-status", _rule_watchdog_status),
    ("nccl.error", _rule_nccl_error),
    ("nccl.comm-aborted", _rule_nccl_comm_aborted),
    ("nccl.debug", _rule_nccl_debug),
    ("gloo.timeout", _rule_gloo_timeout),
    ("gloo.peer-lost", _rule_gloo_peer_lost),
    ("horovod.shut-down", horovod._rule_shut_down),
    ("rpc.tensorpipe-agent", rpc._rule_tensorpipe_agent),
    ("xla.coordination", rpc._rule_coordination),
    ("c10d.rendezvous", _rule_rendezvous),
    ("gloo.connect", _rule_gloo_connect),
    ("nccl.ib-error", _rule_ib_error),
    ("nccl.watchdog-teardown", _rule_watchdog_teardown),
    ("nccl.heartbeat-stuck", _rule_heartbeat_stuck),
    ("autograd.anomaly-nan", _rule_anomaly_nan),
    ("model.device-mismatch", _rule_device_mismatch),
    ("model.index-out-of-range", _rule_index),
    ("model.shape-mismatch", _rule_shape),
    ("dataloader.worker", _rule_dataloader),
    ("numeric.loss-scale-minimum", _rule_loss_scale_minimum),
    ("numeric.check-numerics", _rule_check_numerics),
    ("numeric.grad-norm-non-finite", _rule_grad_norm_non_finite),
    ("numeric.loss-non-finite", _rule_loss_non_finite),
    ("numeric.loss-scale", _rule_loss_scale),
    ("torchrun.worker-failed", _rule_worker_failed),
    ("launcher.signal", _rule_launcher_signal),
    ("python.fatal-error", _rule_fatal),
    ("ray.task-error", _rule_ray_wrapped),
    ("cuda.error-cut", _rule_cuda_error_cut),
)
"""The text rules, most causal first (after ``torchrun.child-failed``, which is tried before all of them)."""

GATES: Dict[str, FrozenSet[str]] = {
    name: frozenset(needles) for name, needles in {
        **torchrun.GATES, **cuda.GATES, **c10d.GATES, **nccl.GATES, **gloo.GATES, **python.GATES,
        **numeric.GATES, **rpc.GATES, **horovod.GATES, **hccl.GATES, **tfcollective.GATES}.items()}
"""Each rule's needles (lower case): a rule cannot match a text in which none of them occurs."""
SCAN: FrozenSet[str] = frozenset().union(*GATES.values())
"""Every needle of :data:`GATES`: what the shared pre-scan of a text looks for (``_Text.present``)."""
_GATED: Tuple[Tuple[str, _Rule, FrozenSet[str]], ...] = ()
PRESCAN = True
"""Skip rules by the pre-scan (a switch for the test that proves it changes no result, and for benchmarks)."""
VOCABULARY = True
"""Consult the vocabulary fallback (:mod:`.vocab`) where no specific rule matched (a switch for the tests
that prove it moves no specific reading, and for A/B measurements)."""

RULE_DOCS: Dict[str, str] = {**torchrun.DOCS, **cuda.DOCS, **c10d.DOCS, **nccl.DOCS, **gloo.DOCS,
                             **rpc.DOCS, **horovod.DOCS, **hccl.DOCS, **tfcollective.DOCS, **python.DOCS,
                             **numeric.DOCS, **vocab.DOCS}
"""What each rule recognises (``type:<name>`` and ``python.exception`` are the fallbacks of
:func:`classify_exception`), from the rule modules; the table in docs/classifier.md is rendered from it in
the order rules are tried (:func:`rules_table`)."""

FIRST_RULE = "torchrun.child-failed"
"""Tried before :data:`RULES`: a launcher summary names the root cause."""
FRAMES_RULE = "frames.process-group-init"
VOCAB_RULES = tuple(vocab.PREFIX + name for name in vocab.PRECEDENCE)
"""The vocabulary fallback (:mod:`.vocab`): consulted only where the answer would be nothing or
``python.exception``."""
FALLBACKS = ("type:<name>", FRAMES_RULE, torchrun.SUMMARY_CUT_RULE, torchrun.TEARDOWN_RULE,
             *VOCAB_RULES, "python.exception")
"""What an exception is when no text rule matched: by its type, else by the general vocabulary of its
message, else a plain Python exception."""


def rules_table() -> str:
    """docs/classifier.md's table: every rule in the order it is tried, with what it recognises."""
    order = [FIRST_RULE, *(name for name, _rule in RULES), *FALLBACKS]
    lines = ["| rule | recognises → kind |", "|---|---|"]
    lines += [f"| `{name}` | {RULE_DOCS[name].replace('|', chr(92) + '|')} |" for name in order]
    return "\n".join(lines)


def _check_docs() -> None:
    order = {FIRST_RULE, *(name for name, _rule in RULES), *FALLBACKS}
    if order != set(RULE_DOCS):
        raise AssertionError(f"rules without a doc: {sorted(order - set(RULE_DOCS))}; "
                             f"docs without a rule: {sorted(set(RULE_DOCS) - order)}")
    if set(GATES) != order - set(FALLBACKS):
        raise AssertionError(f"rules without gate needles: {sorted(order - set(FALLBACKS) - set(GATES))}")


_check_docs()
_GATED = tuple((name, rule, GATES[name]) for name, rule in RULES)
_CHILD_FAILED_GATE = GATES[FIRST_RULE]

__all__ = [
    "FALLBACKS",
    "FIRST_RULE",
    "INIT_FUNCTIONS",
    "MAX_LINE_CHARS",
    "MAX_TEXT_CHARS",
    "RULES",
    "RULE_DOCS",
    "VOCAB_RULES",
    "Classification",
    "classify_chain",
    "classify_exception",
    "classify_text",
    "format_size",
    "parse_size",
    "rules_table",
]


ENRICHING_RULES = frozenset({"nccl.watchdog-status", "nccl.dump-signal", "c10d.desync-report",
                             "gloo.monitored-barrier"})
"""Rules whose facts (lagging ranks, PG status, the collective's call stack) are added to a primary
classification of the same category; facts of other rules that matched are never mixed in."""


def _merge(primary: _Hit, hits: Sequence[_Hit], t: _Text) -> Tuple[Facts, Tuple[str, ...], Tuple[str, ...]]:
    facts = dict(primary.facts)
    positions = [primary.pos, *primary.extra_lines]
    also = []
    for hit in hits:
        if hit is primary:
            continue
        if hit.rule in ENRICHING_RULES and hit.category == primary.category:
            for key, value in hit.facts.items():
                facts.setdefault(key, value)
            positions.extend([hit.pos, *hit.extra_lines])
        if not hit.supporting:
            also.append(hit.rule)
    lines: List[str] = []
    for pos in positions:
        if pos < 0:
            continue
        line = t.line_at(pos)
        if line and line not in lines:
            lines.append(line)
        if len(lines) >= MAX_LINES:
            break
    return facts, tuple(lines), tuple(also)


_SPAWN_RE = re.compile(r"-- Process (?P<rank>\d+) terminated with the following error:")
"""``torch.multiprocessing.spawn`` names the failed process (its index is the rank it was given)."""


def _classify(text: str, exc_type: str, depth: int) -> Optional[Classification]:
    if not text and not exc_type:
        return None
    prescan = PRESCAN
    t = _Text(text, SCAN if prescan else frozenset())
    present = t.present
    hits: List[_Hit] = []
    skip = prescan and _CHILD_FAILED_GATE.isdisjoint(present)
    torchrun = _rule_torchrun(t, depth) if not skip else None
    if torchrun is not None:
        torchrun.rule = "torchrun.child-failed"
        hits.append(torchrun)
    for name, rule, gate in _GATED:
        if prescan and gate.isdisjoint(present):
            continue
        hit = rule(t)
        if hit is not None:
            hit.rule = name
            hits.append(hit)
    primary = next((h for h in hits if not h.supporting), None)
    if primary is not None:
        facts, lines, also = _merge(primary, hits, t)
        if "rank" not in facts and primary.rule != "torchrun.child-failed":
            if _rank_of(t, primary.pos, facts) is None and (spawn := _SPAWN_RE.search(t.text)) is not None:
                facts["rank"] = int(spawn.group("rank"))
        headline = primary.headline
        if primary.category == "comm" and primary.subtype == "timeout" and "lagging_ranks" in facts \
                and "lagging" not in headline and "did not reach" not in headline:
            headline += f"; lagging rank(s) {_ranks_text(facts['lagging_ranks'])}"
        return Classification(primary.category, primary.subtype, primary.rule, primary.confidence, headline,
                              facts, lines, primary.note, also)
    if exc_type:
        prefix = f"{exc_type}: "
        by_type = _by_type(exc_type, text[len(prefix):] if text.startswith(prefix) else text)
        if by_type is not None:
            return by_type
    found = _python_traceback(text, depth)
    if found is None:
        return launcher_teardown(text)  # DeepSpeed's launcher stopping its workers, nothing more
    spawn = _SPAWN_RE.search(text[:4096]) if found is not None and "rank" not in found.facts else None
    if found is not None and spawn is not None:
        # the traceback inside mp.spawn's message is the failed process's: it is the rank spawn names
        found = dataclasses.replace(found, facts={**found.facts, "rank": int(spawn.group("rank"))})
    return found


def _by_type(exc_type: str, message: str) -> Optional[Classification]:
    """The first :data:`~trainguard_engine.catalogue.EXCEPTION_RULES` row naming ``exc_type`` (qualified or
    bare) or whose pattern matches the message's first 4096 characters."""
    bare = _bare(exc_type)
    for rule, pattern in _TYPE_RULES:
        named = exc_type in rule.types or bare in rule.types
        if named or (pattern is not None and pattern.search(message[:4096])):
            line = _first_line(message)
            headline = f"{exc_type}: {_shorten(line, 140)}" if line else exc_type
            if (rule.category, rule.subtype) == ("memory", "oom"):
                headline = f"CUDA out of memory ({exc_type})" if not line else headline
            return Classification(rule.category, rule.subtype, f"type:{bare}", rule.confidence, headline,
                                  {"exc_type": exc_type}, (f"{exc_type}: {line}" if line else exc_type,))
    return None


def _python_traceback(text: str, depth: int) -> Optional[Classification]:
    tail = text[-TRACEBACK_TAIL_CHARS:]
    if "Traceback (most recent call last)" not in tail and "terminate called after throwing" not in tail:
        return None
    start = tail.find("\n") + 1 if len(text) > TRACEBACK_TAIL_CHARS else 0
    parsed = [e for e in parse_traceback_text(tail[start:]) if e.relation == ""]
    if not parsed or depth >= 2:
        return None
    last = parsed[-1]
    if not last.exc_type or (not last.message.strip() and "Traceback (most recent call last)" not in tail):
        return None  # a bare "terminate called after throwing an instance of 'X'" says nothing more
    return _classify_exception(last.exc_type, last.message, depth + 1)


def _classify_exception(exc_type: str, message: str, depth: int) -> Classification:
    # read as Python prints it ("Type: message"), so rules may see the type ("Fatal Python error: ...")
    text = f"{exc_type}: {message}" if exc_type and not exc_type.startswith("<") else message
    found = _classify(text, exc_type, depth) if depth < 3 else None
    if found is not None:
        return found
    if _bare(exc_type) == "ChildFailedError":
        return torchrun.summary_without_root(exc_type, message)
    line = _first_line(message)
    if VOCABULARY and (worded := vocab.classify_fallback(f"{exc_type}: {line}", exception=True)) is not None:
        return worded  # the exception line itself: what follows it in a pasted text is not its message
    headline = f"{exc_type}: {_shorten(line, 140)}" if line else exc_type
    facts: Facts = {"exc_type": exc_type}
    if (spawn := _SPAWN_RE.search(message[:4096])) is not None:
        facts["rank"] = int(spawn.group("rank"))  # mp.spawn names the process that raised
    return Classification("process", "exception", "python.exception", 0.8, headline, facts,
                          (f"{exc_type}: {_shorten(line, MAX_LINE_CHARS)}" if line else exc_type,),
                          "a Python exception: read the traceback from its innermost in-app frame")


def classify_text(text: str, *, exc_type: str = "") -> Optional[Classification]:
    """The classification of ``text`` (see the module docstring), or None when nothing is recognised.

    ``exc_type`` (the exception's type, qualified or bare) lets the exception-type rules decide when no
    text rule matches. A printed Python traceback with no specific rule gives ``process/exception``
    (or its type's rule). Never raises on any string."""
    found = _classify(text or "", exc_type or "", 0)
    if found is None and VOCABULARY:
        found = vocab.classify_fallback(text or "")
    return found


def classify_exception(exc_type: str, message: str) -> Classification:
    """The classification of an exception: :func:`classify_text` of its message with its type, else
    ``process/exception`` (rule ``python.exception``). Always returns one."""
    return _classify_exception(exc_type or "<unknown exception>", message or "", 0)


_INIT_FUNCTIONS = frozenset({
    "init_process_group", "new_group", "_new_group_with_tag", "_store_based_barrier", "_create_c10d_store",
    "_env_rendezvous_handler", "_tcp_rendezvous_handler", "_file_rendezvous_handler", "init_distributed",
    "init_device_mesh", "_create_tcp_store", "ncclCommInitRank", "initialize_model_parallel",
    "init_model_parallel_group", "init_distributed_environment"})
"""Functions of torch.distributed (and DeepSpeed's ``init_distributed``) that set a process group up
(``_create_tcp_store``: torchelastic's c10d rendezvous backend creating its store), and the serving and
model-parallel stacks' own: Megatron's / vLLM's / SGLang's ``initialize_model_parallel``,
``init_model_parallel_group``, ``init_distributed_environment``, and their pynccl wrapper's
``ncclCommInitRank`` (sgl-project/sglang#4289: ``NCCL error: unhandled system error`` raised there). Any
exception raised inside one is the group not coming up."""
INIT_FUNCTIONS = _INIT_FUNCTIONS
_PROGRAM_INIT_FUNCTIONS = frozenset({"init_distributed_mode", "init_dist", "init_parallel_env"})
"""A program's own distributed start-up function by the names the common code bases give it -- the DeiT /
MAE family's ``init_distributed_mode`` (its ``barrier()`` is the first collective: NVIDIA/nccl#1546), mmcv's
``init_dist``, Paddle's ``init_parallel_env``. Their bodies also read the environment, pick the device and set
the start method, so only a comm error raised in one (an NCCL / gloo failure, a peer reset, a timeout:
:data:`_AT_INIT`, not the generic fallback) is the group not coming up; any other exception there
(``KeyError: 'RANK'``, ``ZeroDivisionError`` from ``rank % num_gpus`` with no GPU visible, ``context has
already been set``) stays what it is (hR's review, stop 45, F6)."""
_AT_INIT = (("comm", "rank-lost"), ("comm", "timeout"), ("comm", "failure"))
"""What a peer's reset, a timeout or a generic NCCL/gloo failure is when it happens while the group is being
set up: the group never came up (comm/init-failure), not a peer lost mid-training."""


def _init_frame(frames: Sequence[Mapping[str, Any]], names: frozenset = _INIT_FUNCTIONS) -> str:
    """The innermost process-group set-up function (one of ``names``) among ``frames``
    (``{"function": ...}``), or ``""``."""
    for frame in reversed(list(frames)[-128:]):
        function = frame.get("function") if isinstance(frame, Mapping) else None
        if isinstance(function, str) and function in names:
            return function
    return ""


def classify_chain(exc_type: str, message: str, chain: Sequence[Mapping[str, Any]] = (),
                   frames: Sequence[Mapping[str, Any]] = ()) -> Classification:
    """:func:`classify_exception` of the exception, unless it is a generic ``process/exception`` and one
    of its chained causes/contexts (``[{"type", "message"}]``) classifies as comm/* or memory/*: then that
    one (with ``facts["via_chain"]`` naming its type), so a wrapper exception does not hide an OOM.

    ``frames`` (the exception's own, ``[{"function", ...}]``, outermost first): a generic exception or a
    peer reset / timeout / comm failure raised inside a process-group set-up function (``init_process_group``,
    ``new_group``, rendezvous and store creation, DeepSpeed's ``init_distributed``) is comm/init-failure
    (rule ``frames.process-group-init``, ``facts["raised_in"]``): ``RuntimeError: Connection reset by peer``
    from ``init_process_group`` is a group that never came up."""
    top = classify_exception(exc_type, message)
    init = _init_frame(frames) if frames else ""
    generic = top.rule == "python.exception" or top.rule.startswith(vocab.PREFIX)
    if not init and frames and not generic and (top.category, top.subtype) in _AT_INIT:
        init = _init_frame(frames, _PROGRAM_INIT_FUNCTIONS)
    if init and (generic or (top.category, top.subtype) in _AT_INIT):
        facts = dict(top.facts)
        facts.update(raised_in=init, was=f"{top.category}/{top.subtype}")
        note = (f"raised while the process group was being set up ({init}): the group never came up -- "
                "check MASTER_ADDR/PORT, that every rank started, and the network between the nodes")
        return Classification("comm", "init-failure", FRAMES_RULE, 0.6,
                              f"{_shorten(top.headline, 160)} (raised in {init})", facts, top.lines, note)
    if not generic:
        return top
    for link in list(chain)[:16]:
        if not isinstance(link, Mapping):
            continue
        link_type, link_message = str(link.get("type") or ""), str(link.get("message") or "")
        found = classify_text(link_message, exc_type=link_type)
        if found is not None and found.category in ("comm", "memory") \
                and not found.rule.startswith(vocab.PREFIX):
            facts = dict(found.facts)
            facts["via_chain"] = link_type
            return Classification(found.category, found.subtype, found.rule, found.confidence, found.headline,
                                  facts, found.lines, found.note, found.also)
    return top
