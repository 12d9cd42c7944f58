"""Stop 44 (hL3), hR's review: c10d's warning for one failed connect attempt is a retry, not the failure.

torch prints ``[W socket.cpp:N] [c10d] The client socket has failed to connect to [host]:port (errno: ...)``
for each attempt while it keeps trying until its timeout; healthy runs print it while the master comes up
(pytorch/PiPPy#158's CI, NeMo#7351). ``c10d.rendezvous`` reads it as comm/init-failure only when the text does
not go on training after it (a paste that ends in the attempts, or in the error they end in); an error-level
line or the raised error always counts. Elastic's end-of-job ``[WARNING] The node ... has failed to shutdown
the rendezvous ...`` is clean-up after the job, not a failure of it. The vocabulary fallback layer leaves
``[W file.cpp:N]`` records alone (a warning), as it does glog's ``W`` records."""

from __future__ import annotations

from typing import Optional

import pytest

from trainguard_engine.classify import classify_text
from trainguard_engine.classify.c10d import connect_retry, went_on

CONNECT_W = ("[W socket.cpp:558] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - "
             "Cannot assign requested address).")
CONNECT_W_NEW = ("[W427 01:04:16.149509694 socket.cpp:752] [c10d] The client socket has failed to connect to "
                 "[::ffff:198.18.0.1]:3254 (errno: 110 - Connection timed out).")
CONNECT_RAISED = ("torch.distributed.DistNetworkError: The client socket has failed to connect to any network "
                  "address of (node1, 29500). The client socket has failed to connect to node1:29500 (errno: 110 "
                  "- Connection timed out).")
SHUTDOWN_W = ("[2024-05-01 10:10:00,000] torch.distributed.elastic.rendezvous.dynamic_rendezvous: [WARNING] The "
              "node 'n1' has failed to shutdown the rendezvous 'r' due to an error of type "
              "RendezvousConnectionError.")
TRAINING = "".join(f"Epoch 1 step {i}/500 loss {2.3 - i * 0.004:.3f} lr 3e-4\n" for i in range(0, 500, 50))
BAR = " 12%|#2        | 60/500 [00:10<01:13,  6.01it/s]\n"


def _kind(text: str) -> Optional[str]:
    found = classify_text(text)
    return None if found is None else f"{found.category}/{found.subtype}"


@pytest.mark.parametrize("text", [
    TRAINING + CONNECT_W + "\n" + TRAINING,
    CONNECT_W + "\n" + CONNECT_W + "\n" + TRAINING,
    "[rank1]:" + CONNECT_W_NEW + "\n" + BAR,
    TRAINING + SHUTDOWN_W + "\n",
])
def test_healthy_run_is_quiet(text: str) -> None:
    assert _kind(text) is None


@pytest.mark.parametrize("text", [
    CONNECT_W_NEW + "\n" + CONNECT_W_NEW + "\n",                  # a paste that ends in the attempts
    CONNECT_W,
    CONNECT_W + "\n" + CONNECT_RAISED + "\n",
    TRAINING + CONNECT_RAISED + "\n",                              # the raised error: always
    "[E socket.cpp:860] [c10d] The client socket has failed to connect to [node1]:29500 (errno: 111 - "
    "Connection refused).\n" + TRAINING,                           # an error-level record: always
])
def test_connect_failure_is_read(text: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "init-failure",
                                                                                 "c10d.rendezvous")


def test_helpers() -> None:
    assert connect_retry(CONNECT_W) and connect_retry(CONNECT_W_NEW) and connect_retry("[rank3]:" + CONNECT_W)
    assert not connect_retry(CONNECT_RAISED) and not connect_retry("[E socket.cpp:1] " + CONNECT_W[19:])
    assert went_on("Epoch 1 step 10/500 loss 2.1") and went_on(BAR) and went_on("iter 200: loss 3.01")
    assert not went_on(CONNECT_W) and not went_on("Traceback (most recent call last):")
