"""Classifier rules for numerical failures a job states in words: a loss or a gradient norm printed as
NaN/Inf (progress lines, dicts, framework guards), the fp16 loss scale collapsing (DeepSpeed, apex,
fairseq) or at its minimum. A job that sends no metrics still says these things in its log.

The scale rules only parse: their facts carry the scale the job moved to (``scale``); whether that is a
collapse is the process detector's call (``amp_text_max_scale``), since a healthy fp16 run also prints a
few overflows while its scaler calibrates.
"""

from __future__ import annotations

import re
from typing import Optional

from .text import Facts, _Hit, _on_rank, _rank_of, _search, _Text

_NONFINITE = r"['\"`]?(?P<value>nan|[-+]?inf(?:inity)?)\b"
_LOSS_KEY = r"\b(?P<key>[a-z0-9_./]{0,40}loss[a-z0-9_./]{0,40})"
_LOSS_RE = re.compile(
    _LOSS_KEY + r"\]?['\"]?\s{0,4}(?:[:=]\s{0,8}|\s(?:is|was|became|becomes)\s{1,4}|\s{1,8})(?:tensor\()?"
    + _NONFINITE, re.IGNORECASE)
"""``loss: nan``, ``'loss': nan``, ``loss=nan``, ``[Loss] nan``, ``Loss is nan``,
``loss_cls': tensor(nan``."""
_LOSS_BECAME_RE = re.compile(r"\bloss (?:became|is|was|has become) (?:infinite|non-?finite|inf or nan|nan)",
                             re.IGNORECASE)
"""detectron2's ``Loss became infinite or NaN at iteration=N``, ``loss is non-finite``."""
_NAN_LOSS_RE = re.compile(r"\b(?:nan|inf)[`'\"*]{0,2} loss(?:es)?\b", re.IGNORECASE)
"""``NaN losses``, also with the value quoted as a paste's prose does (```NaN` losses``, ``'inf' loss``)."""
_LOCAL_LOSS_RE = re.compile(
    r"(?:Rank (?P<rank>\d+): )?found (?P<value>NaN|Inf) in local forward loss calculation", re.IGNORECASE)
"""Megatron's ``Rank N: found NaN in local forward loss calculation`` (its check before the backward)."""
_NAN_ITERATIONS = "number of nan iterations:"
_NAN_ITERATIONS_RE = re.compile(r"number of nan iterations:\s{0,8}(?P<count>\d{1,9})\b")
"""Megatron-LM's training log row counts the iterations whose loss was NaN/Inf since the last row
(``iteration 20/ 120000 | ... | lm loss: 7.1E+00 | loss scale: 8388608.0 | number of skipped iterations:   0 |
number of nan iterations:   3 |``): a count above 0 is a non-finite loss even where the row's own ``lm loss``
is an average of the finite ones."""
_OUTPUT_NAN_RE = re.compile(r"\b(?P<key>(?:network |model )?(?:outputs?|logits|predictions?))\s{1,4}"
                            r"(?:is|are|contains?|has|have|became|become)\s{1,4}(?P<value>nan|inf)\b",
                            re.IGNORECASE)
"""A training loop's own NaN guard on the forward pass: ``Network outputs is NAN! Stop Training``,
``logits contain nan``."""
_DIST_INVALID = "but found invalid values"
_DIST_INVALID_RE = re.compile(
    r"Expected parameter (?P<param>\w{1,40}) (?:\((?:Tensor|Parameter) of shape \([\d, ]{0,80}\)\) )?of "
    r"distribution (?P<dist>\w{1,40})[^\n]{0,400}?but found invalid values:\s{0,8}tensor\(\[*\s{0,8}"
    r"(?P<value>nan|-?inf)\b")
