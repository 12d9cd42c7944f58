"""Classifier rules for Python-level text: autograd anomaly NaNs, model-side errors (device, index,
shape), DataLoader worker failures and ``Fatal Python error`` aborts."""

from __future__ import annotations

import re
from typing import Optional, Tuple

from ..catalogue import SIGNAL_NAMES
from .text import (
    _TYPE_RULES,
    Facts,
    _exit_kind,
    _Hit,
    _ints,
    _search,
    _shorten,
    _Text,
)

# ----------------------------------------------------------------------------------------------------
# Model-side errors and plain Python


_ANOMALY_RE = re.compile(
    r"Function '(?P<fn>\w{1,100})' returned nan values in its (?P<idx>\d+)(?:st|nd|rd|th) output")


_ANOMALY_WARNING_RE = re.compile(
    r"Error detected in (?P<fn>\w{1,100}Backward\w{0,8})\. Traceback of forward call that caused the error")
"""Anomaly mode's warning before it raises: ``[W python_anomaly_mode.cpp:N] Warning: Error detected in
DivBackward0. Traceback of forward call that caused the error:`` (the forward trace follows)."""
_EXCEPTION_LINE_RE = re.compile(r"^\s{0,8}[\w.]{0,80}(?:Error|Exception)\b: ", re.MULTILINE)


def _rule_anomaly_nan(t: _Text) -> Optional[_Hit]:
    pos = t.first("returned nan values in its")
    if pos < 0 or (found := _search(_ANOMALY_RE, t, pos, before=200, after=60)) is None:
        return _anomaly_warning(t)
    m = found[1]
    facts: Facts = {"function": m.group("fn"), "output_index": int(m.group("idx"))}
    return _Hit("gradient", "nan-source", 0.9, found[0] + m.start(), facts,
                f"Autograd anomaly: {facts['function']} produced NaN in its output {facts['output_index']}",
                "anomaly mode names the backward op that produced the first NaN; its forward is printed "
                "above as 'Traceback of forward call'")


def _anomaly_warning(t: _Text) -> Optional[_Hit]:
    """Anomaly mode's ``Error detected in XBackward0`` warning when the error it announces is not in the
    text (a paste cut after the forward trace): anomaly mode is switched on to hunt NaNs, and the NaN check
    is what raises in a backward op. When an exception line is in the text it decides instead (an in-place
    modification error prints the same warning)."""
    pos = t.first("error detected in")
    if pos < 0 or (found := _search(_ANOMALY_WARNING_RE, t, pos, before=10, after=160)) is None:
        return None
    if _EXCEPTION_LINE_RE.search(t.text) is not None:
        return None
    m = found[1]
    facts: Facts = {"function": m.group("fn"), "warning_only": True}
    return _Hit("gradient", "nan-source", 0.6, found[0] + m.start(), facts,
                f"Autograd anomaly: an error detected in {facts['function']} (the NaN check of anomaly mode; "
                "the error itself is not in the text)",
                "anomaly mode names the backward op that failed; its forward is printed below as 'Traceback "
                "of forward call'")


_DEVICE_PATTERNS: Tuple[Tuple[str, re.Pattern[str]], ...] = (
    ("expected all tensors to be on the same device", re.compile(
        r"Expected all tensors to be on the same device, but (?:found at least two devices, "
        r"(?P<a>[\w:]{1,20}) and (?P<b>[\w:]{1,20})|got (?P<arg>\w{1,60}) is on (?P<c>[\w:]{1,20}), "
        r"different from other tensors on (?P<d>[\w:]{1,20}))")),
    ("is not on the expected device", re.compile(
        r"Tensor on device (?P<a>[\w:]{1,20}) is not on the expected device (?P<b>[\w:]{1,20})")),
    ("and weight type", re.compile(
        r"Input type \((?P<a>[\w.]{1,60})\) and weight type \((?P<b>[\w.]{1,60})\) should be the same")),
    ("indices should be either on cpu or on the same device", re.compile(
        r"indices should be either on cpu or on the same device as the indexed tensor "
        r"\((?P<b>[\w:]{1,20})\)")),
)


