"""The culprit a launcher's line or a mismatch report names (issue 17), and the kind of a plain non-zero
exit a launcher reports. Text read from tests/fixtures/wild (each case's source.txt names its thread)."""

from __future__ import annotations

from pathlib import Path

from trainguard_engine.classify import classify_exception, classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _line(case: str, needle: str) -> str:
    """The first line of a wild log that contains ``needle`` (launcher prefix kept)."""
    text = (WILD / case / "log.txt").read_text(encoding="utf-8")
    return next(line for line in text.splitlines() if needle in line)


def test_torchrun_worker_line_names_its_local_rank_and_a_plain_exit() -> None:
    found = classify_text(_line("proc-exit1-launch-repvit-1", "failed (exitcode:"))
    assert found is not None and found.rule == "torchrun.worker-failed"
    assert found.kind == "process/exit" and found.facts["rank"] == 2
    killed = classify_text(_line("proc-killed-elastic-exitcode-9-1", "failed (exitcode:"))
    assert killed is not None and killed.kind == "process/killed"  # a signal keeps the exit decision path


def test_deepspeed_launcher_exit_code_1_names_the_local_rank() -> None:
    found = classify_text(_line("comm-root-exit1-rank4-1", "exits with return code"))
    assert found is not None and found.kind == "process/exit" and found.facts["rank"] == 4
    signal = classify_text(_line("proc-sigkill-deepspeed-launcher-1", "exits with return code"))
    assert signal is not None and signal.kind == "process/killed"