"""torch.distributions' argument check failing on a model's output that went non-finite: ``ValueError:
Expected parameter logits (Tensor of shape (280, 13)) of distribution Categorical(logits: torch.Size([280,
13])) to satisfy the constraint IndependentConstraint(Real(), 1), but found invalid values: tensor([[nan,
nan, ...`` (an RL policy's or a VAE's head; IDSIA/hhmarl_2D#15). Read only when the values shown start with
NaN/Inf: a NaN forward output is the training having diverged (a negative scale or a probability above 1 is
a modelling bug, not this)."""
_ROW_TOKEN = r"\[?[-+]?(?:\d+(?:\.\d+)?(?:e[-+]?\d+)?|\.\d+)[A-Za-z%]{0,2}\]?,?"
_ROW_RE = re.compile(r"\s{0,16}(?P<step>\d{1,9})(?:/\d{1,9})?(?:\s{1,16}" + _ROW_TOKEN + r"){0,12}\s{1,16}\[?"
                     r"(?P<value>nan|inf)\]?(?:[\s,]|$)", re.IGNORECASE)
"""A progress-table row: a step or epoch counter (``76980``, ``41/299``), numbers (``65.1G``, ``[5.47e+03]``)
and a NaN/Inf among them -- YOLO's ``41/299  65.1G  nan  0.0152 ...`` under its ``Epoch gpu_mem box ...``
header, DeepXDE's ``2000  [nan]  [nan]``, a ``step loss`` print ``76980 nan``. A training loop's table
prints its losses: a non-finite value in it is the loss going non-finite."""
_STEP_RE = re.compile(r"\b(?:iteration|iter|global[ _]step|step)\b\s{0,4}[=:\[]?\s{0,4}(?P<step>\d{1,12})",
                      re.IGNORECASE)


def _word_at(t: _Text, pos: int, needle: str) -> bool:
    """``needle`` at ``pos`` is a word of its own (``nan`` in ``nan,``, not in ``finance``; ``inf`` in
    ``inf`` or ``infinity``, not in ``INFO``): the cheap test before a rule's regex."""
    before = t.lower[pos - 1: pos] if pos else " "
    after = t.lower[pos + len(needle): pos + len(needle) + 1]
    if before.isalpha() or before == "_":
        return False
    return not after.isalpha() or t.lower.startswith("infinity", pos)


def _step_near(t: _Text, pos: int, facts: Facts) -> None:
    found = _search(_STEP_RE, t, pos, before=200, after=120)
    if found is not None:
        facts["step"] = int(found[1].group("step"))


def _rule_loss_non_finite(t: _Text) -> Optional[_Hit]:
    pos = t.first("in local forward loss")
    if pos >= 0 and (found := _search(_LOCAL_LOSS_RE, t, pos, before=80, after=40)) is not None:
        m = found[1]
        facts: Facts = {"metric": "local forward loss", "value": m.group("value").lower()}
        if m.group("rank"):
            facts["rank"] = int(m.group("rank"))
        return _loss_hit(t, found[0] + m.start(), facts)
    for pos in t.find_all(_NAN_ITERATIONS):
        found = _search(_NAN_ITERATIONS_RE, t, pos, before=0, after=40)
        if found is not None and int(found[1].group("count")) > 0:
            count = int(found[1].group("count"))
            counted: Facts = {"metric": "loss", "value": "nan", "nan_iterations": count}
            return _loss_hit(t, found[0] + found[1].start(), counted)
    for needle in ("nan", "inf"):
        for pos in t.find_all(needle):
            if not _word_at(t, pos, needle):
                continue
            found = _search(_LOSS_RE, t, pos, before=100, after=12)
            if found is None:
                continue
            offset, m = found
            if offset + m.start("value") != pos:  # the needle must be the loss's value
                continue
            facts = {"metric": m.group("key"), "value": m.group("value").lower()}
            return _loss_hit(t, pos, facts)
    for needle in ("nan", "inf"):
        for pos in t.find_all(needle):
            if not _word_at(t, pos, needle):
                continue
            found = _search(_OUTPUT_NAN_RE, t, pos, before=60, after=12)
            if found is not None and found[0] + found[1].start("value") == pos:
                return _loss_hit(t, pos, {"metric": found[1].group("key"), "value": needle})
    pos = t.first(_DIST_INVALID)
    if pos >= 0 and (found := _search(_DIST_INVALID_RE, t, pos, before=600, after=60)) is not None:
        m = found[1]
        said = f"{m.group('dist')} {m.group('param')} (the model's output)"
        return _loss_hit(t, found[0] + m.start("value"), {"metric": said, "value": m.group("value")})
    pos = t.first("loss became", "loss is", "loss was", "loss has become", " loss")
    if pos >= 0:
        found = _search(_LOSS_BECAME_RE, t, pos, before=20, after=80) or \
            _search(_NAN_LOSS_RE, t, pos, before=20, after=20)
        if found is not None:
            return _loss_hit(t, found[0] + found[1].start(), {"metric": "loss", "value": "nan"})
    return _table_row(t)