def _rule_device_mismatch(t: _Text) -> Optional[_Hit]:
    for needle, pattern in _DEVICE_PATTERNS:
        pos = t.first(needle)
        if pos < 0 or (found := _search(pattern, t, pos, before=200, after=300)) is None:
            continue
        m = found[1]
        devices = [v for k, v in m.groupdict().items() if v and k != "arg"]
        facts: Facts = {"devices": devices}
        if m.groupdict().get("arg"):
            facts["argument"] = m.group("arg")
        meta = any(d == "meta" for d in devices)
        facts["meta"] = meta
        note = ("parameters on the meta device were never materialised (to_empty() / "
                "load_state_dict(assign=True) missing after building the model on 'meta')" if meta else
                "inputs and parameters live on different devices: move the batch (or the module) with "
                ".to(device)")
        return _Hit("process", "exception", 0.85, found[0] + m.start(), facts,
                    f"Device mismatch: {' vs '.join(devices)}", note)
    return None


_INDEX_PATTERNS: Tuple[Tuple[str, re.Pattern[str], str], ...] = (
    ("index out of range in self", re.compile(r"index out of range in self"),
     "an index >= the table size (embedding ids >= num_embeddings: tokenizer and model vocabulary disagree)"),
    ("is out of bounds for", re.compile(r"index (?P<index>-?\d+) is out of bounds for (?:dimension|axis) "
                                        r"(?P<dim>\d+) with size (?P<size>\d+)"),
     "an index outside the tensor's size in that dimension"),
    ("is out of bounds", re.compile(r"Target (?P<target>-?\d+) is out of bounds"),
     "a class target >= the number of classes (or negative, other than ignore_index)"),
)


def _rule_index(t: _Text) -> Optional[_Hit]:
    for needle, pattern, note in _INDEX_PATTERNS:
        for pos in t.find_all(needle):
            found = _search(pattern, t, pos, before=80, after=120)
            if found is None:
                continue
            m = found[1]
            facts: Facts = {k: int(v) for k, v in m.groupdict().items() if v is not None}
            return _Hit("process", "exception", 0.85, found[0] + m.start(), facts,
                        f"Index out of range: {_shorten(m.group(0), 120)}", note)
    return None


_SHAPE_PATTERNS: Tuple[Tuple[str, re.Pattern[str]], ...] = (
    ("shapes cannot be multiplied", re.compile(
        r"mat1 and mat2 shapes cannot be multiplied \((?P<a>\d+x\d+) and (?P<b>\d+x\d+)\)")),
    ("must match the size of tensor b", re.compile(
        r"The size of tensor a \((?P<a>\d+)\) must match the size of tensor b \((?P<b>\d+)\) at "
        r"non-singleton dimension (?P<dim>\d+)")),
    ("size mismatch for", re.compile(
        r"size mismatch for (?P<param>[\w.]{1,200}): copying a param with shape "
        r"(?P<a>torch\.Size\(\[[\d, ]{0,100}\]\)) from checkpoint, the shape in current model is "
        r"(?P<b>torch\.Size\(\[[\d, ]{0,100}\]\))")),
    ("is invalid for input of size", re.compile(
        r"shape '\[(?P<a>[-\d, ]{0,100})\]' is invalid for input of size (?P<b>\d+)")),
    ("to match target batch_size", re.compile(
        r"Expected input batch_size \((?P<a>\d+)\) to match target batch_size \((?P<b>\d+)\)")),
    ("channels instead", re.compile(
        r"expected input\[(?P<input>[\d, ]{0,100})\] to have (?P<a>\d+) channels, but got (?P<b>\d+) "
        r"channels instead")),
    ("inconsistent tensor size", re.compile(
        r"inconsistent tensor size, expected tensor \[(?P<a>[\d, ]{0,100})\] and src "
        r"\[(?P<b>[\d, ]{0,100})\]")),
    ("sizes of tensors must match", re.compile(
        r"Sizes of tensors must match except in dimension (?P<dim>\d+)\. Expected size (?P<a>\d+) but got "
        r"size (?P<b>\d+)")),
    ("size mismatch, m1:", re.compile(
        r"size mismatch, m1: \[(?P<a>[\d x]{1,40})\], m2: \[(?P<b>[\d x]{1,40})\]")),
)


