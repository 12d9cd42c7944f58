"""check_batch() and watch_lora() on real tensors: what they report is checked against independent,
row-by-row / parameter-by-parameter computations; each defect is found, correct batches are clean, bad
input never raises, and nothing is read back on the training thread (on CPU: no read-back op runs on the
calling thread; on CUDA: ``set_sync_debug_mode("error")``)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import trainguard
from tests.scenarios import trainings_finetune as ft
from tests.support.sdk_events import events, series
from trainguard.client import K_VECTOR
from trainguard.guard import reset_warnings
from trainguard.integrations import lora as tg_lora
from trainguard.integrations import sequence as tg_seq


@pytest.fixture(autouse=True)
def _sdk() -> Iterator[None]:
    reset_warnings()
    torch.manual_seed(0)
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    watch_overhead_budget=0,  # check every call; the adaptive cadence has its own test
                    capture_uncaught=False)
    yield
    tg_lora.unwatch_all()
    trainguard.shutdown(timeout=2)






# --- an independent reference: row by row, in plain Python ----------------------------------------------
def reference(ids: List[List[int]], mask: Optional[List[List[float]]], pad: int, eos: Optional[int],
              labels: Optional[List[List[int]]] = None, max_length: Optional[int] = None,
              side: str = "auto") -> Dict[str, float]:
    rows, length = len(ids), len(ids[0])

    def run(row: List[int], from_end: bool) -> int:
        seq = row[::-1] if from_end else row
        n = 0
        for tok in seq:
            if tok != pad:
                break
            n += 1
        return n

    leads = [run(r, False) for r in ids]
    trails = [run(r, True) for r in ids]
    if eos is not None and eos == pad:
        trails = [max(0, t - 1) for t in trails]
    left = sum(leads) > sum(trails) if side == "auto" else side == "left"
    out: Dict[str, List[bool]] = {k: [] for k in tg_seq.METRICS}
    cap = length if max_length is None else max_length
    for i, row in enumerate(ids):
        pad_len = leads[i] if left else trails[i]
        content = length - pad_len
        region = [(j < pad_len) if left else (j >= content) for j in range(length)]
        if mask is None:
            out[tg_seq.PAD_ATTENDED].append(any(region))
        else:
            attended = [m != 0 for m in mask[i]]
            if any(m < 0 for r in mask for m in r):
                attended = [m == 0 for m in mask[i]]
            out[tg_seq.PAD_ATTENDED].append(any(a and r for a, r in zip(attended, region)))
            out[tg_seq.MASK_MISMATCH].append(any(a != (not r) for a, r in zip(attended, region)))
        last = row[-1] if left else row[max(0, content - 1)]
        ends = content > 0 and eos is not None and last == eos
        if eos is not None:
            out[tg_seq.TRUNCATED].append(content > 0 and content >= cap and not ends)
            out[tg_seq.EOS_MISSING].append(content > 0 and not ends)
        elif max_length is not None:
            out[tg_seq.TRUNCATED].append(content > 0 and content >= cap)
        if labels is not None:
            out[tg_seq.LABELS_ON_PAD].append(any(lab != -100 and r for lab, r in zip(labels[i], region)))
    return {k: sum(v) / rows for k, v in out.items() if v}


def stats(*args: Any, **kwargs: Any) -> Dict[str, float]:
    names, values = tg_seq.batch_stats(*args, **kwargs)
    assert values.dtype == torch.float32 and values.dim() == 1
    return dict(zip(names, values.tolist()))


def random_batch(gen: torch.Generator, side: str, pad: int, eos: int, rows: int = 8, length: int = 12
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((rows, length), pad, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    for i in range(rows):
        n = int(torch.randint(1, length + 1, (1,), generator=gen))
        content = torch.randint(3, 30, (n,), generator=gen)
        if bool(torch.rand(1, generator=gen) < 0.7):
            content[-1] = eos
        sl = slice(length - n, length) if side == "left" else slice(0, n)
        ids[i, sl] = content
        mask[i, sl] = 1
    return ids, mask


# --- check_batch: values --------------------------------------------------------------------------------
def test_the_scenario_bug_is_found_and_the_correct_collation_is_clean() -> None:
    tok = ft.WordTokenizer(ft.WORDS, padding_side="left")
    text = ft.MarkovText(torch.Generator().manual_seed(5))
    texts = text.sample(64)
    ids, mask, labels = ft.collate_buggy(tok, texts)
    got = stats(ids, mask, pad_id=ft.PAD, eos_id=ft.EOS, labels=labels, max_length=ft.MAX_LEN)
    ref = reference(ids.tolist(), mask.tolist(), ft.PAD, ft.EOS, labels.tolist(), ft.MAX_LEN)
    assert got == pytest.approx(ref, abs=1e-6)
    # what the bug does, counted from the texts themselves: every row shorter than the width attends its
    # leading pads; every row longer than the width lost its EOS
    lengths = [len(t.split()) + 1 for t in texts]
    assert got[tg_seq.PAD_ATTENDED] == pytest.approx(sum(n < ft.MAX_LEN for n in lengths) / 64)
    assert got[tg_seq.TRUNCATED] == pytest.approx(sum(n > ft.MAX_LEN for n in lengths) / 64)
    assert got[tg_seq.TRUNCATED] > 0
    assert got[tg_seq.MASK_MISMATCH] >= got[tg_seq.PAD_ATTENDED] > 0.5
    for side in ("right", "left"):
        tok.padding_side = side
        ids, mask, labels = ft.collate(tok, texts)
        clean = stats(ids, mask, pad_id=ft.PAD, eos_id=ft.EOS, labels=labels, max_length=ft.MAX_LEN)
        assert set(clean) == set(tg_seq.METRICS) and all(v == 0.0 for v in clean.values()), (side, clean)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("pad,eos", [(0, 1), (1, 1)], ids=["pad!=eos", "pad==eos"])
def test_random_batches_match_the_reference(side: str, pad: int, eos: int) -> None:
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        ids, mask = random_batch(gen, side, pad, eos)
        corrupt = mask.clone()
        if trial % 3 == 1:  # a mask for the other padding side
            corrupt = corrupt.flip(1)
        elif trial % 3 == 2:  # a few random flips
            flips = torch.rand(mask.shape, generator=gen) < 0.05
            corrupt = torch.where(flips, 1 - corrupt, corrupt)
        labels = ids.masked_fill(corrupt == 0, -100)
        for m in (corrupt, corrupt.bool(), None):
            for max_length in (None, 10):
                got = stats(ids, m, pad_id=pad, eos_id=eos, labels=labels, max_length=max_length)
                ref = reference(ids.tolist(), None if m is None else m.long().tolist(), pad, eos,
                                labels.tolist(), max_length)
                assert got == pytest.approx(ref, abs=1e-6), (trial, side, m is None, max_length)
        if pad != eos:  # a correct mask is clean (with pad == eos a row of only EOS is ambiguous)
            assert stats(ids, mask, pad_id=pad, eos_id=eos)[tg_seq.MASK_MISMATCH] == 0.0


def test_padding_side_explicit_additive_masks_and_no_eos() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 1], [5, 6, 7, 8, 9], [0, 0, 0, 5, 1]])
    good = (ids != 0).float()
    additive = (1.0 - good) * -1e9  # 0 = attend, large negative = masked
    assert stats(ids, additive, pad_id=0, eos_id=1)[tg_seq.MASK_MISMATCH] == 0.0
    assert stats(ids, (1.0 - good) * float("-inf"), pad_id=0, eos_id=1)[tg_seq.PAD_ATTENDED] == 0.0
    wrong_side = stats(ids, good, pad_id=0, eos_id=1, padding_side="right")  # trailing runs: none
    assert wrong_side[tg_seq.MASK_MISMATCH] == pytest.approx(2 / 3)
    no_eos = stats(ids, good, pad_id=0)
    assert set(no_eos) == {tg_seq.PAD_ATTENDED, tg_seq.MASK_MISMATCH}  # nothing about EOS without eos_id
    capped = stats(ids, good, pad_id=0, max_length=5)
    assert capped[tg_seq.TRUNCATED] == pytest.approx(1 / 3)  # the unpadded row reaches the cap
    # no mask at all: the model attends every pad
    assert stats(ids, None, pad_id=0, eos_id=1)[tg_seq.PAD_ATTENDED] == pytest.approx(2 / 3)


def test_a_mask_of_another_shape_is_a_mismatch_on_every_row() -> None:
    ids = torch.tensor([[5, 6, 1, 0], [5, 6, 7, 1]])
    longer = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])  # built before truncation
    got = stats(ids, longer, pad_id=0, eos_id=1)
    assert got[tg_seq.MASK_MISMATCH] == 1.0 and got[tg_seq.PAD_ATTENDED] == 0.0
    assert stats(ids, longer[:1], pad_id=0, eos_id=1)[tg_seq.MASK_MISMATCH] == 1.0  # other batch size


# --- check_batch: the public path ------------------------------------------------------------------------
def test_check_batch_reports_through_the_metric_path_at_the_coming_step() -> None:
    tok = ft.WordTokenizer(ft.WORDS, padding_side="left")
    text = ft.MarkovText(torch.Generator().manual_seed(1))
    refs = []
    for step in range(6):
        ids, mask, labels = ft.collate_buggy(tok, text.sample(16))
        trainguard.check_batch(ids, mask, labels=labels, pad_id=ft.PAD, eos_id=ft.EOS, max_length=ft.MAX_LEN,
                               every=2)
        refs.append(reference(ids.tolist(), mask.tolist(), ft.PAD, ft.EOS, labels.tolist(), ft.MAX_LEN))
        trainguard.log(step=step, loss=1.0)
    evs = events()
    got = series(evs, tg_seq.PAD_ATTENDED)
    assert [s for s, _ in got] == [0, 2, 4]  # every 2nd call, at the step the batch is trained in
    for (step, value), name in zip(got, [tg_seq.PAD_ATTENDED] * 3):
        assert value == pytest.approx(refs[step][name], abs=1e-6)
    assert [s for s, _ in series(evs, tg_seq.TRUNCATED)] == [0, 2, 4]


def test_check_batch_takes_a_batch_dict_and_a_tokenizer() -> None:
    tok = ft.WordTokenizer(ft.WORDS, padding_side="left")
    ids, mask, labels = ft.collate_buggy(tok, ft.MarkovText(torch.Generator().manual_seed(2)).sample(16))
    trainguard.check_batch({"input_ids": ids, "attention_mask": mask, "labels": labels}, tokenizer=tok,
                           step=7)
    evs = events()
    ref = reference(ids.tolist(), mask.tolist(), ft.PAD, ft.EOS, labels.tolist(), side="left")
    for name in (tg_seq.PAD_ATTENDED, tg_seq.MASK_MISMATCH, tg_seq.EOS_MISSING, tg_seq.LABELS_ON_PAD):
        assert series(evs, name) == [(7, pytest.approx(ref[name], abs=1e-6))]


@pytest.mark.parametrize("args,kwargs", [
    ((None,), {"pad_id": 0}),
    (("not a batch",), {"pad_id": 0}),
    (([[1, 2, 3], [1, 2]],), {"pad_id": 0}),            # ragged
    ((torch.zeros(2, 3, 4, dtype=torch.long),), {"pad_id": 0}),
    ((torch.zeros(0, 5, dtype=torch.long),), {"pad_id": 0}),
    ((torch.rand(2, 5),), {"pad_id": 0}),               # float "ids"
    ((torch.ones(2, 5, dtype=torch.long),), {}),       # no pad_id
    ((torch.ones(2, 5, dtype=torch.long), object()), {"pad_id": 0}),
    ((torch.ones(2, 5, dtype=torch.long),), {"pad_id": "x"}),
    ((torch.ones(2, 5, dtype=torch.long),), {"pad_id": 0, "padding_side": "middle"}),
    ((torch.ones(2, 5, dtype=torch.long),), {"pad_id": 0, "every": "often"}),
])
def test_bad_input_never_raises_and_is_counted(args: Tuple[Any, ...], kwargs: Dict[str, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    client = trainguard.get_client()
    assert client is not None
    trainguard.check_batch(*args, **kwargs)
    assert client.stats.dropped["invalid_value"] == 1
    assert "check_batch" in capsys.readouterr().err
    assert series(events(), tg_seq.PAD_ATTENDED) == []


def test_odd_but_readable_input_is_checked() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    trainguard.check_batch(ids, torch.ones(2, 1, 5, 5), pad_id=0, step=0)  # 4-D mask: not checked, ids are
    trainguard.check_batch([[5, 6, 0]], [[1, 1, 1]], pad_id=0, step=1, labels=torch.zeros(3))  # lists
    trainguard.check_batch(torch.tensor([5, 6, 0]), torch.tensor([1, 1, 0]), pad_id=0, step=2)  # 1 row
    evs = events()
    assert series(evs, tg_seq.PAD_ATTENDED) == [(1, 1.0), (2, 0.0)]
    assert series(evs, tg_seq.LABELS_ON_PAD) == [(1, 1.0)]
    assert [s for s, _ in series(evs, tg_seq.TRUNCATED)] == []  # no eos_id, no max_length
    client = trainguard.get_client()
    assert client is not None and client.stats.dropped["invalid_value"] == 0


def test_without_init_check_batch_and_watch_lora_do_nothing() -> None:
    trainguard.shutdown()
    trainguard.check_batch(torch.ones(2, 3, dtype=torch.long), pad_id=0)
    assert trainguard.watch_lora(nn.Linear(2, 2)) is None


# --- no read-back on the training thread -----------------------------------------------------------------
READ_BACK = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero",
             "masked_select", "__array__", "__len__"}


class ReadBackRecorder(TorchFunctionMode):
    """Records, on the thread that enters it (torch function modes are per thread), every tensor op that
    copies device data to the host or branches on it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in READ_BACK:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_on_cpu_check_batch_and_watch_lora_read_back_on_the_worker_only() -> None:
    """The SDK's calls on the training thread (check_batch, the backward hooks) run no read-back op; the
    queued values are tensors, converted later by the worker thread."""
    client = trainguard.get_client()
    assert client is not None
    tok = ft.WordTokenizer(ft.WORDS, padding_side="left")
    text = ft.MarkovText(torch.Generator().manual_seed(3))
    model = _lora_model()
    trainguard.watch_lora(model)
    queued_kinds: List[Any] = []
    for step in range(4):
        ids, mask, labels = ft.collate_buggy(tok, text.sample(8))
        recorder = ReadBackRecorder()
        with recorder:
            trainguard.check_batch(ids, mask, labels=labels, pad_id=ft.PAD, eos_id=ft.EOS, step=step)
            queued_kinds.append([(item[0], type(item[-1]).__name__) for item in list(client._queue)[-1:]])
            loss = ft._lm_loss(model, ids, torch.ones_like(mask), ids)
            model.zero_grad(set_to_none=True)
            loss.backward()
        assert recorder.calls == [], recorder.calls
        trainguard.log(step=step, loss=loss.detach())
    assert all(kinds == [(K_VECTOR, "Tensor")] for kinds in queued_kinds)  # the device vector, as is
    evs = events()
    assert len(series(evs, tg_seq.PAD_ATTENDED)) == 4 and len(series(evs, tg_lora.GRAD_MEAN_B)) == 4