def test_torchrun_summary_without_a_traceback_is_an_exit_of_its_root_cause_rank() -> None:
    text = (WILD / "proc-exit1-torchrun-summary-minigpt4-1" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and found.rule == "torchrun.child-failed"
    assert found.kind == "process/exit" and found.facts["root_cause_rank"] == 0


def test_a_fingerprint_mismatch_names_the_rank_that_is_behind() -> None:
    for case, reporter, behind in (("comm-mismatch-fingerprint-3", 2, 3), ("comm-mismatch-fingerprint-1", 1, 7)):
        found = classify_text(_line(case, "Detected mismatch between collectives"))
        assert found is not None and found.kind == "comm/mismatch", case
        assert found.facts["rank"] == behind and found.facts["reporting_rank"] == reporter, case


def test_a_shell_kill_in_markdown_bold_and_ncclls_unclosed_ring() -> None:
    killed = classify_text(_line("proc-killed-host-oom-maskrcnn-1", "Killed"))
    assert killed is not None and killed.kind == "process/killed"  # '**Killed**' as pasted
    ring = classify_text(_line("comm-init-ring-loop-hostid-1", "does not loop back"))
    assert ring is not None and ring.kind == "comm/init-failure"


def test_a_proxy_that_cannot_run_a_peers_init_is_a_communicator_that_never_came_up() -> None:
    text = (WILD / "comm-init-nccl-connect-closed-1" / "log.txt").read_text(encoding="utf-8")
    init = classify_text(_line("comm-init-nccl-connect-closed-1", "Failed to execute operation Init"))
    assert init is not None and init.kind == "comm/init-failure"
    assert classify_text(text).kind == "comm/init-failure"  # over the peer's 'Connection closed' that follows
    closed = classify_text(_line("comm-init-nccl-connect-closed-1", "Connection closed by remote peer"))
    assert closed is not None and closed.kind == "comm/rank-lost"  # alone, still a peer that went away


def test_nccls_bootstrap_bind_failure_and_buffer_oom_are_what_failed() -> None:
    # nccl#293: a communicator rebuilt mid-training cannot bind its bootstrap socket (nothing before)
    bind = classify_text(_line("comm-init-nccl-bind-in-use-mid-training-1", "Call to bind failed"))
    assert bind is not None and bind.kind == "comm/init-failure" and bind.rule == "nccl.debug"
    # NCCL allocating its p2p buffers on a full GPU (the peers' 'Connection closed' lines are its echo)
    oom = classify_text(_line("comm-nccl-oom-alloc-1", "Cuda failure 'out of memory'"))
    assert oom is not None and oom.kind == "memory/oom"


def test_a_duplicate_gpu_line_of_its_own_is_an_init_failure() -> None:
    # verl paste in reverse order: NCCL's last error 'Duplicate GPU detected : ...' before its
    # 'Last error:' / ncclInvalidUsage lines (read as comm/mismatch before)
    found = classify_text(_line("comm-init-duplicate-gpu-2", "Duplicate GPU detected"))
    assert found is not None and found.kind == "comm/init-failure"
    assert found.facts["ranks"] == [9, 1] and found.facts["duplicate_gpu"] is True


def test_a_failed_ib_work_completion_is_a_peer_or_link_that_went_away() -> None:
    # nccl-tests across two hosts: 'NET/IB : Got completion from peer ... with error 4' (NCCL returns it as
    # ncclRemoteError, read as comm/rank-lost by nccl.error; the IB line alone said comm/failure before)
    found = classify_text(_line("comm-rank-lost-ib-completion-1", "Got completion from peer"))
    assert found is not None and found.kind == "comm/rank-lost" and found.facts["ib_status"] == 4


def test_an_mp_spawn_exit_code_is_that_process_exit() -> None:
    # VITS fine-tuning (Plachtaa/VITS-fast-fine-tuning#284): after the last epoch mp.spawn's join raises
    # 'ProcessExitedException: process 0 terminated with exit code 1' (the script calls exit() without a code)
    # -- the process ended itself, rank 0; before, a plain process/exception
    found = classify_exception("torch.multiprocessing.spawn.ProcessExitedException",
                               _line("proc-spawn-exit1-after-training-vits-284-1", "terminated with exit code")
                               .split(": ", 1)[1])
    assert (found.kind, found.rule) == ("process/exit", "launcher.signal")
    # the process index is the worker's on its node: a local rank (correlate._local_only)
    assert found.facts == {"exitcode": 1, "rank": 0, "local_rank": 0}
    # the signal wording keeps its exit decision path
    killed = classify_exception("torch.multiprocessing.spawn.ProcessExitedException",
                                "process 1 terminated with signal SIGKILL")
    assert killed.kind == "process/killed" and killed.facts["rank"] == killed.facts["local_rank"] == 1


def test_the_oom_killers_own_report_is_a_sigkill_for_host_memory() -> None:
    # dmesg's cgroup line under a killed DataLoader worker (ymoslem/OpenNMT-Tutorial#6) and Slurm's report of
    # the same (chenxie95/deeplearning_course_sjtu#20): before, neither line was recognised
    found = classify_text(_line("proc-dl-worker-killed-cgroup-dmesg-opennmt-1", "Killed process"))
    assert found is not None and (found.kind, found.rule) == ("process/killed", "launcher.signal")
    assert found.facts == {"signal": 9, "signal_name": "SIGKILL", "killer": "oom-killer", "pid": 629,
                           "process": "onmt_train"}
    slurm = classify_text(_line("proc-dl-worker-exited-slurm-oom-kill-sjtu-1", "oom-kill event"))
    assert slurm is not None and slurm.kind == "process/killed" and slurm.facts["killer"] == "oom-killer"
    assert classify_text("the job was killed by the scheduler for running too long") is None


def test_the_old_launchers_exit_status_names_the_worker_by_its_local_rank() -> None:
    # torch.distributed.launch's CalledProcessError for the command with '--local_rank=4' (no final period)
    found = classify_text(_line("proc-launch-exit1-dino-113-1", "CalledProcessError"))
    assert found is not None and found.rule == "launcher.signal"
    assert found.kind == "process/exit" and found.facts["rank"] == 4 and found.facts["exitcode"] == 1
    prose = (WILD / "proc-launch-exit1-prose-distdemo-5-1" / "log.txt").read_text(encoding="utf-8")
    said = classify_text(prose)
    assert said is not None and said.kind == "process/exit" and said.facts["rank"] == 1
    # any other subprocess's exit status is no launcher's worker: a plain Python exception
    build = classify_exception("subprocess.CalledProcessError",
                               "Command '['ninja', '-v']' returned non-zero exit status 1.")
    assert build.kind == "process/exception" and "rank" not in build.facts


def test_the_launchers_global_rank_prefix_beats_a_sub_groups_rank_tag() -> None:
    # global rank 9 is rank 1 of the sub-group 'mesh_replicate': the [rank9]: prefix names the process
    line = _line("mem-watchdog-unspecified-launch-fastvideo-1008-1", "watchdog thread terminated")
    found = classify_text(line)
    assert found is not None and found.kind == "memory/cuda-error" and found.facts["rank"] == 9
    # the reader strips the prefix: the sub-group's tag alone is not a global rank (the stream names it)
    bare = classify_text(line.split("]:", 1)[1])
    assert bare is not None and "rank" not in bare.facts and bare.facts["pg_rank"] == 1
    # the default group's tag is the global rank
    default = classify_text(line.split("]:", 1)[1].replace("PG ID 5 PG GUID 55(mesh_replicate)",
                                                           "PG ID 0 PG GUID 0(default_pg)"))
    assert default is not None and default.facts["rank"] == 1


def test_a_shells_floating_point_exception_in_bash_and_zsh_wordings() -> None:
    # bash: '... line 3:  1098 Floating point exception(core dumped) python train.py ...' (no space before '(')
    bash = classify_text(_line("proc-sigfpe-bash-line-mvsnet-53-1", "Floating point"))
    assert bash is not None and bash.kind == "process/exit" and bash.facts["signal_name"] == "SIGFPE"
    # zsh: lower case, the child's pid first ('    20121 floating point exception (core dumped)')
    zsh = classify_text(_line("proc-sigfpe-zsh-lower-pytorch-44547-1", "20121"))
    assert zsh is not None and zsh.kind == "process/exit" and zsh.facts["signal"] == 8
    killed = classify_text("zsh: killed     python train.py --epochs 100")
    assert killed is not None and killed.kind == "process/killed"
    assert classify_text("the job was killed by the scheduler") is None  # prose is no shell report


def test_a_shells_core_dumped_report_mid_line_is_that_death() -> None:
    # meshgraphnets: '... there was an error Illegal instruction (core dumped) when I ran create_infer_data.py ...'
    said = (WILD / "proc-sigill-prose-meshgraphnets-3-1" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(said)
    assert found is not None and found.kind == "process/exit" and found.facts["signal_name"] == "SIGILL"
    glued = classify_text("11/56 [00:02<00:08,  5.02it/s]Segmentation fault (core dumped)")
    assert glued is not None and glued.facts["signal"] == 11
    assert classify_text("a segmentation fault in the loader, I think") is None  # no report: no '(core dumped)'