def _rule_shape(t: _Text) -> Optional[_Hit]:
    best: Optional[_Hit] = None
    for needle, pattern in _SHAPE_PATTERNS:
        pos = t.first(needle)
        if pos < 0 or (best is not None and pos >= best.pos):
            continue
        found = _search(pattern, t, pos, before=200, after=400)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"pattern": needle, "shapes": [m.group("a"), m.group("b")]}
        for extra in ("dim", "param", "input"):
            if m.groupdict().get(extra):
                facts[extra] = int(m.group(extra)) if extra == "dim" else m.group(extra)
        best = _Hit("process", "exception", 0.85, found[0] + m.start(), facts,
                    f"Shape mismatch: {_shorten(m.group(0), 140)}",
                    "tensor shapes disagree with a layer or each other: compare the layer sizes in the model "
                    "config with the input features (and the checkpoint, when loading one)")
    return best


_WORKER_ERROR_RE = re.compile(r"Caught (?P<type>[\w.]{1,100}) in DataLoader worker process (?P<worker>\d+)")
_WORKER_DIED_RE = re.compile(r"DataLoader worker \(pids?\(?s?\)? (?P<pids>[\d, ]{1,200})\) "
                             r"(?:exited unexpectedly|is killed by signal: (?P<sig>[\w ]{1,40}))")


_WORKER_SIGNAL_NEEDLES = ("unexpected bus error encountered in worker",
                          "unexpected segmentation fault encountered in worker",
                          "unexpected floating-point exception encountered in worker",
                          "unexpected bus error encountered in dataloader worker",
                          "unexpected segmentation fault encountered in dataloader worker")
"""A DataLoader worker's own signal handler: torch's ``ERROR: Unexpected bus error encountered in worker.``,
Paddle's ``ERROR: Unexpected BUS error encountered in DataLoader worker. This might be caused by insufficient
shared memory (shm) ...`` (PaddlePaddle/PaddleOCR#9391; matched in lower case)."""


def _rule_dataloader(t: _Text) -> Optional[_Hit]:
    pos = t.first("in dataloader worker process")
    if pos >= 0 and (found := _search(_WORKER_ERROR_RE, t, pos, before=200, after=40)) is not None:
        m = found[1]
        facts: Facts = {"worker": int(m.group("worker")), "worker_exception": m.group("type")}
        head = f"\n{_bare(m.group('type'))}: "
        cut = t.text.find(head, pos, pos + 200_000)
        while cut >= 0 and (nxt := t.text.find(head, cut + 1, pos + 200_000)) >= 0:
            cut = nxt  # the innermost (last printed) exception line of the worker's traceback
        if cut >= 0:
            facts["worker_message"] = _shorten(t.line_at(cut + len(head)).split(": ", 1)[-1], 200)
        return _Hit("process", "exception", 0.8, found[0] + m.start(), facts,
                    f"{m.group('type')} in DataLoader worker {facts['worker']}"
                    + (f": {facts['worker_message']}" if "worker_message" in facts else ""),
                    "the dataset or collate_fn raised in a worker: the original traceback is in the message")
    pos = t.first(*_WORKER_SIGNAL_NEEDLES)
    if pos >= 0:
        what = "bus error" if t.lower.startswith("unexpected bus", pos) else \
            "segmentation fault" if t.lower.startswith("unexpected seg", pos) else "floating-point exception"
        return _Hit("process", "exit", 0.75, pos, {"signal": what},
                    f"DataLoader worker died of a {what}",
                    "a DataLoader worker crashed: a bus error is a too small /dev/shm (docker --shm-size, "
                    "fewer workers), a segfault a native library in the dataset or collate_fn")
    pos = t.first("dataloader worker (pid")
    if pos >= 0 and (found := _search(_WORKER_DIED_RE, t, pos, before=0, after=300)) is not None:
        m = found[1]
        facts = {"pids": _ints(m.group("pids"))}
        if m.group("sig"):
            facts["signal"] = m.group("sig").strip()
        note = ("a DataLoader worker died: 'Killed' is the host OOM-killer (too many workers x dataset "
                "copies), 'Bus error' a too small /dev/shm")
        signal = str(facts.get("signal", "")).lower()
        # a worker is a host process: SIGKILL is the OOM-killer; a crash by any other signal is the worker's
        # own (a segfault in a native decoder, a bus error from /dev/shm), never a CUDA abort. 'exited
        # unexpectedly' names no signal: the worker process ended without reporting an exception (a Python
        # error in a worker is re-raised as 'Caught X in DataLoader worker process N', read above), so it is
        # the process's abnormal exit too
        subtype = "killed" if signal == "killed" else "exit"
        return _Hit("process", subtype, 0.75, pos, facts,
                    "DataLoader worker died" + (f" ({facts['signal']})" if "signal" in facts else ""), note)
    return None


