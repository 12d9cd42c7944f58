"""Wordings the classifier reads since stop 47 (hL), from the TUNED side's misses of all batches (the tenth
fresh batch, 3db24a7, was measured once before any change):

* gloo's ``Gloo connectFullMesh failed`` is the group's pairs not connecting (comm/init-failure) also when
  the paste cuts or quotes it before its ``with [...pair.cc:N] ...`` reason -- a sentence quoting
  ``"RuntimeError: Gloo connectFullMesh failed ..."`` (Megatron-LM#877) read comm/failure by its words
  before; gloo raises it for nothing else.
* HCCL's (Ascend NPUs, ``torch_npu``) timeout codes -- EI0002 ``The wait execution of the Notify register
  times out`` (a collective past HCCL_EXEC_TIMEOUT) and EI0006 ``Getting socket times out. Reason: Remote Rank
  did not send the data in time`` -- are this rank waiting on a stuck or dead peer (comm/timeout), whatever
  stack prints them; the vLLM-Ascend GRPO paste read comm/failure by its words (``HcclAllreduce, error code
  is 6``) before.
* On Intel GPUs (XPU) the Level Zero / Unified Runtime status ``UR_RESULT_ERROR_DEVICE_LOST`` /
  ``ZE_RESULT_ERROR_DEVICE_LOST`` is the device lost, as NVIDIA's ``GPU has fallen off the bus`` is
  (memory/cuda-error, error_class gpu-lost); the torch-xpu-ops DDP paste read process/exception before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _kind(text: str) -> str:
    return _reading(text, "")[0]


def _reading(text: str, fact: str) -> tuple:
    """(kind, rule, facts[fact]) of ``text``; ("", "", None) when nothing is recognised."""
    found = classify_text(text)
    if found is None:
        return "", "", None
    return f"{found.category}/{found.subtype}", found.rule, found.facts.get(fact)


def test_a_quoted_connect_full_mesh_failure_is_an_init_failure() -> None:
    """The tuned paste (Megatron-LM#877), a sentence quoting the error."""
    text = (WILD / "comm-init-gloo-connectfullmesh-prose-megatron-877-1" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "init-failure",
                                                                                  "gloo.connect")
    assert "error" not in found.facts


@pytest.mark.parametrize("text", [
    "RuntimeError: Gloo connectFullMesh failed",
    "RuntimeError: Gloo connectFullMesh failed ...",
    "RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] "
    "no error",
])
def test_connect_full_mesh_with_or_without_its_reason(text: str) -> None:
    assert _kind(text) == "comm/init-failure"


def test_the_reason_is_kept_when_printed() -> None:
    found = classify_text("RuntimeError: Gloo connectFullMesh failed with [pair.cc:144] no error")
    assert found is not None and found.facts["error"] == "[pair.cc:144] no error"


HCCL_CASE = "comm-timeout-hccl-allreduce-socket-times-out-grpo-vllm-ascend-486-1"
XPU_CASE = "mem-cuda-error-xpu-device-lost-ddp-backward-engine-reset-torch-xpu-ops-5164-1"


@pytest.mark.parametrize("case, kind, facts", [
    (HCCL_CASE, "comm/timeout", {"code": "EI0006", "rank": 1, "backend": "hccl"}),
    (XPU_CASE, "memory/cuda-error", {"error_class": "gpu-lost"}),
])
def test_the_tuned_pastes_read_their_kind(case: str, kind: str, facts: dict) -> None:
    """Whole text and through ``trainguard replay``."""
    found = classify_text((WILD / case / "log.txt").read_text(encoding="utf-8"))
    assert found is not None and f"{found.category}/{found.subtype}" == kind
    assert {key: found.facts.get(key) for key in facts} == facts
    assert shown(imported(WILD / case / "log.txt"))[:1] == [kind]


@pytest.mark.parametrize("text, code", [
    ("EI0002: [PID: 198748] 2025-03-26-13:49:01.670.614 The wait execution of the Notify register times out. "
     "Reason: The Notify register has not received the Notify record from remote rank: [unknown].", "EI0002"),
    ("(train pid=8464) EI0002: [PID: 13075] 2025-06-25-10:45:23.586.187 The wait execution of the Notify "
     "register times out. Reason: ...", "EI0002"),
    ("Getting socket times out. Reason: Remote Rank did not send the data in time.", None),
])
def test_hccl_timeout_codes(text: str, code: object) -> None:
    assert _reading(text, "code") == ("comm/timeout", "hccl.timeout", code)


@pytest.mark.parametrize("text", [
    "RuntimeError: level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)",
    "Level Zero call zeCommandQueueSynchronize failed: ZE_RESULT_ERROR_DEVICE_LOST",
])
def test_level_zero_device_lost(text: str) -> None:
    assert _kind(text) == "memory/cuda-error"


@pytest.mark.parametrize("text, kind", [
    # healthy set-up lines of each stack: none reads the kind its rule gives
    ("INFO: gloo backend selected, connectFullMesh took 0.4 s", "comm/init-failure"),
    ("[W ProcessGroupGloo.cpp:715] Warning: Unable to resolve hostname to a (local) address. Using the "
     "loopback address as fallback.", "comm/init-failure"),
    ("[INFO] HCCL_CONNECT_TIMEOUT=1800, HCCL_EXEC_TIMEOUT=1800", "comm/timeout"),
    ("hccl init success, rank 3 of 8 (socket connected in 0.4 s)", "comm/timeout"),
    ("[INFO] level_zero adapter loaded: UR_RESULT_SUCCESS", "memory/cuda-error"),
    ("Found 2 XPU devices (Intel(R) Arc(TM) Pro B60), level_zero v1.21", "memory/cuda-error"),
])
def test_healthy_lines_stay_quiet(text: str, kind: str) -> None:
    assert _kind(text) != kind