def _table_row(t: _Text) -> Optional[_Hit]:
    """The first progress-table row (:data:`_ROW_RE`) with a NaN/Inf in it, read from its line's start."""
    for needle in ("nan", "inf"):
        for pos in t.find_all(needle):
            if not _word_at(t, pos, needle):
                continue
            start = t.text.rfind("\n", max(0, pos - 400), pos) + 1
            if start == 0 and pos > 400:
                continue  # a row is a short line
            m = _ROW_RE.match(t.text, start, min(len(t.text), pos + 12))
            if m is None or start + m.start("value") != pos:
                continue
            facts: Facts = {"metric": "loss (progress table)", "value": m.group("value").lower(),
                            "step": int(m.group("step"))}
            rank = _rank_of(t, pos, facts)
            return _Hit("loss", "non_finite", 0.7, pos, facts,
                        f"The job's progress table shows {facts['value']} at {facts['step']}{_on_rank(rank)}",
                        _LOSS_NOTE)
    return None


_LOSS_NOTE = ("the loss went non-finite: the weights are most likely corrupted from here on; look at the "
              "learning rate and the gradient norm of the steps before")
_GRAD_NOTE = ("the gradients went non-finite before the optimizer step: find the first layer and step where "
              "they did (anomaly mode, per-layer norms)")


def _value_hit(t: _Text, pos: int, facts: Facts, kind: str) -> _Hit:
    """The hit of a non-finite value the job printed (``kind``: ``loss/non_finite`` or
    ``gradient/nan-source``), with the step and rank the text names near it."""
    _step_near(t, pos, facts)
    rank = _rank_of(t, pos, facts)
    said = f"{facts['metric']} = {facts['value']}"
    if "step" in facts:
        said += f" at step {facts['step']}"
    category, subtype = kind.split("/")
    return _Hit(category, subtype, 0.8, pos, facts, f"The job reports {said}{_on_rank(rank)}",
                _LOSS_NOTE if category == "loss" else _GRAD_NOTE)


def _loss_hit(t: _Text, pos: int, facts: Facts) -> _Hit:
    return _value_hit(t, pos, facts, "loss/non_finite")


_GRAD_NORM_RE = re.compile(
    r"\b(?P<key>grad(?:ient)?[ _]?norm|gnorm|total[ _]norm)['\"]?\s{0,4}(?:[:=]\s{0,8}|\s(?:is|was)\s{1,4})"
    + _NONFINITE, re.IGNORECASE)
_LOCAL_NAN_RE = re.compile(r"(?:Rank (?P<rank>\d+): )?found (?P<value>NaN|Inf) in local grad norm",
                           re.IGNORECASE)
"""Megatron's ``Rank N: found NaN in local grad norm in backward pass before data-parallel ...``."""


_CHECK_NUMERICS = "tensor had "
_CHECK_NUMERICS_RE = re.compile(r"(?P<what>[^\n]{0,300}?)\s{0,2}: Tensor had (?P<value>NaN|Inf) values")
"""TensorFlow's CheckNumerics op (``tf.debugging.check_numerics``, the estimators' gradient check): ``<its
message> : Tensor had NaN values``; the message names the tensor -- ``Gradient for fpn_cells/.../bias:0 is
NaN`` (google/automl#344), ``CheckGradient/geom_net/.../gamma``, ``LossTensor is inf or nan.``."""
_GRADIENT_FOR_RE = re.compile(r"Gradient for (?P<var>\S{1,200}) is (?:NaN|Inf)")