_FATAL_RE = re.compile(r"Fatal Python error: (?P<msg>[^\n]{1,200})")
_FATAL_SIGNALS = {"aborted": 6, "segmentation fault": 11, "bus error": 7, "floating point exception": 8,
                  "illegal instruction": 4}


def _rule_fatal(t: _Text) -> Optional[_Hit]:
    pos = t.first("fatal python error:")
    if pos < 0 or (found := _search(_FATAL_RE, t, pos, before=0, after=250)) is None:
        return None
    msg = found[1].group("msg").strip()
    sig = _FATAL_SIGNALS.get(msg.lower())
    facts: Facts = {"error": msg}
    if sig is None:  # Py_FatalError: the interpreter gives up and calls abort() -- the process is gone
        return _Hit("process", "exit", 0.6, pos, facts, f"Fatal Python error: {msg}",
                    "the interpreter aborted the process (Py_FatalError): an extension module corrupted "
                    "reference counts or the interpreter state; the faulthandler stack shows where")
    facts.update(signal=sig, signal_name=SIGNAL_NAMES.get(sig, str(sig)))
    category, subtype, _said = _exit_kind(128 + sig)
    return _Hit(category, subtype, 0.5, pos, facts, f"Fatal Python error: {msg} ({facts['signal_name']})",
                "a native crash; faulthandler printed the Python stack at the moment of the signal")


def _bare(exc_type: str) -> str:
    return exc_type.rsplit(".", 1)[-1]


_RAY_WRAPPED_RE = re.compile(r"\bRay(?:Task|Actor)Error\((?P<inner>[A-Za-z_][\w.]{0,120})\)(?::[ \t]*"
                             r"(?P<rest>[^\n]{0,300}))?")
"""Ray's error for a remote task or actor method that raised, printed with the task's exception class in
parentheses (``ray.exceptions.RayTaskError(OutOfMemoryError): ray::DTensorPolicyWorkerV2.get_logprobs()
(pid=..., repr=DTensorPolicyWorkerV2[rank=0])``, NVIDIA-NeMo/RL#3793): that class is the worker's own
error, whose message the paste may not hold."""


def _rule_ray_wrapped(t: _Text) -> Optional[_Hit]:
    pos = t.first("raytaskerror(", "rayactorerror(")
    if pos < 0 or (found := _search(_RAY_WRAPPED_RE, t, pos, before=3, after=400)) is None:
        return None
    m = found[1]
    inner = m.group("inner")
    bare = _bare(inner)
    rule = next((r for r, _pattern in _TYPE_RULES if inner in r.types or bare in r.types), None)
    if rule is None:
        return None  # a generic class (RuntimeError): the worker's traceback and message say what it was
    facts: Facts = {"exc_type": inner, "wrapper": "ray"}
    rest = (m.group("rest") or "").strip()
    headline = f"{inner} in a Ray task" + (f": {_shorten(rest, 120)}" if rest else "")
    return _Hit(rule.category, rule.subtype, min(rule.confidence, 0.85), found[0] + m.start(), facts,
                headline, "Ray wrapped the remote task's exception (its class in parentheses): read it as "
                "that exception of the worker named after ray::")