# --- watch_lora -------------------------------------------------------------------------------------------
def _lora_model(seed: int = 0) -> ft.FinetuneLM:
    torch.manual_seed(seed)
    model = ft.FinetuneLM(len(ft.WordTokenizer(ft.WORDS)))
    model.requires_grad_(False)
    model.add_lora()
    model.lm_head.requires_grad_(True)
    return model


def _batches(n: int, length: int = 16, seed: int = 0) -> List[ft.Batch]:
    tok = ft.WordTokenizer(ft.WORDS)
    text = ft.MarkovText(torch.Generator().manual_seed(seed))
    return [ft.collate(tok, text.sample(8), max_length=length) for _ in range(n)]


def ref_lora(model: nn.Module) -> Dict[str, float]:
    """mean |grad| of A and B matrices (parameters with a gradient), and the count without one."""
    sums = {"A": 0.0, "B": 0.0}
    counts = {"A": 0, "B": 0}
    missing = 0
    for name, p in model.named_parameters():
        side = "A" if ".lora_A." in name else "B" if ".lora_B." in name else ""
        if not side or not p.requires_grad:
            continue
        if p.grad is None or float(p.grad.abs().max()) == 0.0:
            missing += 1
        if p.grad is not None:
            sums[side] += float(p.grad.double().abs().sum())
            counts[side] += p.grad.numel()
    return {tg_lora.GRAD_MEAN_A: sums["A"] / counts["A"] if counts["A"] else 0.0,
            tg_lora.GRAD_MEAN_B: sums["B"] / counts["B"] if counts["B"] else 0.0,
            tg_lora.NO_GRAD: float(missing)}