def _rule_check_numerics(t: _Text) -> Optional[_Hit]:
    """TensorFlow's ``... : Tensor had NaN|Inf values``: the loss's check (its message names a loss) →
    loss/non_finite, any other tensor's (a gradient, an activation: where the NaN was first caught) →
    gradient/nan-source."""
    pos = t.first(_CHECK_NUMERICS)
    if pos < 0 or (found := _search(_CHECK_NUMERICS_RE, t, pos, before=300, after=30)) is None:
        return None
    m = found[1]
    what = m.group("what").strip().lstrip("> ").strip()
    if ": " in what and "Gradient for" not in what.split(": ")[-1]:
        what = what.split(": ")[-1]  # the exception's type or a task prefix before the op's message
    var = _GRADIENT_FOR_RE.search(what)
    value = m.group("value").lower()
    if "loss" in what.lower() and var is None:
        return _loss_hit(t, found[0] + m.start("value"), {"metric": what or "loss", "value": value})
    facts: Facts = {"metric": var.group("var") if var else (what or "a checked tensor"), "value": value,
                    "check": "CheckNumerics"}
    return _grad_hit(t, found[0] + m.start("value"), facts)


def _rule_grad_norm_non_finite(t: _Text) -> Optional[_Hit]:
    pos = t.first("in local grad norm")
    if pos >= 0 and (found := _search(_LOCAL_NAN_RE, t, pos, before=80, after=20)) is not None:
        m = found[1]
        facts: Facts = {"metric": "local grad norm", "value": m.group("value").lower()}
        if m.group("rank"):
            facts["rank"] = int(m.group("rank"))
        return _grad_hit(t, found[0] + m.start(), facts)
    for needle in ("nan", "inf"):
        for pos in t.find_all(needle):
            if not _word_at(t, pos, needle):
                continue
            found = _search(_GRAD_NORM_RE, t, pos, before=60, after=12)
            if found is None or found[0] + found[1].start("value") != pos:
                continue
            if _loss_non_finite_on_line(t, pos):
                return None  # the loss itself is NaN on this line: the gradients follow from it
            m = found[1]
            return _grad_hit(t, pos, {"metric": m.group("key"), "value": m.group("value").lower()})
    return None


def _loss_non_finite_on_line(t: _Text, pos: int) -> bool:
    """Whether the line (record) holding ``pos`` also prints a loss as NaN/Inf (mmdet's ``loss: nan,
    grad_norm: nan``): a NaN loss makes every gradient NaN, so the loss is what went wrong first."""
    line = t.line_at(pos)
    return any(m.group("value") and not m.group("key").lower().startswith(("grad", "scale"))
               for m in _LOSS_RE.finditer(line))


def _grad_hit(t: _Text, pos: int, facts: Facts) -> _Hit:
    return _value_hit(t, pos, facts, "gradient/nan-source")


_MIN_SCALE_RE = re.compile(r"loss scale already at minimum|minimum loss scale reached|"
                           r"loss scale (?:has )?(?:reached|hit) (?:its |the )?minimum|"
                           r"scale reached \(\s{0,4}[\d.e+-]{1,24}\s{0,4}\)|your loss is probably exploding|"
                           r"FloatingPointError: Minimum loss\b",
                           re.IGNORECASE)
"""fairseq's ``Minimum loss scale reached (S). Your loss is probably exploding. ...`` is also known by its
tail (``scale reached (S)``, ``Your loss is probably exploding``): its FloatingPointError message is built
with ``.format(...)`` and a paste of the traceback's source line shows it split; its exception line
``FloatingPointError: Minimum loss...`` alone is the same failure (fairseq raises no other)."""
_MIN_SCALE_NEEDLES = ("loss scale already at minimum", "minimum loss scale reached", "loss scale reached",
                      "loss scale has reached", "loss scale hit", "scale reached (", "probably exploding",
                      "floatingpointerror: minimum loss")


