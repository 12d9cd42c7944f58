"""read_back: a batch of queued device values becomes floats with one copy per device, and never raises."""

from __future__ import annotations

import math
from typing import Any, List

import pytest
import torch

from trainguard.read_back import K_EVENT, K_METRICS, K_VECTOR, read_back

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def batch(device: str) -> List[tuple]:
    """What the queue holds after a watched step and a log(): 0-d tensors of several dtypes, a vector."""
    norm = torch.tensor(2.5, device=device)
    return [
        (K_METRICS, 7, 1, {"loss": torch.tensor(0.75, device=device), "grad/global_norm": norm,
                           "grad/clip_triggered": torch.gt(norm, 1.0), "time/step_s": 0.05, "count": 3},
         False),
        (K_VECTOR, 7, 2, ("grad/layer/a", "grad/layer/b"), torch.tensor([1.5, 0.25], device=device)),
        (K_EVENT, {"heartbeat": {}}),
        (K_METRICS, 8, 3, {"loss": torch.tensor(float("nan"), device=device),
                           "amp/scale": torch.tensor(65536.0, dtype=torch.bfloat16, device=device)}, False),
    ]


def check(out: List[tuple]) -> None:
    assert [item[0] for item in out] == [K_METRICS, K_METRICS, K_EVENT, K_METRICS]
    first = out[0][3]
    assert first == {"loss": 0.75, "grad/global_norm": 2.5, "grad/clip_triggered": 1.0, "time/step_s": 0.05,
                     "count": 3.0}
    assert all(type(v) is float for v in first.values())
    assert out[1] == (K_METRICS, 7, 2, {"grad/layer/a": 1.5, "grad/layer/b": 0.25}, False)
    assert math.isnan(out[3][3]["loss"]) and out[3][3]["amp/scale"] == 65536.0


def test_cpu_values_and_vectors_become_floats_in_queue_order() -> None:
    check(read_back(batch("cpu")))


@needs_cuda
def test_cuda_batch_is_read_with_one_copy() -> None:
    check(read_back(batch("cuda")))


@needs_cuda
def test_cuda_read_back_never_syncs_with_the_training_stream_on_a_pageable_copy() -> None:
    items = batch("cuda")  # built first: a tensor made from a Python number is a host-to-device copy
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a pageable .cpu() copy would raise here
    try:
        out = read_back(items)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check(out)


class Unreadable:
    device = torch.device("cpu")

    def dim(self) -> int:
        return 1

    def detach(self) -> Any:
        raise RuntimeError("freed")

    def __float__(self) -> float:
        raise RuntimeError("freed")


def test_an_unreadable_vector_becomes_a_dropped_item_and_others_survive() -> None:
    items = [(K_VECTOR, 1, 1, ("a",), Unreadable()),
             (K_METRICS, 1, 2, {"loss": torch.tensor(0.5)}, False)]
    out = read_back(items)
    assert out[0] == (K_METRICS, 1, 1, None, False)
    assert out[1][3] == {"loss": 0.5}