def _train_lora(model: ft.FinetuneLM, opt: torch.optim.Optimizer, batches: Sequence[ft.Batch],
                checkpointing: bool = False, log: bool = True) -> List[Dict[str, float]]:
    model.checkpointing = checkpointing
    refs = []
    for step, (ids, mask, labels) in enumerate(batches):
        loss = ft._lm_loss(model, ids, mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        refs.append(ref_lora(model))
        opt.step()
        if log:
            trainguard.log(step=step, loss=loss.detach())
    return refs


def test_watch_lora_finds_peft_named_adapters_and_reports_exact_means() -> None:
    model = _lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    handle = trainguard.watch_lora(model, optimizer=opt)
    assert isinstance(handle, tg_lora.LoraWatch) and handle.params == 12
    assert handle.a_names[0] == "layers.0.q_proj.lora_A.default.weight"
    assert all(".lora_B." in n for n in handle.b_names)
    refs = _train_lora(model, opt, _batches(6))
    evs = events()
    for name in (tg_lora.GRAD_MEAN_A, tg_lora.GRAD_MEAN_B, tg_lora.NO_GRAD):
        got = series(evs, name)
        assert [s for s, _ in got] == list(range(6)), name
        for (_, value), ref in zip(got, refs):
            assert value == pytest.approx(ref[name], rel=1e-4, abs=1e-12), name
    # LoRA's B starts at 0: A's gradient is exactly 0 on the first step only, then both learn
    assert refs[0][tg_lora.GRAD_MEAN_A] == 0.0 and refs[0][tg_lora.NO_GRAD] == 6.0
    assert all(r[tg_lora.GRAD_MEAN_A] > 1e-6 and r[tg_lora.NO_GRAD] == 0 for r in refs[1:])
    assert series(evs, tg_lora.PARAMS)[0] == (0, 12.0)


def test_reentrant_checkpointing_over_frozen_embeddings_cuts_every_adapter_off() -> None:
    model = _lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    trainguard.watch_lora(model, optimizer=opt)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        refs = _train_lora(model, opt, _batches(4), checkpointing=True)
    assert all(r[tg_lora.NO_GRAD] == 12 for r in refs)  # the reference sees it too
    evs = events()
    assert series(evs, tg_lora.NO_GRAD) == [(s, 12.0) for s in range(4)]
    assert series(evs, tg_lora.GRAD_MEAN_A) == [(s, 0.0) for s in range(4)]
    assert model.lm_head.weight.grad is not None  # the head still learns


def test_with_input_require_grads_nested_backwards_report_once_per_step_with_every_gradient() -> None:
    model = _lora_model()
    model.embed_tokens.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    trainguard.watch_lora(model)  # no optimizer: the end of the outer backward reports
    refs = _train_lora(model, opt, _batches(5), checkpointing=True)
    evs = events()
    got = series(evs, tg_lora.NO_GRAD)
    assert [s for s, _ in got] == list(range(5))  # one report per step, not one per nested backward
    assert all(v == ref[tg_lora.NO_GRAD] for (_, v), ref in zip(got, refs))
    for (_, value), ref in zip(series(evs, tg_lora.GRAD_MEAN_B), refs):
        assert value == pytest.approx(ref[tg_lora.GRAD_MEAN_B], rel=1e-4)


def test_the_optimizer_step_reports_when_no_backward_end_was_seen() -> None:
    """Adapters only inside reentrant checkpoints, nothing else trainable: every sentinel's backward is
    nested, so the end-of-backward path stays silent and the optimizer's step reports."""
    torch.manual_seed(0)
    layer = ft.LoraLinear(nn.Linear(6, 6))
    layer.base_layer.requires_grad_(False)
    model = nn.Sequential(layer)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = trainguard.watch_lora(model, optimizer=opt)
    for step in range(3):
        x = torch.randn(4, 6, requires_grad=True)
        out = checkpoint(model, x, use_reentrant=True)
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
        trainguard.log(step=step, loss=0.0)
    assert handle.reports == 3
    assert [s for s, _ in series(events(), tg_lora.GRAD_MEAN_B)] == [0, 1, 2]


def test_exact_zero_gradients_count_as_no_gradient() -> None:
    model = _lora_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    trainguard.watch_lora(model)
    model.layers[1].up_proj = model.layers[1].up_proj.base_layer  # an adapter the forward no longer uses
    for step, (ids, mask, labels) in enumerate(_batches(3)):
        opt.zero_grad(set_to_none=False)  # unused adapters keep a zero gradient, not None
        ft._lm_loss(model, ids, mask, labels).backward()
        opt.step()
        trainguard.log(step=step, loss=0.0)
    got = series(events(), tg_lora.NO_GRAD)
    # first backward: the unused pair has no .grad at all, A is 0 everywhere (B == 0); then zeros
    assert got[0][1] >= 2 and [v for _, v in got[1:]] == [2.0, 2.0]


def test_frozen_adapters_are_left_out_unless_none_is_trainable() -> None:
    model = _lora_model()
    model.layers[0].q_proj.lora_A["default"].requires_grad_(False)
    a, b, frozen = tg_lora.find_adapters(model)
    assert (len(a), len(b), frozen) == (5, 6, 1)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(False)
    a, b, frozen = tg_lora.find_adapters(model)
    assert (len(a), len(b), frozen) == (6, 6, 0)  # requires_grad off on every adapter: watch them all
    handle = trainguard.watch_lora(model)
    ids, mask, labels = _batches(1)[0]
    ft._lm_loss(model, ids, mask, labels).backward()  # the head's hook fires: report
    assert series(events(), tg_lora.NO_GRAD) == [(0, 12.0)]
    assert handle.reports == 1


def test_name_filter_and_custom_names() -> None:
    model = _lora_model()
    a, b, _ = tg_lora.find_adapters(model, name_filter=r"layers\.1\.")
    assert len(a) == 3 and all(n.startswith("layers.1.") for n, _ in a + b)
    a, b, _ = tg_lora.find_adapters(model, name_filter=lambda n: "v_proj" in n)
    assert len(a) == len(b) == 2
    custom = nn.ModuleDict({"adapter_down": nn.Linear(4, 2), "adapter_up": nn.Linear(2, 4)})
    a, b, _ = tg_lora.find_adapters(custom, a_names=("adapter_down",), b_names=("adapter_up",))
    assert [n for n, _ in a] == ["adapter_down.weight", "adapter_down.bias"] and len(b) == 2
    assert tg_lora.find_adapters(custom)[:2] == ([], [])  # no "lora_A" component: nothing by default
    assert tg_lora.find_adapters(nn.ModuleDict({"flora_A": nn.Linear(2, 2)}))[:2] == ([], [])


def test_watch_lora_lifecycle_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    model = _lora_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    first = trainguard.watch_lora(model)
    second = trainguard.watch_lora(model)
    assert first.removed and not second.removed
    _train_lora(model, opt, _batches(2))
    second.remove()
    second.remove()
    _train_lora(model, opt, _batches(2))
    assert len(series(events(), tg_lora.GRAD_MEAN_A)) == 2  # once per step while watched, then nothing
    assert trainguard.watch_lora(object()) is None
    assert "watch_lora() needs a torch.nn.Module" in capsys.readouterr().err
    nothing = trainguard.watch_lora(nn.Linear(3, 3))
    assert nothing is not None and nothing.params == 0
    assert "no LoRA adapter parameters found" in capsys.readouterr().err


def test_a_failing_lora_hook_is_disabled_once_and_training_continues(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model = _lora_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = trainguard.watch_lora(model, optimizer=opt)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(torch, "_foreach_norm", broken)
    before = model.lm_head.weight.detach().clone()
    _train_lora(model, opt, _batches(3))
    assert not torch.equal(before, model.lm_head.weight)  # it trained
    assert "injected failure" in handle.disabled
    assert capsys.readouterr().err.count("watch_lora(): a hook failed") == 1


def test_the_default_cadence_adapts_to_the_overhead_budget() -> None:
    """every=None: back-to-back calls (a check costs ~100% of the time between calls) are thinned to one in
    MAX_ADAPTIVE_EVERY; calls 500 ms apart with a check well under the budget are all checked (a 5% budget
    there: 25 ms a check -- the default 0.5% leaves 2.5 ms, which a check exceeds on a loaded 2-core CI
    machine, and then the cadence rightly thins them too)."""
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False)  # the default budget, 0.5%
    ids, mask = random_batch(torch.Generator().manual_seed(0), "right", 0, 1, 16, 64)
    for step in range(40):
        trainguard.check_batch(ids, mask, pad_id=0, eos_id=1, step=step)
    every = tg_seq.MAX_ADAPTIVE_EVERY
    assert [s for s, _ in series(events(), tg_seq.PAD_ATTENDED)] == [0, 1, 1 + every, 1 + 2 * every]
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False, watch_overhead_budget=0.05)
    for step in range(4):
        trainguard.check_batch(ids, mask, pad_id=0, eos_id=1, step=step)
        time.sleep(0.5)
    assert [s for s, _ in series(events(), tg_seq.PAD_ATTENDED)] == [0, 1, 2, 3]