GATES = {
    "autograd.anomaly-nan": ("returned nan values in its", "error detected in"),
    "model.device-mismatch": tuple(needle for needle, _pattern in _DEVICE_PATTERNS),
    "model.index-out-of-range": tuple(needle for needle, _pattern, _note in _INDEX_PATTERNS),
    "model.shape-mismatch": tuple(needle for needle, _pattern in _SHAPE_PATTERNS),
    "dataloader.worker": ("in dataloader worker process", *_WORKER_SIGNAL_NEEDLES, "dataloader worker (pid"),
    "python.fatal-error": ("fatal python error:",),
    "ray.task-error": ("raytaskerror(", "rayactorerror("),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    'autograd.anomaly-nan': (
        "``Function 'X' returned nan values in its Nth output`` → gradient/nan-source; anomaly mode's "
        "warning ``Error detected in XBackward0. Traceback of forward call that caused the error`` alone (no "
        "exception line in the text: the paste cut before the error) → gradient/nan-source"
    ),
    'model.device-mismatch': 'tensors on different devices (incl. ``meta``) → process/exception',
    'model.index-out-of-range': (
        '``index out of range in self``, ``index i is out of bounds ...``, ``Target t is out of bounds`` '
        '→ process/exception'
    ),
    'model.shape-mismatch': (
        '``mat1 and mat2 shapes cannot be multiplied``, size mismatches → process/exception'
    ),
    'dataloader.worker': (
        '``Caught X in DataLoader worker process N`` → process/exception; a worker ``killed by signal: '
        'Killed`` → process/killed, by another signal (segfault, bus error, also PyTorch\'s ``Unexpected bus '
        'error encountered in worker`` and Paddle\'s ``Unexpected BUS error encountered in DataLoader '
        'worker``) or ``DataLoader worker (pid(s) N) exited unexpectedly`` (no signal named: the worker '
        'process ended without an exception of its own) → process/exit'
    ),
    'python.fatal-error': (
        '``Fatal Python error: Aborted|Segmentation fault|...`` → by the exit decision path for that '
        'signal; any other fatal error (``none_dealloc: deallocating None``, ...: the interpreter aborts) '
        '→ process/exit'
    ),
    'type:<name>': '(with ``exc_type``) :data:`~trainguard_engine.catalogue.EXCEPTION_RULES`',
    'frames.process-group-init': (
        '(``classify_chain`` given the exception\'s frames) a generic exception, or a peer reset / timeout / '
        'comm failure, raised inside ``init_process_group``, ``new_group``, rendezvous or store creation or '
        'DeepSpeed\'s ``init_distributed``, or the model-parallel / serving stacks\' set-up '
        '(``initialize_model_parallel``, ``init_model_parallel_group``, ``init_distributed_environment``, '
        'a pynccl wrapper\'s ``ncclCommInitRank``), or a peer reset / timeout / comm failure (not a '
        'generic exception: ``KeyError: \'RANK\'`` stays process/exception) raised inside a program\'s '
        'start-up function (``init_distributed_mode``, mmcv\'s ``init_dist``, Paddle\'s '
        '``init_parallel_env``) → comm/init-failure'
    ),
    'ray.task-error': (
        "Ray's ``RayTaskError(<Class>)`` / ``RayActorError(<Class>)`` when the class is one an "
        "exception-type rule names (``RayTaskError(OutOfMemoryError): ray::Worker.method() ...``) → that "
        "rule's kind (a generic class: no match, the worker's traceback decides)"
    ),
    'python.exception': 'any other printed Python traceback → process/exception',
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
