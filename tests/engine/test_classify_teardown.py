"""Text that comes AFTER (or beside) the real error must not take its place -- stop 42 review findings:

* a glibc heap abort printed after a Python exception (native libraries' teardown once the error ended the
  program) is that exception's consequence: the exception stays the verdict; alone, the abort is the crash;
* torch's warning at the first barrier of a healthy run names ``init_process_group()``: it is no sign that a
  later NCCL failure inside a collective happened while the communicator was being set up."""

from __future__ import annotations

from trainguard_engine.classify import classify_text

KEYERROR = """Traceback (most recent call last):
  File "train.py", line 10, in <module>
    x = batch["labels"]
KeyError: 'labels'
"""
STATE_DICT = """Traceback (most recent call last):
  File "train.py", line 41, in <module>
    model.load_state_dict(ckpt)
RuntimeError: Error(s) in loading state_dict for Net:
	Missing key(s) in state_dict: "fc.weight".
"""
BARRIER_WARNING = ("[W1205 10:00:00.000000 1234 ProcessGroupNCCL.cpp:4115] [PG ID 0 PG GUID 0 Rank 0]  using GPU 0 "
                   "to perform barrier as devices used by this process are currently unknown. This can "
                   "potentially cause a hang if this rank to GPU mapping is incorrect. Specify device_ids in "
                   "barrier() to force use of a particular device, or call init_process_group() with a "
                   "device_id.\n")
ALL_REDUCE_FAILED = """Traceback (most recent call last):
  File "train.py", line 80, in <module>
    dist.all_reduce(t)
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, \
unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3
"""


def test_an_exception_before_a_glibc_abort_stays_the_verdict() -> None:
    for error, exc in ((KEYERROR, "KeyError"), (STATE_DICT, "RuntimeError")):
        for abort in ("double free or corruption (!prev)\nAborted (core dumped)\n",
                      "free(): invalid pointer\nAborted (core dumped)\n"):
            found = classify_text(error + abort)
            assert found is not None
            assert (found.category, found.subtype) == ("process", "exception"), (exc, abort, found.headline)
            assert exc in found.headline


def test_a_glibc_abort_alone_is_the_crash() -> None:
    found = classify_text("*** Error in `/usr/bin/python': double free or corruption (!prev): 0x000055bbaca66830"
                          " ***\n======= Backtrace: =========\n/lib/x86_64-linux-gnu/libc.so.6(+0x777e5)\n")
    assert found is not None and (found.category, found.subtype) == ("process", "exit")
    assert found.facts.get("signal") == 6


def test_the_barrier_warning_is_no_set_up_context() -> None:
    steps = "".join(f"{{'loss': {2.3 - i / 100:.2f}, 'epoch': 0.{i:02d}}}\n" for i in range(20))
    found = classify_text(BARRIER_WARNING + steps + ALL_REDUCE_FAILED)
    assert found is not None and (found.category, found.subtype) == ("comm", "failure")
    during_set_up = classify_text("  File \"train.py\", line 12, in main\n    dist.init_process_group('nccl')\n"
                                  + ALL_REDUCE_FAILED.replace("dist.all_reduce(t)", "dist.barrier()"))
    assert during_set_up is not None and (during_set_up.category, during_set_up.subtype) == ("comm", "init-failure")