def _rule_loss_scale_minimum(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_MIN_SCALE_NEEDLES)
    if pos < 0 or (found := _search(_MIN_SCALE_RE, t, pos, before=30, after=80)) is None:
        return None
    facts: Facts = {"at_minimum": True}
    rank = _rank_of(t, pos, facts)
    return _Hit("memory", "amp-overflow", 0.9, found[0] + found[1].start(), facts,
                f"fp16 loss scale at its minimum{_on_rank(rank)}: every step overflows",
                "the gradients overflow even at the smallest loss scale: the loss is exploding (lower the "
                "learning rate, clip, or train in bf16)")


_NUMBER = r"(?P<scale>\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
_OVERFLOW_RE = re.compile(
    r"(?:(?:OVERFLOW!|Overflow detected\.)?(?: ?Rank (?P<rank>\d+))? ?Skipping step\. Attempted loss scale: "
    r"[\d.e+-]+, reducing to "
    r"|overflow detected, (?:ignoring gradient, )?setting loss scale to:? "
    r"|Reducing dynamic loss scale from [\d.e+-]+ to "
    r"|Gradient overflow\.\s+Skipping step, loss scaler \d+ reducing loss scale to )" + _NUMBER,
    re.IGNORECASE)
"""DeepSpeed's ``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: A, reducing to S`` (also
without its ``OVERFLOW!`` head, as pasted from a title), its fused optimizer's ``[Rank 0] Overflow detected.
Skipping step. Attempted ...`` and ``Reducing dynamic loss scale from A to S``; fairseq's ``overflow
detected, setting loss scale to: S`` and (>= 0.12) ``gradient overflow detected, ignoring gradient, setting
loss scale to: S``; apex's ``Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to S``."""
_SCALE_VALUE_RE = re.compile(r"\bloss[ _]scale\s{0,4}[:=]\s{0,4}" + _NUMBER, re.IGNORECASE)
_SKIPPED_RE = re.compile(
    r"\bFound overflow\b(?:\.? Skip step)?"
    r"|\bGrad(?:ient)? overflow(?: on iteration:?\s{0,4}(?P<step>\d{1,12})|\.\s{0,4}Skipping step)"
    r"|\bOVERFLOW!(?: Rank \d{1,7})? Skipping step\b",
    re.IGNORECASE)
"""An overflow line that names no scale: ColossalAI's ``Found overflow. Skip step``, DeepSpeed's fused
optimizer's ``Grad overflow on iteration N``, apex's ``Gradient overflow.  Skipping step`` and the old
FP16_Optimizer's ``OVERFLOW! Skipping step.`` and DeepSpeed's ``OVERFLOW! Rank 0 Skipping step.`` cut before
their scale (a paste, a quote in prose, a terminal's wrap splitting ``loss scal   e: 8192``): one step's
gradients overflowed and the step was skipped."""


def _rule_loss_scale(t: _Text) -> Optional[_Hit]:
    """The lowest scale an overflow line (or a printed ``loss_scale`` value) moved to; facts only --
    the detector decides whether it is low enough to be a collapse."""
    best: Optional[_Hit] = None
    for needle, pattern in (("overflow", _OVERFLOW_RE), ("skipping step. attempted loss scale", _OVERFLOW_RE),
                            ("dynamic loss scale from", _OVERFLOW_RE), ("loss_scale", _SCALE_VALUE_RE),
                            ("loss scale", _SCALE_VALUE_RE)):
        for pos in t.find_all(needle):
            found = _search(pattern, t, pos, before=80, after=160)
            if found is None:
                continue
            m = found[1]
            scale = float(m.group("scale"))
            if pattern is _SCALE_VALUE_RE and scale == 1.0:
                continue  # a printed scale of 1 is no scaling (Megatron prints it for bf16), not an overflow
            if best is not None and scale >= best.facts["scale"]:
                continue
            facts: Facts = {"scale": scale}
            if "rank" in m.groupdict() and m.group("rank"):
                facts["rank"] = int(m.group("rank"))
            rank = _rank_of(t, pos, facts)
            best = _Hit("memory", "amp-overflow", 0.6, found[0] + m.start(), facts,
                        f"fp16 gradients overflow: loss scale down to {scale:g}{_on_rank(rank)}",
                        _SCALE_NOTE)
    return best if best is not None else _skipped_step(t)


