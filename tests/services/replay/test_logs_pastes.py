"""The replay reader on shapes real pastes take (fixtures: tests/fixtures/wild, real logs from public issue
threads): frame lines that lost their indentation, a docker compose service column, c10 messages whose
``[rankN]:`` prefix is on the first line only, an mp.spawn failure naming its process."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Callable, List

from bench.wild import corpus, judge
from trainguard_engine.classify import classify_chain
from trainguard_server.replay.logs import (
    LogItem,
    LogReader,
    paste_indent,
    paste_numbered,
    paste_relay_prefix,
    paste_task_labels,
    paste_wrap,
    paste_wrap_width,
    unwrap_markup,
    unwrapped,
)

WILD = Path(__file__).resolve().parents[2] / "fixtures" / "wild"


def items(case: str) -> List[LogItem]:
    return list(LogReader(WILD / case / "log.txt", 0, min_level=""))


def test_frames_without_indentation_stay_in_their_traceback() -> None:
    # ' File ...' and 'File ...' at columns 1 and 0 between indented lines (VICO-UoE/MTPSL#3)
    got = items("py-shape-mat1-1")
    assert [i.kind for i in got] == ["exception"]
    payload = got[0].payload
    assert payload["type"] == "RuntimeError" and payload["message"].startswith("mat1 and mat2 shapes")
    assert len(payload["frames"]) == 4 and payload["frames"][-1]["function"] == "forward"


def test_a_compose_service_column_is_stripped() -> None:
    # 'daskcluster-worker-1     | Exception: ...' (saturncloud/dask-pytorch-ddp)
    got = [i for i in items("py-assert-dask-1") if i.kind == "exception"]
    assert len(got) == 2 and {i.payload["type"] for i in got} == {"Exception"}
    assert all(i.payload["message"] == "'AssertionError()'" for i in got)


def test_a_c10_message_continues_on_its_prefixed_rank() -> None:
    # '[rank3]:[E923 ...] ... watchdog thread terminated with exception: CUDA error: misaligned address' and
    # its unprefixed 'CUDA kernel errors might be ...' / 'frame #0: ...' lines (verl-project/verl#3579)
    got = items("mem-misaligned-watchdog-verl-1")
    assert {i.rank for i in got} == {3}


def test_an_mp_spawn_failure_names_its_process_as_the_rank() -> None:
    got = [i for i in items("py-spawn-process1-2") if i.kind == "exception"]
    assert len(got) == 1
    found = classify_chain(got[0].payload["type"], got[0].payload["message"], got[0].payload.get("chain") or ())
    assert found.kind == "process/exception" and found.facts["rank"] == 1


def test_a_launcher_column_before_stacked_rank_prefixes_is_stripped() -> None:
    # 'i.pretrain/0 [default2]:[rank2]: RuntimeError: Rank 2, ...' (NVIDIA-NeMo/Speech#14348): nemo-run's task
    # column, torchrun's --tee prefix, torch's rank prefix
    got = items("num-nemo-gradnorm-nan-default-prefix-1")
    err = [i for i in got if "Unexpected result nan" in (i.message or i.payload.get("message", ""))]
    assert len(err) == 1 and err[0].rank == 2


def test_a_traceback_under_a_first_line_rank_column_stays_on_that_rank() -> None:
    # ParlAI's 'rank:  3 | ... CRITICAL | Traceback (most recent call last):' then unprefixed frames
    # (facebookresearch/ParlAI#4452)
    got = [i for i in items("mem-oom-parlai-rank-logger-1") if i.kind == "exception"]
    assert got and {i.rank for i in got} == {3}
    assert any("CUDA out of memory" in i.payload["message"] for i in got)


def test_torchruns_failure_entry_fields_are_its_ranks(tmp_path: Path) -> None:
    # a failure summary whose ChildFailedError line AND 'Root Cause' head were cut: 'rank : 1 (local_rank: 1)'
    # then 'traceback : Signal 6 (SIGABRT) received by PID ...' (czp16/Bridge-LLM-reasoning#1, from its entry
    # '[0]:' on): the entry's fields are rank 1's
    lines = (WILD / "mem-abort-torchrun-table-sft-1" / "log.txt").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines[lines.index("[0]:"):]) + "\n", encoding="utf-8")
    got = list(LogReader(path, 0, min_level=""))
    signal = [i for i in got if "received by PID" in i.message]
    assert len(signal) == 1 and signal[0].rank == 1
    assert all(i.rank == 0 for i in got if "rank      :" in i.message)


def test_a_summary_that_names_its_root_cause_is_read_whole(tmp_path: Path) -> None:
    # the same paste with its 'Root Cause (first observed failure):' head: read as the ChildFailedError it is
    # the message of (as when that line is in the text), so torchrun's root cause -- rank 1's SIGABRT -- is
    # what the classifier reads
    got = items("mem-abort-torchrun-table-sft-1")
    (exc,) = [i for i in got if i.kind == "exception"]
    assert exc.payload["type"].endswith("ChildFailedError") and (exc.line, exc.last_line) == (1, 11)
    assert "received by PID 2195196" in exc.payload["message"]
    assert [i.message for i in got if i.kind == "log"] == ["SFT completed"]
    found = classify_chain(exc.payload["type"], exc.payload["message"])
    assert found.rule == "torchrun.child-failed" and found.facts["root_cause_rank"] == 1
    # pytorch#123070's summary without its ChildFailedError line lists ranks 1-3 before its root cause,
    # rank 0: rank 0 leads (before: rank 1, the entry listed first)
    lead = [judge.replay_local(c).lead_rank for c in corpus.load()
            if c.case_id == "mem-oom-fsdp-summary-only-123070-1"]
    assert lead == [0]
    # cut above the root cause's 'rank' field, it is read line by line as before (each entry its rank's)
    lines = (WILD / "mem-oom-fsdp-summary-only-123070-1" / "log.txt").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines[:lines.index("[0]:") + 1]) + "\n", encoding="utf-8")
    exits = [i for i in LogReader(path, 0, min_level="") if "exitcode  :" in i.message]
    assert [i.kind for i in exits] == ["log"] * 3 and [i.rank for i in exits] == [1, 2, 3]


def test_a_paste_that_names_one_rank_as_its_own_is_that_ranks() -> None:
    from trainguard_server.replay.logs import scan_log

    # CUDA assertion lines, then '[E ProcessGroupNCCL.cpp:915] [Rank 1] NCCL watchdog thread terminated ...'
    # (pytorch/pytorch#112488): given as rank 0 (the default), the paste is rank 1's
    scan = scan_log(WILD / "mem-device-assert-bce-watchdog-rank1-1" / "log.txt")
    assert scan.named == [1] and scan.own_rank(0) == 1 and scan.own_rank(5) == 5
    # several ranks' unprefixed watchdog lines (OFA-Sys/OFA#271): no one rank's output
    several = scan_log(WILD / "comm-watchdog-legacy-1" / "log.txt")
    assert len(several.named) > 1 and several.own_rank(0) == 0
    # '[rankN]:' prefixes already say whose lines are whose
    prefixed = scan_log(WILD / "mem-misaligned-watchdog-verl-1" / "log.txt")
    assert prefixed.own_rank(0) == 0


def test_an_nccl_error_message_is_one_item_with_its_last_error() -> None:
    # 'GroupNCCL.cpp:1275, internal error, NCCL version 2.14.3' / 'ncclInternalError: ...' / 'Last error:' /
    # 'Net : Connection closed by remote peer ...', then a Lightning traceback cut at the bottom
    got = items("comm-rank-lost-internal-closed-1")
    first = got[0]
    assert first.kind == "log" and (first.line, first.last_line) == (1, 4)
    assert first.message.endswith("Net : Connection closed by remote peer user<43236>")
    found = classify_chain("", first.message)
    assert found.kind == "comm/rank-lost"  # the reason read with its last error (alone: comm/failure)
    assert got[1].line == 5 and "Traceback" in got[1].message


def test_a_nan_loss_after_the_fp16_scale_collapsed_is_the_collapses_consequence() -> None:
    # BERT pre-training with apex (NVIDIA/DeepLearningExamples#543): the printed loss_scale halves at every
    # logged step from 2.9e-11 on, then 'average_loss : nan' -- the scale collapsed first, so the NaN is its
    # consequence (correlate.AFTER_AMP_OVERFLOW); before, the NaN loss was an incident of its own and led
    from bench.wild import corpus, judge

    case = next(c for c in corpus.load() if c.case_id == "num-amp-loss-scale-dll-1")
    verdict = judge.replay_local(case)
    assert verdict.kind == "memory/amp-overflow" and verdict.kinds == ("memory/amp-overflow",)


def test_a_reset_raised_inside_init_process_group_is_an_init_failure_given_its_frames() -> None:
    # Kubeflow mnist worker (kubeflow/trainer#2008): 'RuntimeError: Connection reset by peer' from
    # dist.init_process_group -- its message alone is a plain exception; its frames say the group never came up
    exc = next(i for i in items("comm-init-reset-by-peer-1") if i.kind == "exception").payload
    assert classify_chain(exc["type"], exc["message"]).kind == "process/exception"
    found = classify_chain(exc["type"], exc["message"], exc.get("chain") or (), exc["frames"])
    assert found.kind == "comm/init-failure" and found.rule == "frames.process-group-init"
    assert found.facts["raised_in"] == "init_process_group"
    # a model error's frames (no set-up function among them) change nothing
    shape = next(i for i in items("py-shape-mat1-1") if i.kind == "exception").payload
    assert classify_chain(shape["type"], shape["message"], (), shape["frames"]).kind == "process/exception"


def test_the_pipeline_reads_an_exceptions_frames_a_reset_inside_init_process_group_is_an_init_failure() -> None:
    # the same Kubeflow paste through the pipeline (detectors/process.py hands the event's frames to the
    # classifier): the run's verdict is the group that never came up, not a plain exception
    from bench.wild import corpus, judge

    case = next(c for c in corpus.load() if c.case_id == "comm-init-reset-by-peer-1")
    verdict = judge.replay_local(case)
    assert verdict.kind == "comm/init-failure", verdict.kinds


def test_the_lost_rank_dying_of_a_signal_is_the_crash_not_a_lost_peer() -> None:
    # StreamVLN under torchrun (InternRobotics/StreamVLN#66): rank 0's NCCL service thread says 'Connection
    # closed by localRank 1', then the agent says local_rank 1 failed with exitcode -8 (SIGFPE) -- the peer
    # saw rank 1's process go away because it crashed (correlate._crash_leads); before, comm/rank-lost led
    from bench.wild import corpus, judge

    case = next(c for c in corpus.load() if c.case_id == "proc-sigfpe-elastic-streamvln-1")
    verdict = judge.replay_local(case)
    assert (verdict.kind, verdict.lead_rank) == ("process/exit", 1), verdict
    # many ranks' 'Connection closed by localRank N' and no exit line stay a lost peer
    case = next(c for c in corpus.load() if c.case_id == "comm-rank-lost-service-closed-1")
    assert judge.replay_local(case).kind == "comm/rank-lost"


def test_the_heartbeat_monitors_stuck_watchdog_line_is_a_collective_hang() -> None:
    # LlamaFactory streaming training stuck (hiyouga/LlamaFactory#8549): one line, 'ProcessGroupNCCL's watchdog
    # got stuck for 480 seconds without making progress ...' -- before, it imported and opened nothing
    (item,) = items("comm-heartbeat-stuck-streaming-llamafactory-1")
    found = classify_chain("", item.message)
    assert found.kind == "comm/timeout" and found.rule == "nccl.heartbeat-stuck"
    assert found.facts["stuck_s"] == 480 and found.facts["rank"] == 2


def test_a_torchrun_summary_without_its_root_cause_is_the_launchers_report_not_a_crash() -> None:
    # roboMamba under torchrun (lmzpai/roboMamba#10): the agent's glog-style line says local_rank 5 failed
    # with exitcode -9, then its ChildFailedError summary shows only '<NO_OTHER_FAILURES>' (the root cause
    # entry is outside the paste) -- before, that summary led as 'Crashed: ChildFailedError' on rank 0
    from bench.wild import corpus, judge

    summary = [i for i in items("proc-killed-glog-9-nootherfailures-robomamba-1") if i.kind == "exception"]
    assert len(summary) == 1
    found = classify_chain(summary[0].payload["type"], summary[0].payload["message"])
    assert (found.kind, found.rule) == ("process/exit", "torchrun.summary-without-root")
    assert found.confidence < 0.6 and found.facts["job"] == "test.py"
    case = next(c for c in corpus.load() if c.case_id == "proc-killed-glog-9-nootherfailures-robomamba-1")
    verdict = judge.replay_local(case)
    assert (verdict.kind, verdict.lead_rank) == ("process/killed", 5), verdict
    assert verdict.kinds == ("process/killed",)


def test_an_exception_line_a_paste_wrapped_in_markdown_is_that_exception() -> None:
    # wmyw96/FAST-NN#1 wraps the error in inline code ('`RuntimeError: Expected all tensors ...`'),
    # haoosz/ConceptExpress#5 in bold italics ('_**RuntimeError: ...**_'): before, plain log lines that opened
    # nothing (a model-side error opens an incident only as an exception)
    for case, where in (("py-device-mismatch-backticks-wrapper-mm-fastnn-1", "wrapper_mm"),
                        ("py-device-mismatch-bold-italic-conceptexpress-1", "wrapper__index_select")):
        (item,) = items(case)
        assert item.kind == "exception" and item.payload["type"] == "RuntimeError", case
        message = item.payload["message"]
        assert message.startswith("Expected all tensors") and message.endswith(f"method {where})"), message
        found = classify_chain(item.payload["type"], message)
        assert (found.kind, found.rule) == ("process/exception", "model.device-mismatch")
    # a line that only starts with markup stays a line
    assert unwrap_markup("**Epoch 3** loss 0.1") is None and unwrap_markup("`python train.py`") is None


def test_a_retyped_cuda_error_without_spaces_is_a_cuda_error() -> None:
    # Sierkinhane/CRNN_Chinese_Characters_Rec#137: 'RuntimeError:cuda error:unspecified launch failure' as the
    # user typed it (no spaces, lower case) -- before, nothing was recognised in the log
    line = (WILD / "mem-unspecified-launch-ctc-loss-crnn-1" / "log.txt").read_text(encoding="utf-8").splitlines()[-1]
    found = classify_chain("", line)
    assert found.kind == "memory/cuda-error" and found.facts["error_class"] == "launch-failure"
    # the words in a sentence are not an error message
    assert classify_chain("", "no cuda error was printed before the hang").rule == "python.exception"


def test_a_traceback_cut_inside_process_group_set_up_is_one_item_that_says_the_group_never_came_up() -> None:
    # OpenRLHF SFT (OpenRLHF/OpenRLHF, port taken): the paste ends at the frame
    # 'torch.distributed.init_process_group(backend,' with no exception line -- before, 17 plain lines and
    # no incident; now one exception of no known type whose innermost frame is the set-up call
    (item,) = items("comm-init-frames-only-openrlhf-1")
    assert item.kind == "exception" and (item.line, item.last_line) == (1, 17)
    assert item.payload["type"] == "<unknown exception>"
    assert item.payload["frames"][-1]["function"] == "init_process_group"
    found = classify_chain(item.payload["type"], item.payload["message"], (), item.payload["frames"])
    assert found.kind == "comm/init-failure" and found.facts["raised_in"] == "init_process_group"
    # torchelastic's c10d rendezvous store creation is set-up too (pytorch/pytorch#69197: 'connect() timed
    # out' raised in _create_tcp_store, the chained RendezvousConnectionError cut): before, process/exception
    (cause,) = [i for i in items("comm-init-c10d-rdzv-connect-timeout-chained-69197-1") if i.kind == "exception"]
    found = classify_chain(cause.payload["type"], cause.payload["message"], (), cause.payload["frames"])
    assert found.kind == "comm/init-failure" and found.facts["raised_in"] == "_create_tcp_store"
    # a traceback cut inside the launcher's own frames (launch_agent: a rendezvous or a worker failure alike)
    # still says nothing of what failed: its lines stay lines
    assert all(i.kind == "log" for i in items("comm-init-rdzv-timeout-2"))


def _as_pasted(tmp_path: Path, case: str, how: Callable[[str], str]) -> List[LogItem]:
    """The items of a tuned wild log after a paste or a relay put ``how(line)`` in place of every line."""
    lines = (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "log.txt"
    path.write_text("\n".join(how(line) if line.strip() else line for line in lines) + "\n", encoding="utf-8")
    return list(LogReader(path, 0, min_level=""))


def test_what_a_paste_or_a_relay_puts_before_every_line_is_dropped(tmp_path: Path) -> None:
    # the RLHF-V paste (RLHF-V/RLHF-V#11) quotes every line with '> '; accelerate relays a child's output as
    # 'stderr: ...' (hiyouga/LlamaFactory#163); a markdown code block indented by a tab or 4 spaces; kubectl
    # logs --timestamps. Before, the traceback below so pasted was plain lines and no exception, and 43
    # (quote), 41 (stderr), 38 (tab), 44 (stamp) of the 321 tuned logs changed category so pasted
    plain = items("comm-init-reset-by-peer-1")
    want = [(i.kind, i.payload.get("type"), i.payload.get("message")) for i in plain if i.kind == "exception"]
    assert want and want[0][1] == "RuntimeError"
    for how in (lambda line: "> " + line, lambda line: "stderr: " + line, lambda line: "\t" + line,
                lambda line: "    " + line, lambda line: "2024-05-01T10:00:00.123Z " + line):
        got = _as_pasted(tmp_path, "comm-init-reset-by-peer-1", how)
        assert [(i.kind, i.payload.get("type"), i.payload.get("message")) for i in got
                if i.kind == "exception"] == want, how("")
    # the collector's stamp is the line's time
    stamped = _as_pasted(tmp_path, "py-keyerror-1", lambda line: "2024-05-01T10:00:00.123Z " + line)
    assert {i.time_ns for i in stamped} == {1714557600123000000}
    # a traceback cut at the top (frames' own 2-space indent on every line) keeps its frames
    assert paste_indent(WILD / "mem-illegal-access-accelerator-error-megatron-miles-1" / "log.txt") == ""


def _wrapped(tmp_path: Path, case: str, width: int, padded: bool) -> Path:
    """A tuned wild log as a terminal ``width`` columns wide shows it, copied from the screen: every long
    line cut into ``width``-character pieces, each row padded with spaces when ``padded``."""
    rows: List[str] = []
    for line in (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines():
        pieces = [line[i:i + width] for i in range(0, len(line), width)] or [""]
        rows.extend(piece.ljust(width) if padded else piece for piece in pieces)
    path = tmp_path / f"{case}-{width}.txt"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _said(item: LogItem) -> tuple:
    return (item.kind, item.message.rstrip(), item.payload.get("type"),
            str(item.payload.get("message", "")).rstrip())


def test_lines_a_terminal_wrapped_are_joined_again(tmp_path: Path) -> None:
    # comm-watchdog-broadcast-1 (tuned) was pasted wrapped at 137 columns: its watchdog line is one line again
    assert paste_wrap_width(WILD / "comm-watchdog-broadcast-1" / "log.txt") == 137
    texts = [i.message for i in items("comm-watchdog-broadcast-1")]
    assert any("WorkNCCL(SeqNum=4, OpType=BROADCAST, NumelIn=112" in t for t in texts), texts
    # tuned logs wrapped by a 120-column terminal (copied as is) and a 160-column one (copied from the
    # screen, rows padded): the same items as the log itself. Before, 32 (120) and 9 (160, padded) of the
    # 358 tuned logs changed category so pasted; after, 9 (single long lines, too little to tell a wrap)
    # and 2
    for case, width, padded in (("comm-watchdog-ray-1", 120, False), ("comm-gloo-recv-timeout-1", 160, True),
                                ("proc-exit1-launch-repvit-1", 120, False)):
        path = _wrapped(tmp_path, case, width, padded)
        assert paste_wrap_width(path) == width, case
        want = [_said(i) for i in items(case)]
        assert [_said(i) for i in LogReader(path, 0, min_level="")] == want, case
    # not a wrap: the same longest line printed by several ranks, a tqdm bar's fixed width
    for case in ("comm-watchdog-terminate-accelerate-stuck-1", "num-loss-nan-epoch-finished-wetectron-1",
                 "comm-nccl-system-error-ddp-init-interleaved-1", "py-typeerror-forward-1"):
        assert paste_wrap_width(WILD / case / "log.txt") == 0, case


def test_a_wrap_after_a_space_joins_in_a_mostly_full_width_paste(tmp_path: Path) -> None:
    # proc-sigkill-deepspeed-llava-wsl-1 (tuned; one DeepSpeed exit line, itself broken once in the paste)
    # at 80 columns: nearly every row is 80 long, so the paste reads as copied from the screen (padded), and
    # its last full row ends in the single space of 'exits with return code = ' -- a wrap after a space, not
    # padding (padding is spaces to the last column): '-9' joins it again and the exit reads as SIGKILL
    path = _wrapped(tmp_path, "proc-sigkill-deepspeed-llava-wsl-1", 80, False)
    assert paste_wrap(path) == (80, True)
    texts = [i.message for i in LogReader(path, 0, min_level="")]
    assert any(t.endswith("exits with return code = -9") for t in texts), texts
    # a full row ending in two spaces or more is a line's padded end (the next row a line of its own); one
    # ending in a single space goes on
    rows = ["a" * 78 + "  ", "b" * 60, "c" * 79 + " ", "dd"]
    path = tmp_path / "padded.txt"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with path.open("rb") as fh:
        assert [(n, len(text)) for n, text in unwrapped(fh, 80, padded=True)] == [(1, 80), (2, 60), (3, 82)]


def test_a_short_message_wrapped_once_at_a_console_width_joins(tmp_path: Path) -> None:
    # mem-hip-memory-access-fault-training-rocm-1535-1 (tuned): the HSA runtime's one long line and 'Aborted'.
    # At 80 columns it is one wrapped piece -- too little to tell a wrap at any width, so its head and tail
    # were two lines and the fault was not read (stress.py's wrap80: 16 tuned pastes lost, wrap120: 16).
    # At a console's width (TERMINAL_WIDTHS) one piece is enough
    case = "mem-hip-memory-access-fault-training-rocm-1535-1"
    for width in (80, 120):
        path = _wrapped(tmp_path, case, width, False)
        assert paste_wrap(path) == (width, False), width
        assert [_said(i) for i in LogReader(path, 0, min_level="")] == [_said(i) for i in items(case)]
    # one piece at a width no console opens with stays two lines (a line that long by chance)
    rows = ["x" * 81, "continues here", "short"]
    path = tmp_path / "odd.txt"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert paste_wrap(path) == (0, False)
    rows = ["x" * 80, "continues here", "short"]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert paste_wrap(path) == (80, False)
    # a progress bar is as wide as the console by design: the crash printed after it is a line of its own
    stats = "| 8/1122 [00:03<08:00,  2.32it/s]"
    bar = "  1%|" + "#" * (80 - 5 - len(stats)) + stats
    rows = [bar, "Floating point exception (core dumped)"]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert paste_wrap(path) == (0, False)


def test_an_invalid_usage_nccl_message_is_one_item_and_a_ci_stamp_column_is_dropped() -> None:
    # D-FINE#289: 'NCCL error ... invalid usage ..., NCCL version 2.19.3' goes on with 'ncclInvalidUsage: ...'
    # (no 'Error' in the code's name), 'Last error:' and 'Duplicate GPU detected ...': one item, its last error
    # read with the reason (before: four lines, the code line ending the message)
    (item,) = items("comm-init-duplicate-gpu-default-device-dfine-289-1")
    assert (item.line, item.last_line) == (1, 4) and item.message.endswith("both on CUDA device 2000")
    # pytorch#12744: CircleCI's 'Oct 16 02:07:00 ' before every line is dropped: the traceback is one again
    got = items("comm-unhandled-cuda-terminate-ci-stamps-c10d-12744-1")
    assert [i.kind for i in got] == ["log", "log", "exception"]
    assert got[1].message.startswith("  what():  NCCL error in:")
    assert got[2].payload["message"] == "test_c10d failed! Received signal: SIGIOT"


def test_a_frame_line_cut_inside_its_path_is_joined_again(tmp_path: Path) -> None:
    # comm-init-reset-by-peer-1 (tuned) at 81 columns: only its one long frame line wraps ('  File
    # ".../distributed_c1' / '0d.py", line 360, in init_process_group'), too little to tell a terminal's width
    # (81 is no console's, TERMINAL_WIDTHS); a frame line always closes its quote, so the two rows are one
    # line again and the traceback parses whole. At 80 columns (a console's width) the one piece tells the
    # wrap and the same items come out
    want = [_said(i) for i in items("comm-init-reset-by-peer-1")]
    for width, told in ((81, 0), (80, 80)):
        path = _wrapped(tmp_path, "comm-init-reset-by-peer-1", width, False)
        assert paste_wrap_width(path) == told
        assert [_said(i) for i in LogReader(path, 0, min_level="")] == want
    # not a frame's rest: the held row goes on as it was
    rows = ['  File "/opt/x/y', "RuntimeError: boom"]
    path = tmp_path / "open.txt"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with path.open("rb") as fh:
        assert list(unwrapped(fh, 0)) == [(1, rows[0]), (2, rows[1])]


def test_a_line_number_gutter_is_dropped(tmp_path: Path) -> None:
    # an editor's or a log viewer's gutter copied with the lines ('  12 text', '12: text', '12\ttext'):
    # before, 40 of the 358 tuned logs changed category so pasted; after, 4 (logs of one or two lines, too
    # short to tell a gutter)
    for case in ("comm-init-reset-by-peer-1", "proc-exit1-torchrun-summary-minigpt4-1"):
        want = [_said(i) for i in items(case)]
        for gutter in (lambda n: f"{n:>4} ", lambda n: f"{n}: ", lambda n: f"{n}\t"):
            lines = (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()
            path = tmp_path / "log.txt"
            path.write_text("\n".join(gutter(n) + line for n, line in enumerate(lines, 1)) + "\n",
                            encoding="utf-8")
            assert paste_numbered(path), (case, gutter(7))
            assert [_said(i) for i in LogReader(path, 0, min_level="")] == want, (case, gutter(7))
    # not a gutter: a table whose first column counts steps (yanmtt's 'step loss' rows), lines that do not
    # count by one
    table = tmp_path / "table.txt"
    table.write_text("76978 2.61\n76979 2.60\n76980 nan\n76981 nan\n", encoding="utf-8")
    assert not paste_numbered(table)
    assert not any(paste_numbered(c) for c in (WILD / "num-loss-nan-step-column-yanmtt-1" / "log.txt",
                                                 WILD / "comm-init-reset-by-peer-1" / "log.txt"))


def test_open_mpis_tag_output_column_names_the_rank(tmp_path: Path) -> None:
    # 'mpirun --tag-output' puts '[1,3]<stderr>:' before every line (Horovod, DeepSpeed's MPI runner): before,
    # 42 of the 358 tuned logs changed category so pasted, 2 after (logs whose lines already carry another
    # column first)
    for case in ("comm-init-reset-by-peer-1", "proc-exit1-torchrun-summary-minigpt4-1"):
        want = [_said(i) for i in items(case)]
        got = _as_pasted(tmp_path, case, lambda line: "[1,3]<stderr>:" + line)
        assert [_said(i) for i in got] == want, case
        assert {i.rank for i in got} == {3}, case
    # a [rankN]: prefix after the tag is torch's own global rank: it wins
    (item,) = _as_pasted(tmp_path, "py-keyerror-1", lambda line: "[1,3]<stdout>:[rank5]: " + line)[-1:]
    assert item.rank == 5


def test_a_relays_logger_prefix_before_every_line_is_dropped(tmp_path: Path) -> None:
    # a wrapper logging each line of the job's output ('2024-05-01 10:00:07,123 - root - ERROR - <line>'):
    # before, 42 of the 358 tuned logs changed category so relayed; after, 4 (logs of one or two lines)
    for case in ("comm-init-reset-by-peer-1", "proc-exit1-torchrun-summary-minigpt4-1"):
        want = [_said(i) for i in items(case)]
        lines = (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()
        path = tmp_path / "log.txt"
        path.write_text("\n".join(f"2024-05-01 10:00:{n % 60:02d},123 - root - ERROR - {line}"
                                  for n, line in enumerate(lines, 1)) + "\n", encoding="utf-8")
        assert paste_relay_prefix(path) == len("2024-05-01 10:00:07,123 - root - ERROR - "), case
        got = list(LogReader(path, 0, min_level=""))
        assert [_said(i) for i in got] == want, case
        assert got[0].time_ns is not None  # the relay's stamp is the line's time
    # a log's own records: loguru's (num-loss-nan-loguru-1, tuned) end at the ' - ' after module:function:line,
    # so its '[R0]' rank tag stays; a log with a line its logger did not prefix (a traceback) keeps them all
    loguru = WILD / "num-loss-nan-loguru-1" / "log.txt"
    first = loguru.read_text(encoding="utf-8").splitlines()[0]
    assert first[paste_relay_prefix(loguru):].startswith("[R0] | E5 iter")
    assert paste_relay_prefix(WILD / "comm-init-reset-by-peer-1" / "log.txt") == 0


def test_sruns_task_label_column_names_the_rank(tmp_path: Path) -> None:
    # 'srun --label' puts the task number before every line ('2: Traceback ...'; blank lines '2:'): before, 41
    # of the 358 tuned logs changed category so labelled (ranks 0 and 1 in turns of 7 lines), 7 after
    for case in ("comm-init-reset-by-peer-1", "proc-exit1-torchrun-summary-minigpt4-1"):
        want = [_said(i) for i in items(case)]
        got = _as_pasted(tmp_path, case, lambda line: "2: " + line)
        assert paste_task_labels(tmp_path / "log.txt"), case
        assert [_said(i) for i in got] == want, case
        assert {i.rank for i in got} == {2}, case
    # numbers counting up by one are a gutter, not task labels
    numbered = tmp_path / "numbered.txt"
    numbered.write_text("1: a\n2: b\n3: c\n", encoding="utf-8")
    assert not paste_task_labels(numbered) and paste_numbered(numbered)


def test_a_traceback_that_lost_all_its_indentation_keeps_its_frames() -> None:
    # pytorch/gloo#148: frames AND their code lines flush left ('File ".../distributed_c10d.py", line 283, in
    # init_process_group' then '_default_pg = ProcessGroupGloo(store, rank, world_size)'); before, the first code
    # line was read as the exception line, the block did not parse and 'RuntimeError: Wait timeout' stood alone
    (item,) = items("comm-init-gloo-wait-timeout-file-store-gloo-148-1")
    assert item.kind == "exception" and item.payload["type"] == "RuntimeError"
    assert item.payload["message"] == "Wait timeout"
    assert [f["function"] for f in item.payload["frames"]] == ["init_process_group"]
    found = classify_chain("RuntimeError", "Wait timeout", (), item.payload["frames"])
    assert (found.kind, found.facts["raised_in"]) == ("comm/init-failure", "init_process_group")


def test_yearless_glog_stamps_take_the_year_of_the_paste_s_dated_lines() -> None:
    # DeepAuto-AI/hip-attention#59: two yearless glog lines ('[rank4]:[E421 02:05:38...] Gloo connectFullMesh
    # failed ...'), then SGLang's '[2025-04-21 02:05:39 TP4]' line. Read in the file's year (the checkout's),
    # the glog lines landed a year or more away from the dated one: the import's span covered years and, before
    # the span took (earliest, latest), the pipeline dropped them. They are one job's output: the glog lines
    # take the dated line's year, and the paste spans about a second.
    from bench.wild import corpus, judge
    from trainguard_server.replay.logs import line_stamp, paste_year, scan_log

    case_id = "comm-init-gloo-fullmesh-no-error-sglang-hipattention-59-1"
    path = WILD / case_id / "log.txt"
    assert paste_year(path) == 2025
    scan = scan_log(path)
    stamps = [s[0] for s in (line_stamp(ln, 2025) for ln in path.read_text().splitlines()) if s is not None]
    assert len(stamps) == 3 and (scan.first_ns, scan.last_ns) == (min(stamps), max(stamps))
    assert scan.first_ns is not None and scan.last_ns is not None
    assert 0 < scan.last_ns - scan.first_ns < 2 * 10**9
    case = next(c for c in corpus.load() if c.case_id == case_id)
    assert judge.replay_local(case).kind == "comm/init-failure"


def test_a_glog_line_takes_the_year_of_the_last_dated_line_before_it(tmp_path: Path) -> None:
    # the same c10 record before and after a dated Python logging line of another year: the line before reads
    # the first dated line's year, the line after the latest dated line's -- never the file's modification time
    from trainguard_server.replay.logs import scan_log

    glog = "[rank1]:[E1231 23:59:58.000000000 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective"
    path = tmp_path / "log.txt"
    path.write_text("\n".join([glog, "2023-12-31 23:59:59,000 - INFO - step 10",
                               "2024-01-01 00:00:01,000 - INFO - step 11", glog.replace("E1231", "E0101")]) + "\n")
    os.utime(path, (0, 2 * 10**9))  # saved in 2033: not the paste's year
    got = [i.time_ns for i in LogReader(path, 0, min_level="")]
    dated = [datetime(2023, 12, 31, 23, 59, 58), datetime(2023, 12, 31, 23, 59, 59),
             datetime(2024, 1, 1, 0, 0, 1), datetime(2024, 1, 1, 23, 59, 58)]
    assert got == [int(d.timestamp()) * 10**9 for d in dated]
    scan = scan_log(path)
    assert (scan.first_ns, scan.last_ns) == (got[0], got[-1])


def test_an_exception_line_logged_by_a_logging_library_opens_an_exception(tmp_path: Path) -> None:
    # a record whose message is the exception line (logger.error(f"{type(e).__name__}: {e}"), loguru, basicConfig)
    # with no traceback around it is the bare exception line it carries; a record that only names an exception
    # class in prose stays a log line
    from trainguard_server.replay.logs import logged_exception

    lines = ["2024-05-01 12:00:00,123 - INFO - RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x4 and 8x8)",
             "2024-05-01 12:00:01.123 | ERROR    | train:main:42 - torch.OutOfMemoryError: CUDA out of memory.",
             "ERROR:root:KeyError: 'labels'",
             "2024-05-01 12:00:02,000 - INFO - step 10 loss 1.0 (RuntimeError handled)"]
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines) + "\n")
    got = list(LogReader(path, 0, min_level=""))
    assert [(i.kind, i.payload.get("type")) for i in got] == [
        ("exception", "RuntimeError"), ("exception", "torch.OutOfMemoryError"), ("exception", "KeyError"),
        ("log", None)]
    assert got[0].payload["message"].startswith("mat1 and mat2 shapes")
    assert logged_exception("RuntimeError: plain") is None and logged_exception("INFO: RuntimeError is") is None


def test_ray_s_worker_prefix_without_an_actor_name_is_dropped() -> None:
    # Ray prefixes a task's output with '(pid=4321) ' or '(pid=4321, ip=10.0.0.2) ' when the worker has no actor
    # name (an actor's is '(RayTrainWorker pid=4321) '): the line after it is the job's own
    from trainguard_server.replay.logs import split_prefix

    for prefix in ("(pid=4321) ", "(pid=4321, ip=10.0.0.2) ", "(RayTrainWorker pid=4321, ip=10.0.0.2) "):
        assert split_prefix(prefix + "[rank3]: RuntimeError: CUDA error: an illegal memory access") == (
            3, "RuntimeError: CUDA error: an illegal memory access")
    assert split_prefix("(pid = 4321) x") == (None, "(pid = 4321) x")
