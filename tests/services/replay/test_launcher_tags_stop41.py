"""Launcher and runner tags the reader drops before the classifier reads a line, and an NCCL message whose head
is not in the paste (stop 41, hL2; from tuned wild-corpus logs):

* a role-named launcher tag with a replica index, ``[trainer0|0]:`` (TorchX / torchelastic roles), is a tag
  like ``[trainer3]:`` -- before, only ``[nameN]:`` was, so under ``[trainer0|0]:`` NCCL's ``Last error:`` line
  was not seen as one (``comm-init-nccl-socket-init-family-trainer-prefix-1837-1``, pytorch/pytorch#1837 of
  mmpretrain, tuned);
* NCCL's ``ncclXError: <meaning>`` line opens the NCCL message when the paste lacks its ``NCCL error in: ...,
  NCCL version ...`` head, so its ``Last error:`` and the last error after it are read with it (one item): the
  same log's ``ncclInternalError: Internal check failed.`` / ``Last error:`` / ``ncclSocketInit: ...`` is a
  set-up failure (comm/init-failure), where each line alone read as a generic internal error (comm/failure);
* a worker column in parentheses with a name and a comma (SkyPilot's ``(en-hi-spot, pid=18593) ``,
  ``comm-timeout-ray-prefixed-allreduce-axolotl-qwen-moe-1495-1``) or vLLM's ``(VllmWorker rank=1 pid=12231) ``
  / ``(EngineCore_DP0 pid=33630) `` is dropped like Ray's ``(RayWorker pid=..)``;
* ``kubectl logs --prefix``'s ``[pod/<pod>/<container>] `` column is dropped on every line, and a column the
  same on every line that starts with a stamp -- a bracketed stamp, or a stamp and the source in brackets
  (Azure ML's ``<date> [<node>, <ip>] ``) -- is dropped as a relay's logger prefix is (the line's time read
  first), so the lines under it read as the job printed them."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import LogReader, split_prefix

from .local_import import WILD, imported, pasted, shown

CASE_1837 = "comm-init-nccl-socket-init-family-trainer-prefix-1837-1"


@pytest.mark.parametrize("line, rank, rest", [
    ("[trainer0|0]:Last error:", None, "Last error:"),
    ("[trainer0|0]:ncclInternalError: Internal check failed.", None, "ncclInternalError: Internal check failed."),
    ("[trainer3]:twshared1016:1958:1958 [3] NCCL INFO x", None, "twshared1016:1958:1958 [3] NCCL INFO x"),
    ("[rank3]:[trainer1|2]: z", 3, "z"),
    ("(en-hi-spot, pid=18593) [E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught",
     None, "[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught"),
    ("(VllmWorker rank=1 pid=12231) ERROR 03-25 21:13:53 multiproc_executor.py:374] Traceback",
     None, "ERROR 03-25 21:13:53 multiproc_executor.py:374] Traceback"),
    ("(EngineCore_DP0 pid=33630) Traceback (most recent call last):", None, "Traceback (most recent call last):"),
    # unchanged: Ray's own prefixes and text in parentheses that is no worker column
    ("(RayTrainWorker pid=3738, ip=172.17.130.64) [W socket.cpp:432] y", None, "[W socket.cpp:432] y"),
    ("(pid=4009, ip=10.0.0.1) x", None, "x"),
    ("(see above, pid=12 was killed) x", None, "(see above, pid=12 was killed) x"),
    ("[trainer0|x]: y", None, "[trainer0|x]: y"),
])
def test_launcher_tags(line: str, rank: object, rest: str) -> None:
    assert split_prefix(line) == (rank, rest)


def _messages(path: Path) -> list:
    return [item.message for item in LogReader(path) if item.kind == "log"]


def test_headless_nccl_message_is_one_item_under_a_role_tag(tmp_path: Path) -> None:
    path = pasted(tmp_path, [
        "[trainer0|0]:ncclInternalError: Internal check failed.",
        "[trainer0|0]:Last error:",
        "[trainer0|0]:ncclSocketInit: connecting to address  with family 59936 is neither AF_INET(2) nor AF_INET6(10)",
        "[trainer0|0]:after",
    ])
    assert _messages(path) == [
        "ncclInternalError: Internal check failed.\nLast error:\n"
        "ncclSocketInit: connecting to address  with family 59936 is neither AF_INET(2) nor AF_INET6(10)",
        "after"]


def test_headless_nccl_message_without_a_last_error_is_its_own_line(tmp_path: Path) -> None:
    path = pasted(tmp_path, ["ncclSystemError: System call (socket, malloc, munmap, etc) failed.",
                             "RuntimeError: something else"])
    assert _messages(path)[0] == "ncclSystemError: System call (socket, malloc, munmap, etc) failed."


def test_the_1837_paste_reads_as_a_set_up_failure() -> None:
    kinds = shown(imported(WILD / CASE_1837 / "log.txt"))
    assert kinds and kinds[0] == "comm/init-failure"


# ---------------------------------------------------------------------------------------------------------
# A collector's column on EVERY line (bench/wild/stress.py --formats: tuned pastes that read right, with the
# column added; before, 48 of 639 lost their category under ``kubectl logs --prefix``'s column, 48 under a
# bracketed stamp and 49 under Azure ML's ``<date> [<node>, <ip>]`` -- the column hid the traceback's lines)

CASE_TB = "py-typeerror-forward-1"


@pytest.mark.parametrize("line, rank, rest", [
    ("[pod/train-worker-0/pytorch] [rank3]: x", 3, "x"),
    ("[pod/train-worker-0/pytorch]   File \"train.py\", line 3, in <module>", None,
     "  File \"train.py\", line 3, in <module>"),
    ("[pod/train-worker-0/pytorch] 2024-05-01T10:00:00.123Z [rank1]: y", 1, "y"),
    ("[pod] x", None, "[pod] x"),
    ("[pod/a b/c] x", None, "[pod/a b/c] x"),
])
def test_kubectl_prefix(line: str, rank: object, rest: str) -> None:
    assert split_prefix(line) == (rank, rest)


@pytest.mark.parametrize("tag", [
    "[2020-05-07 21:07:16] ",
    "[2020-05-07 21:07:16,123] ",
    "2020-05-07 21:07:16 [job-x-worker-1, unknown_ip] ",
    "[pod/train-worker-0/pytorch] ",
])
def test_a_column_on_every_line_does_not_hide_the_traceback(tmp_path: Path, tag: str) -> None:
    lines = (WILD / CASE_TB / "log.txt").read_text(encoding="utf-8").splitlines()
    path = pasted(tmp_path, [tag + s for s in lines])
    assert shown(imported(path))[:1] == ["process/exception"]


def test_relay_column_shapes(tmp_path: Path) -> None:
    from trainguard_server.replay.logs import paste_relay_prefix

    body = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
            "TypeError: forward() missing 1 required positional argument: 'x'"]
    stamped = [f"[2020-05-07 21:07:1{i}] " + s for i, s in enumerate(body)]
    assert paste_relay_prefix(pasted(tmp_path, stamped)) == len("[2020-05-07 21:07:10] ")
    aml = [f"2020-05-07 21:07:1{i} [job-x-worker-1, unknown_ip] " + s for i, s in enumerate(body)]
    assert paste_relay_prefix(pasted(tmp_path, aml)) == len("2020-05-07 21:07:10 [job-x-worker-1, unknown_ip] ")
    # a level in brackets after the stamp is a logger's record, not a source column
    records = [f"2020-05-07 21:07:1{i} [ERROR] " + s for i, s in enumerate(body)]
    assert paste_relay_prefix(pasted(tmp_path, records)) == 0
    # one line without the column: the paste keeps its lines as they are
    assert paste_relay_prefix(pasted(tmp_path, [*stamped, "plain line"])) == 0


# vLLM's formatter repeats its record header on every line of a multi-line message (a traceback it logs), and
# SGLang's bracketed stamp carries the parallel ranks (``[<date> DP4 TP4] ``): bench/wild/stress.py --formats
# lost 48 of 639 tuned pastes under each before, 13 and 2 after

@pytest.mark.parametrize("line, rest", [
    ("ERROR 03-25 21:13:53 [multiproc_executor.py:374] Traceback (most recent call last):",
     "Traceback (most recent call last):"),
    ('(VllmWorker rank=1 pid=12231) ERROR 03-25 21:13:53 [multiproc_executor.py:374]   File "x.py", line 3, in f',
     '  File "x.py", line 3, in f'),
    ("ERROR 03-25 21:13:53 multiproc_executor.py:374] RuntimeError: CUDA error: an illegal memory access",
     "RuntimeError: CUDA error: an illegal memory access"),
    # a record's own line keeps its header (its level)
    ("ERROR 03-25 21:13:53 [multiproc_executor.py:374] WorkerProc hit an exception: %s",
     "ERROR 03-25 21:13:53 [multiproc_executor.py:374] WorkerProc hit an exception: %s"),
    ("INFO 03-25 21:13:53 [core.py:1] Engine started", "INFO 03-25 21:13:53 [core.py:1] Engine started"),
])
def test_vllm_header_before_a_tracebacks_line(line: str, rest: str) -> None:
    assert split_prefix(line) == (None, rest)


@pytest.mark.parametrize("tag", [
    "ERROR 05-07 21:07:16 [multiproc_executor.py:374] ",
    "(VllmWorker rank=1 pid=12231) ERROR 05-07 21:07:16 [multiproc_executor.py:374] ",
    "[2020-05-07 21:07:16 DP4 TP4] ",
    "[2020-05-07 21:07:16 TP0] ",
])
def test_vllm_and_sglang_tags_do_not_hide_the_traceback(tmp_path: Path, tag: str) -> None:
    lines = (WILD / CASE_TB / "log.txt").read_text(encoding="utf-8").splitlines()
    path = pasted(tmp_path, [tag + s for s in lines])
    assert shown(imported(path))[:1] == ["process/exception"]


# A blank line of the job's output under a tag is the tag alone, its trailing space lost (a saved paste drops
# it): ``stderr:`` / ``[pod/x/y]`` / vLLM's header alone are that blank line, and a stamp column alone on a
# line does not keep paste_relay_prefix from finding the column (bench/wild/stress.py --formats: under
# ``stderr: `` 7 of 639 tuned pastes lost their category before, 3 after -- a blank line inside a traceback
# had become text)

@pytest.mark.parametrize("line", ["stderr:", "STDOUT:", "[pod/train-worker-0/pytorch]",
                                  "ERROR 03-25 21:13:53 [multiproc_executor.py:374]"])
def test_a_tag_alone_is_a_blank_line(line: str) -> None:
    assert split_prefix(line) == (None, "")


def test_a_stamp_column_alone_on_a_line(tmp_path: Path) -> None:
    from trainguard_server.replay.logs import paste_relay_prefix

    lines = ["[2020-05-07 21:07:10] Traceback (most recent call last):",
             '[2020-05-07 21:07:11]   File "train.py", line 3, in <module>',
             "[2020-05-07 21:07:12]",
             "[2020-05-07 21:07:13] TypeError: forward() missing 1 required positional argument: 'x'"]
    assert paste_relay_prefix(pasted(tmp_path, lines)) == len("[2020-05-07 21:07:10] ")


def test_stacked_tags_are_stripped_a_bounded_number_of_times() -> None:
    """A line of thousands of repeated tags strips MAX_STACKED_PREFIXES of them and keeps the rest as text (each
    strip copies the line: unbounded, a 1 MB line of ``[rank0]:`` took seconds -- stop 41 review); real stacks of
    two or three tags are stripped whole."""
    from trainguard_server.replay.logs import MAX_STACKED_PREFIXES
    rank, rest = split_prefix("[rank3]:" * 1000 + "RuntimeError: boom")
    assert rank == 3 and rest == "[rank3]:" * (1000 - MAX_STACKED_PREFIXES) + "RuntimeError: boom"
    assert split_prefix("[default1]:[rank1]:RuntimeError: boom") == (1, "RuntimeError: boom")