# --- cost -------------------------------------------------------------------------------------------------
def test_check_batch_cost_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Host time per check_batch call on CPU (printed; the bound is loose for a busy 2-core runner)."""
    client = trainguard.get_client()
    assert client is not None
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    figures = {}
    for rows, length in ((16, 64), (32, 512)):
        ids, mask = random_batch(gen, "right", 0, 1, rows, length)
        labels = ids.masked_fill(mask == 0, -100)
        for _ in range(20):
            tg_seq.batch_stats(ids, mask, pad_id=0, eos_id=1, labels=labels)
        samples = []
        for _ in range(7):
            started = time.perf_counter()
            for _ in range(50):
                trainguard.check_batch(ids, mask, labels=labels, pad_id=0, eos_id=1, step=0)
            samples.append((time.perf_counter() - started) / 50)
            client._queue.clear()
        figures[(rows, length)] = statistics.median(samples)
        started = time.perf_counter()
        for _ in range(1000):
            trainguard.check_batch(ids, mask, pad_id=0, eos_id=1, every=1000, step=0)
        skipped = (time.perf_counter() - started) / 1000
    with capsys.disabled():
        print("\ncheck_batch on CPU: " + ", ".join(f"{r}x{n} tokens {t * 1e6:.0f} us"
                                                   for (r, n), t in figures.items())
              + f"; a sampled-out call {skipped * 1e6:.1f} us")
    assert figures[(16, 64)] < 2e-3 and skipped < 50e-6
    assert not math.isnan(skipped)


# --- CUDA (run on the GPU machine; skipped where there is no GPU) -------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_on_cuda_the_training_thread_never_synchronises() -> None:
    """check_batch and a LoRA fine-tune with watch_lora under ``set_sync_debug_mode("error")``; the worker
    does not drain during the window (the mode is process-wide; its read-back is a sync by design)."""
    trainguard.shutdown()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0, capture_exit=False,
                    capture_uncaught=False, flush_interval=3600.0, max_batch_events=100_000,
                    max_queue_events=100_000)
    device = torch.device("cuda")
    tok = ft.WordTokenizer(ft.WORDS, padding_side="left")
    text = ft.MarkovText(torch.Generator().manual_seed(4))
    batches = [tuple(t.to(device) for t in ft.collate_buggy(tok, text.sample(16))) for _ in range(4)]
    model = ft.FinetuneLM(len(tok)).to(device)
    model.requires_grad_(False)
    model.add_lora()
    model.to(device)
    model.lm_head.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    refs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainguard.watch_lora(model, optimizer=opt)
        for step, (ids, mask, labels) in enumerate(batches):
            trainguard.check_batch(ids, mask, labels=labels, pad_id=ft.PAD, eos_id=ft.EOS,
                                   max_length=ft.MAX_LEN, step=step, every=1)
            loss = ft._lm_loss(model, ids, mask, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            refs.append(torch.stack([p.grad.abs().sum() for n, p in model.named_parameters()
                                     if ".lora_B." in n]))  # stays on the device
            opt.step()
            trainguard.log(step=step, loss=loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    evs = events()
    numel_b = sum(p.numel() for n, p in model.named_parameters() if ".lora_B." in n)
    for (_, value), ref in zip(series(evs, tg_lora.GRAD_MEAN_B), refs):
        assert value == pytest.approx(float(ref.sum()) / numel_b, rel=1e-4)
    got = series(evs, tg_seq.PAD_ATTENDED)
    for (_, value), (ids, mask, labels) in zip(got, batches):
        ref = reference(ids.tolist(), mask.tolist(), ft.PAD, ft.EOS, labels.tolist(), ft.MAX_LEN)
        assert value == pytest.approx(ref[tg_seq.PAD_ATTENDED], abs=1e-6)
    assert len(got) == 4 and len(series(evs, tg_lora.NO_GRAD)) == 4