_SCALE_NOTE = ("the GradScaler / loss scaler keeps halving the scale: the gradients overflow on most steps "
               "(a too-high learning rate, a loss spike, or fp16 range limits)")


def _skipped_step(t: _Text) -> Optional[_Hit]:
    """The first overflow line that names no scale (:data:`_SKIPPED_RE`): facts ``{"overflow": True}``
    (and the iteration when it says one), no ``scale`` -- never a collapse on its own."""
    for pos in t.find_all("overflow"):
        found = _search(_SKIPPED_RE, t, pos, before=20, after=40)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"overflow": True}
        if m.group("step"):
            facts["step"] = int(m.group("step"))
        rank = _rank_of(t, pos, facts)
        return _Hit("memory", "amp-overflow", 0.6, found[0] + m.start(), facts,
                    f"fp16 gradients overflowed, step skipped{_on_rank(rank)}", _SCALE_NOTE)
    return None


GATES = {
    "numeric.loss-scale-minimum": _MIN_SCALE_NEEDLES,
    "numeric.grad-norm-non-finite": ("in local grad norm", "nan", "inf"),
    "numeric.check-numerics": (_CHECK_NUMERICS,),
    "numeric.loss-non-finite": ("nan", "inf", "loss became", "loss is", "loss was", "loss has become",
                                " loss", "in local forward loss", _DIST_INVALID),
    "numeric.loss-scale": ("overflow", "loss_scale", "loss scale", "skipping step. attempted loss scale",
                           "dynamic loss scale from"),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    "numeric.loss-non-finite": (
        "a loss printed as NaN/Inf (``loss: nan``, ``'loss': nan``, ``loss=nan``, ``Loss is nan``, "
        "``tensor(nan``, detectron2's ``Loss became infinite or NaN at iteration=N``), or a NaN/Inf in a "
        "progress-table row (a step or epoch counter and numbers: YOLO's ``41/299  65.1G  nan ...``, "
        "``76980 nan``), Megatron's row count ``number of nan iterations: N`` above 0, torch.distributions' "
        "``Expected parameter logits (...) of distribution Categorical(...) ... but found invalid values: "
        "tensor([[nan, ...`` (a model output gone NaN) → loss/non_finite"
    ),
    "numeric.check-numerics": (
        "TensorFlow's CheckNumerics ``<message> : Tensor had NaN|Inf values``: a message naming a loss "
        "(``LossTensor is inf or nan.``) → loss/non_finite; any other tensor (``Gradient for <variable> is "
        "NaN``, ``CheckGradient/...``) → gradient/nan-source, the tensor named"
    ),
    "numeric.grad-norm-non-finite": (
        "a gradient norm printed as NaN/Inf (``grad_norm: nan``, ``gnorm inf``, Megatron's ``Rank N: found "
        "NaN in local grad norm``) → gradient/nan-source"
    ),
    "numeric.loss-scale-minimum": (
        "``Current loss scale already at minimum``, fairseq's ``Minimum loss scale reached (S). Your loss is "
        "probably exploding`` (also by its tail alone, as a pasted traceback splits it, or by its exception "
        "line ``FloatingPointError: Minimum loss...``) → "
        "memory/amp-overflow"
    ),
    "numeric.loss-scale": (
        "DeepSpeed ``OVERFLOW! ... reducing to S``, fairseq ``overflow detected, setting loss scale to S``, "
        "apex ``Gradient overflow. Skipping step ... reducing loss scale to S``, a printed "
        "``loss_scale: S``; an overflow line naming no scale (ColossalAI ``Found overflow. Skip step``, "
        "DeepSpeed ``Grad overflow on iteration N``, apex / FP16_Optimizer ``Gradient overflow. Skipping "
        "step`` and DeepSpeed ``OVERFLOW! Rank 0 Skipping step.`` cut or wrapped before the scale) → "
        "memory/amp-overflow when the process detector judges a collapse (S "
        "<= ``amp_text_max_scale``, or ``amp_text_collapse_reductions`` halvings in a row below "
        "``amp_text_calibration_scale``); an overflow line short of that is an info-severity notice "
        "(``amp_text_overflow_notice``)"
    ),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
