"""``check_batch()``: is a token batch's attention mask consistent with its padding, and did truncation
cut the EOS off? (DESIGN §4 sequence/truncation; what only the job can see.)

For each checked batch it computes, **on the batch's device** and without reading anything back, the share
of the batch's rows (sequences) that show each defect, stacks them into one vector and queues it with
``client.log_vector``; the SDK's worker thread reads it back later (one copy). Nothing on the training
thread waits for the device: no ``.item()``, no boolean indexing, no data-dependent Python branch.

How a row is read (``B`` rows of ``L`` tokens; every rule is vectorised over the batch):

* **Padding side** -- ``padding_side="right"``/``"left"``, or ``"auto"`` (default): the side whose pad
  runs (trailing vs leading runs of ``pad_id``) hold more tokens in this batch; decided on the device.
* **Pad region** -- the row's trailing (right) or leading (left) run of ``pad_id``. When ``pad_id ==
  eos_id`` (GPT-2-style tokenizers) the first token of a trailing run is the sequence's EOS, not padding.
  A ``pad_id`` inside the content is content. ``content`` = ``L`` - pad region length.
* **EOS** -- a row ends in EOS when its last content token is ``eos_id``.
* **Length cap** -- ``max_length`` (default: ``L``, the batch's width). A row *reaches the cap* when its
  content is at least that long.

Metrics (each a share of the batch's rows, 0..1; reported only when their inputs are given):

==========================  ==============================================================================
``seq/pad_attended_frac``   rows with at least one pad-region token the mask attends (mask != 0; all of
                            them when no mask is passed at all)
``seq/mask_mismatch_frac``  rows whose mask disagrees with the padding anywhere: a pad attended or a
                            content token masked (the mask built for the other padding side, or before
                            truncation); every row when the mask's shape differs from the ids'
``seq/truncated_frac``      rows that reach the cap without ending in EOS (cut); without ``eos_id``: rows
                            that reach an explicit ``max_length``
``seq/eos_missing_frac``    rows that do not end in EOS, cut or not (``eos_id`` given)
``seq/labels_on_pad_frac``  rows whose ``labels`` are not ``ignore_index`` on a pad-region token (loss
                            computed on padding); only for token-level labels of the ids' shape
==========================  ==============================================================================

Masks may be 0/1 (int, float) or bool, or additive floats (0 = attend, negative = masked; recognised on
the device when any value is negative). A mask of another shape than the ids is compared on their common
leading columns. 3-D/4-D masks are not checked (one warning).

Cost, host time per checked batch (``test_check_batch_cost_on_cpu`` prints it): on this repository's 2-core
CPU runner, one thread, ~120-130 us for 16 x 64 tokens and ~230-270 us for 32 x 512 (mask and labels
given), mostly the dispatch of ~40 small tensor ops; on CUDA tensors the same ops are kernel launches the
training thread does not wait for: ~450 us of host time per 16 x 512 check on the lent H200 machine.
``every=None`` (the default) therefore adapts the cadence: every batch while a check's host time stays
within the ``watch_overhead_budget`` option (0.5%) of the time between calls, else one batch in N, N at
most ``MAX_ADAPTIVE_EVERY`` (16); ``every=N`` checks exactly one call in N (the first always). A
sampled-out call costs ~2 us.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from ..guard import warn_once
from .base import DidNotEnable

try:
    import torch
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise DidNotEnable("torch is not installed (the SDK uses the job's own)") from _exc

if TYPE_CHECKING:
    from ..client import Client

PAD_ATTENDED = "seq/pad_attended_frac"
MASK_MISMATCH = "seq/mask_mismatch_frac"
TRUNCATED = "seq/truncated_frac"
EOS_MISSING = "seq/eos_missing_frac"
LABELS_ON_PAD = "seq/labels_on_pad_frac"
METRICS = (PAD_ATTENDED, MASK_MISMATCH, TRUNCATED, EOS_MISSING, LABELS_ON_PAD)
PADDING_SIDES = ("auto", "left", "right")

MAX_ADAPTIVE_EVERY = 16
"""With ``every=None``, the most calls between two checks when the overhead budget stretches the cadence
(a data-preparation bug shows on nearly every batch: one in 16 still sees it within a few dozen steps)."""

_lock = threading.Lock()
# the client counted for, calls seen, the call number of the next check, the host cost of the last few
# checks (s; the least is used: waiting for the GIL, a cold cache, the first call's warm-up only add to a
# check's own cost) and the EWMA of the time between calls (adaptive cadence)
_calls: Dict[str, Any] = {"client": None, "count": 0, "next": 0, "costs": [], "interval": 0.0, "last": 0.0}


def _tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except Exception as exc:
        raise ValueError(f"{name} is not a tensor-like batch ({type(value).__name__}: {exc})") from None


def batch_stats(input_ids: Any, attention_mask: Any = None, *, pad_id: int, eos_id: Optional[int] = None,
                labels: Any = None, max_length: Optional[int] = None, padding_side: str = "auto",
                ignore_index: int = -100) -> Tuple[Tuple[str, ...], torch.Tensor]:
    """The metric names and a 1-D float32 tensor of their values (on the ids' device, not read back).

    Raises ValueError for input it cannot read (the public :func:`check_batch` reports and skips it)."""
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    ids = _tensor(input_ids, "input_ids")
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError("input_ids must be a non-empty (batch, length) tensor, got shape "
                         f"{tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"input_ids must hold integer token ids, got {ids.dtype}")
    rows, length = ids.shape
    device = ids.device
    with torch.no_grad():
        is_pad = (ids == int(pad_id)).to(torch.int32)
        lead = is_pad.cumprod(1).sum(1)
        trail = is_pad.flip(1).cumprod(1).sum(1)
        if eos_id is not None and int(eos_id) == int(pad_id):
            trail = (trail - 1).clamp_(min=0)  # a trailing run starts with the sequence's own EOS
        pos = torch.arange(length, device=device).unsqueeze(0)
        if padding_side == "auto":
            left = lead.sum() > trail.sum()  # 0-d bool on the device: no read-back
            pad_len = torch.where(left, lead, trail)
            content = length - pad_len
            region = torch.where(left, pos < pad_len.unsqueeze(1), pos >= content.unsqueeze(1))
        elif padding_side == "left":
            pad_len = lead
            content = length - pad_len
            region = pos < pad_len.unsqueeze(1)
        else:
            pad_len = trail
            content = length - pad_len
            region = pos >= content.unsqueeze(1)
        names: List[str] = []
        flags: List[torch.Tensor] = []  # one bool per row each

        # --- attention mask ----------------------------------------------------------------------
        mask = None if attention_mask is None else _tensor(attention_mask, "attention_mask")
        if mask is not None and mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if mask is None:
            names.append(PAD_ATTENDED)
            flags.append(region.any(1))
        elif mask.dim() != 2:
            warn_once("check_batch:mask-dim", f"check_batch(): a {mask.dim()}-D attention mask is not "
                      "checked (only (batch, length) masks)")
        elif mask.shape[0] != rows:
            names.append(MASK_MISMATCH)
            flags.append(torch.ones(rows, dtype=torch.bool, device=device))
        else:
            if mask.device != device:
                mask = mask.to(device)
            width = min(length, mask.shape[1])
            m = mask[:, :width]
            if m.dtype == torch.bool:
                attended = m
            elif m.is_floating_point():
                attended = torch.where((m < 0).any(), m == 0, m != 0)  # additive masks: 0 = attend
            else:
                attended = m != 0
            reg = region[:, :width]
            pad_attended = (attended & reg).any(1)
            content_masked = (~attended & ~reg).any(1)
            mismatch = pad_attended | content_masked
            if mask.shape[1] != length:
                mismatch = torch.ones_like(mismatch)
            names += [PAD_ATTENDED, MASK_MISMATCH]
            flags += [pad_attended, mismatch]

        # --- truncation and EOS ---------------------------------------------------------------------
        cap = length if max_length is None else int(max_length)
        nonempty = content > 0
        at_cap = (content >= cap) & nonempty
        if eos_id is not None:
            last_right = ids.gather(1, (content - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            if padding_side == "auto":
                last = torch.where(left, ids[:, -1], last_right)
            else:
                last = ids[:, -1] if padding_side == "left" else last_right
            ends_eos = (last == int(eos_id)) & nonempty
            names += [TRUNCATED, EOS_MISSING]
            flags += [at_cap & ~ends_eos, nonempty & ~ends_eos]
        elif max_length is not None:
            names.append(TRUNCATED)
            flags.append(at_cap)

        # --- labels ---------------------------------------------------------------------------------
        if labels is not None:
            lab = _tensor(labels, "labels")
            if lab.dim() == 1 and rows == 1 and lab.shape[0] == length:
                lab = lab.unsqueeze(0)
            if tuple(lab.shape) == (rows, length):
                if lab.device != device:
                    lab = lab.to(device)
                names.append(LABELS_ON_PAD)
                flags.append(((lab != int(ignore_index)) & region).any(1))
        if not flags:  # e.g. a 4-D mask and no eos_id / max_length / labels: nothing to say
            return (), torch.zeros(0)
        values = torch.stack(flags).to(torch.float32).sum(1) / float(rows)
    return tuple(names), values


def _due(client: Client, every: Optional[int]) -> bool:
    """Whether this call is checked: one in ``every``, or (None) the adaptive cadence."""
    now = time.perf_counter()
    with _lock:
        state = _calls
        ref = state["client"]
        if ref is None or ref() is not client:  # a new client (init again): start counting afresh
            state.update(client=weakref.ref(client), count=0, next=0, costs=[], interval=0.0, last=0.0)
        count = state["count"]
        state["count"] = count + 1
        if state["last"]:
            gap = now - state["last"]
            state["interval"] = gap if not state["interval"] else 0.8 * state["interval"] + 0.2 * gap
        state["last"] = now
        if every is not None:
            return count % max(1, int(every)) == 0
        if count < state["next"]:
            return False
        state["next"] = count + _adaptive_every(client)
        return True


def _adaptive_every(client: Client) -> int:
    """Calls until the next check, so that checks cost at most ``watch_overhead_budget`` of the time
    between calls (host time; 1 while unknown)."""
    budget = float(getattr(client.options, "watch_overhead_budget", 0.005) or 0.0)
    costs, interval = _calls["costs"], _calls["interval"]
    cost = min(costs) if costs else 0.0
    if budget <= 0 or cost <= 0 or interval <= 0:
        return 1
    return min(MAX_ADAPTIVE_EVERY, max(1, math.ceil(cost / (budget * interval))))


def check_batch(client: Client, input_ids: Any, attention_mask: Any = None, *, pad_id: Optional[int] = None,
                eos_id: Optional[int] = None, labels: Any = None, max_length: Optional[int] = None,
                padding_side: str = "auto", ignore_index: int = -100, every: Optional[int] = None,
                step: Optional[int] = None, tokenizer: Any = None) -> bool:
    """Check one batch and queue its ``seq/*`` metrics; True when this call was checked (not sampled out).

    See :func:`trainguard.check_batch` for the arguments. Raises ValueError for unreadable input (the
    public function turns that into one warning and a counted drop)."""
    if every is not None:
        every = int(every)
    if not _due(client, every):
        return False
    started = time.perf_counter()
    if isinstance(input_ids, Mapping):  # a dict / transformers BatchEncoding
        batch = input_ids
        input_ids = batch.get("input_ids")
        if attention_mask is None:
            attention_mask = batch.get("attention_mask")
        if labels is None:
            labels = batch.get("labels")
    if tokenizer is not None:
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_token_id", None)
        if eos_id is None:
            eos_id = getattr(tokenizer, "eos_token_id", None)
        if padding_side == "auto" and getattr(tokenizer, "padding_side", None) in ("left", "right"):
            padding_side = tokenizer.padding_side
    if pad_id is None:
        raise ValueError("check_batch() needs pad_id (or a tokenizer with a pad_token_id)")
    if input_ids is None:
        raise ValueError("check_batch() got no input_ids")
    names, values = batch_stats(input_ids, attention_mask, pad_id=pad_id, eos_id=eos_id, labels=labels,
                                max_length=max_length, padding_side=padding_side,
                                ignore_index=ignore_index)
    if not names:
        return True
    if step is None:
        step = client.step + 1  # the step this batch is about to be trained in (see check_batch's doc)
    client.log_vector(int(step), names, values)
    cost = time.perf_counter() - started
    with _lock:
        _calls["costs"] = [*_calls["costs"][-4:], cost]
    return True
