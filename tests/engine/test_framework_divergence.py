"""The engine on a real Hugging Face ``Trainer`` run recorded live in the test: the most common failure
under HF -- a learning rate far too high under its default ``max_grad_norm=1.0`` -- is a loss divergence,
found from the loss curve within 10 logged steps of the loss leaving its band, and never clip-stale.

The model is a 2-layer GPT-2 built from a config, pre-trained here for 150 Adam steps on tokens of a fixed
random Markov chain (so that, like a real fine-tune, it starts from a low loss), then trained by the real
``Trainer`` at an LR of 0.3 -- 100x the 3e-3 this model trains well with -- with the SDK's callback and
its default overhead budget. The loss jumps from ~1.6 to ~13 and settles at the uniform-prediction level
ln(64) ~ 4.2, far above its start: the gradient norm stays clipped to 1.0, which is why a norm-based rule
alone calls such runs healthy.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List

import torch

import trainguard
from trainguard.guard import reset_warnings
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline

VOCAB, SEQ = 64, 32
SANE_LR = 3e-3


def _chain_batches(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(0))
    ids = torch.empty(rows, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
    choice = torch.randint(0, 4, (rows, SEQ), generator=gen)
    for t in range(1, SEQ):
        ids[:, t] = successors[ids[:, t - 1], choice[:, t]]
    return ids


def _pretrained_model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    opt = torch.optim.Adam(model.parameters(), lr=SANE_LR)
    for i in range(150):
        ids = _chain_batches(32, seed=100 + i)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _hf_run(tmp_path: Path, lr: float, logging_steps: int = 1) -> List[Dict[str, Any]]:
    """Train with the real Trainer and the SDK's callback; the envelopes the SDK sent."""
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback

    torch.set_num_threads(1)
    model = _pretrained_model()
    data = [{"input_ids": row, "labels": row} for row in _chain_batches(960, seed=7)]
    reset_warnings()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False)  # the default overhead budget
    try:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=60, per_device_train_batch_size=16,
                                 logging_steps=logging_steps, learning_rate=lr, lr_scheduler_type="constant",
                                 report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                                 dataloader_num_workers=0)
        assert args.max_grad_norm == 1.0  # the Trainer's default clipping
        Trainer(model=model, args=args, train_dataset=data, callbacks=[TrainGuardCallback()]).train()
        assert trainguard.flush(5)
        client = trainguard.get_client()
        assert client is not None
        return list(client.worker._transport.events)  # type: ignore[attr-defined]
    finally:
        trainguard.shutdown(timeout=2)


def _judge(events: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Feed the envelopes one by one; per kind the highest step seen when it first appeared."""
    pipeline = Pipeline(DetectionSettings())
    seen, visible = -1, {}
    for event in events:
        if isinstance(event.get("step"), int):
            seen = max(seen, event["step"])
        for incident in pipeline.process([event]).incidents:
            visible.setdefault(f"{incident.category}/{incident.subtype}", seen)
    return {"visible": visible, "incidents": pipeline.incidents()}


def _loss(events: List[Dict[str, Any]]) -> Dict[int, float]:
    return {e["step"]: float(p["value"]) for e in events for p in e.get("metrics", {}).get("points", [])
            if p["name"] == "loss"}


def test_a_100x_learning_rate_under_hf_default_clipping_is_a_divergence_within_10_logged_steps(
        tmp_path: Path) -> None:
    events = _hf_run(tmp_path, lr=100 * SANE_LR)
    loss = _loss(events)
    steps = sorted(loss)
    assert steps == list(range(60)) and all(math.isfinite(v) for v in loss.values())
    norms = [float(p["value"]) for e in events for p in e.get("metrics", {}).get("points", [])
             if p["name"] == "grad_norm"]
    assert sum(1 for v in norms if v > 1.0) >= 0.5 * len(norms)  # clipped on most steps: bounded updates
    left = next(s for s in steps if loss[s] >= 2 * loss[0])  # the loss leaves its band
    assert loss[steps[-1]] >= 2 * loss[0]  # ... and does not come back
    judged = _judge(events)
    assert "loss/divergence" in judged["visible"], judged["visible"]
    assert judged["visible"]["loss/divergence"] - left <= 10
    assert "gradient/clip-stale" not in judged["visible"]  # never "raise the threshold" on a diverging loss
    (incident,) = [i for i in judged["incidents"] if (i.category, i.subtype) == ("loss", "divergence")]
    assert incident.severity == "error" and incident.status == "open"
    assert incident.first_step <= left + 5
    assert "do not raise max_norm" in incident.summary and "learning rate" in incident.summary
    top = incident.hypotheses[0]  # what the run says: a constant LR, clipped on most steps
    assert "learning rate far too high" in top["cause"] and top["confidence"] >= 0.5
    assert any("constant" in why for why in top["why"]) and any("clipping" in why for why in top["why"])


def test_logged_every_20_steps_the_divergence_is_still_found_from_the_steps_own_losses(tmp_path: Path) -> None:
    """The same run with ``logging_steps=20``: the Trainer's first logged loss is already the mean of the
    blow-up (far above the start) -- from it alone the run looks like a loss falling from a high start.
    The callback reports every step's own loss, so the divergence is found as with ``logging_steps=1``."""
    events = _hf_run(tmp_path, lr=100 * SANE_LR, logging_steps=20)
    loss = _loss(events)
    steps = sorted(loss)
    assert steps == list(range(60))  # every step's loss, not every 20th
    left = next(s for s in steps if loss[s] >= 2 * loss[0])
    judged = _judge(events)
    assert "loss/divergence" in judged["visible"], judged["visible"]
    assert judged["visible"]["loss/divergence"] - left <= 10
    assert "gradient/clip-stale" not in judged["visible"]


def test_the_same_run_at_a_sane_learning_rate_stays_healthy(tmp_path: Path) -> None:
    """The control: the same pre-trained model and data at the LR it trains well with."""
    events = _hf_run(tmp_path, lr=SANE_LR / 10)
    judged = _judge(events)
    warnings = [i for i in judged["incidents"] if i.status == "open" and i.severity in ("warning", "error")]
    assert warnings == []
