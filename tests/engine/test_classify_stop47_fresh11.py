"""Wordings the classifier reads since stop 47 (hL2), from the TUNED side's misses of the eleventh fresh batch
(c35c7e9, measured once before any change):

* Open MPI's ``mpirun noticed that process rank N with PID P on node H exited on signal S (...)`` is read
  also when the paster replaced the PID (and the host) by a placeholder (``with PID xxxxxx on node
  xxxxxxxx``): the Horovod paste (Aware-of-the-history#2, signal 9) read nothing before.
* The failure-signal handler of Google's runtimes (absl / glog, as TPU, JAX and TensorFlow print it) is read
  in its other two forms beside glog's ``*** SIGTERM (@0x297b) received by PID ...``: with a null fault
  address and a redacted ``see`` link (``*** SIGSEGV (@(nil)), see gl__...#s15 received by PID 11743 (TID
  12350) on cpu 17; stack trace: ***``) and without the address (``*** SIGABRT received by PID 9361 (TID
  9361) on cpu 40 from PID 9361; stack trace: ***``): the process died of that signal. The JAX TPU-pod paste
  (jax#12456) read nothing before.
* gloo's older pair error ``[.../gloo/transport/tcp/pair.cc:611] Connect timeout [172.17.27.13]:27023`` is
  the pair not connecting to its peer while the group forms (comm/init-failure), as the newer ``connect
  [addr]:port: Connection timed out`` is; the caffe2 + mpirun paste (caffe2#360) read process/exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy47b"


def _reading(text: str) -> tuple:
    """(kind, rule) of ``text``; ("", "") when nothing is recognised."""
    found = classify_text(text)
    if found is None:
        return "", ""
    return f"{found.category}/{found.subtype}", found.rule


def _log(case: str) -> str:
    return (WILD / case / "log.txt").read_text(encoding="utf-8")


MPIRUN_PASTE = "proc-killed-mpirun-rank-1-signal-9-horovod-aware-history-2-1"


def test_mpirun_signal_with_a_redacted_pid_and_host() -> None:
    """The tuned paste: rank 1 killed by signal 9, its PID and host replaced by x's."""
    found = classify_text(_log(MPIRUN_PASTE))
    assert found is not None and (found.category, found.subtype) == ("process", "killed")
    assert (found.facts.get("signal"), found.facts.get("rank"), found.facts.get("launcher")) == (9, 1, "mpirun")
    assert shown(imported(WILD / MPIRUN_PASTE / "log.txt"))[:1] == ["process/killed"]


@pytest.mark.parametrize("pid, signal, kind", [
    ("xxxxxx", 11, "process/exit"),
    ("<pid>", 9, "process/killed"),
    ("0", 4, "process/exit"),
])
def test_mpirun_signal_pid_forms(pid: str, signal: int, kind: str) -> None:
    line = f"mpirun noticed that process rank 3 with PID {pid} on node node-7 exited on signal {signal} (X)."
    assert _reading(line)[0] == kind


JAX_PASTE = "proc-exit-tpu-pod-backend-init-warning-sigsegv-stack-jax-12456-1"


def test_absl_sigsegv_with_a_null_address_and_a_see_link() -> None:
    """The tuned paste: a JAX process on a TPU pod dies of SIGSEGV while its backend initialises."""
    found = classify_text(_log(JAX_PASTE))
    assert found is not None and (found.category, found.subtype) == ("process", "exit")
    assert (found.facts.get("signal"), found.facts.get("signal_name")) == (11, "SIGSEGV")
    assert shown(imported(WILD / JAX_PASTE / "log.txt"))[:1] == ["process/exit"]


@pytest.mark.parametrize("line, signal", [
    ("*** SIGSEGV (@(nil)), see gl__________41#s15 received by PID 11743 (TID 12350) on cpu 17; stack trace: ***",
     11),
    ("*** SIGSEGV (@0x0), see go/stacktraces#s15 received by PID 1234 (TID 1240) on cpu 3; stack trace: ***", 11),
    ("*** SIGABRT received by PID 9361 (TID 9361) on cpu 40 from PID 9361; stack trace: ***", 6),
    ("*** SIGTERM (@0x297b) received by PID 18396 (TID 0x7f) from PID 10619; stack trace: ***", 15),
])
def test_failure_signal_handler_forms(line: str, signal: int) -> None:
    found = classify_text(line)
    assert found is not None and found.facts.get("signal") == signal


@pytest.mark.parametrize("line", [
    "Signal handler installed: a SIGSEGV received by PID 12 will print a stack trace",
    "*** SIGSEGV is handled by the absl failure signal handler",
    "I0101 00:00:00.000 tpu_runtime.cc:12] *** Check failure stack trace: ***",
])
def test_words_about_signals_are_not_a_signal_report(line: str) -> None:
    """Prose about a signal handler is not a report of a death by signal (the vocabulary layer may still
    give the word SIGSEGV its low-confidence reading, as before)."""
    assert _reading(line)[1] != "launcher.signal"


CAFFE2_PASTE = "comm-init-gloo-pair-connect-timeout-mpirun-aborted-caffe2-360-1"


def test_old_gloo_pair_connect_timeout_is_an_init_failure() -> None:
    """The tuned paste: caffe2's param-init net raises gloo's pair ``Connect timeout`` across two hosts."""
    found = classify_text(_log(CAFFE2_PASTE))
    assert found is not None and (found.category, found.subtype, found.rule) == ("comm", "init-failure",
                                                                                  "gloo.connect")
    assert found.facts.get("peer") == "172.17.27.13:27023"
    assert shown(imported(WILD / CAFFE2_PASTE / "log.txt"))[:1] == ["comm/init-failure"]


@pytest.mark.parametrize("line", [
    "I0101 gloo/transport/tcp/pair.cc:120] connect timeout set to 30000ms",
    "INFO: gloo connect timeout [default]: 30 s",
])
def test_gloo_connect_timeout_settings_stay_quiet(line: str) -> None:
    assert _reading(line) == ("", "")


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy47b_pastes_open_nothing(case: str) -> None:
    """tests/fixtures/healthy47b: five real pastes of runs that were training (judged from their threads)."""
    assert classify_text((HEALTHY / case / "log.txt").read_text(encoding="utf-8")) is None
    assert shown(imported(HEALTHY / case / "log.txt")) == []
