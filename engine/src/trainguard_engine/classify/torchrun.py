"""Classifier rules for torchrun (torch.distributed.elastic): the ``ChildFailedError`` summary naming
the root-cause rank, and per-worker failure lines."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from trainguard.core.tracebacks import parse_traceback_text

from ..catalogue import SIGNAL_NAMES
from .text import (
    Classification,
    Facts,
    _exit_kind,
    _first_line,
    _Hit,
    _search,
    _shorten,
    _Text,
)
from .vocab import UNMARKED_CONFIDENCE

_WORKER_FAILED_RE = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\)(?: local_rank: (?P<lr>\d+) \(pid: (?P<pid>\d+)\))?")
"""torchrun's ``failed (exitcode: -9) local_rank: 0 (pid: 5343) of binary: ...``; the worker's fields may be
missing when the line was cut or a terminal wrapped it after its exit code (``... local_`` / ``rank: 0 ...``):
the exit code alone still says how the worker ended, of an unnamed rank."""


_ENTRY_NEEDLE = "exitcode  :"
_ENTRY_EXIT_RE = re.compile(r"^[ \t]{1,8}exitcode  : ?(?P<code>\d+) \(pid: (?P<pid>\d+)\)[ \t]*$",
                            re.MULTILINE)
_ENTRY_RANK_RE = re.compile(r"^[ \t]{1,8}rank {6}: ?(?P<rank>\d+)(?: \(local_rank: (?P<lr>\d+)\))?[ \t]*$",
                            re.MULTILINE)
"""One entry of torchrun's failure summary read without the summary's ``Root Cause`` header (a tail cut at
the top, or its lines passed on one by one): ``exitcode  : 1 (pid: 8181)`` -- the padded key and the pid are
torchrun's own -- is that worker's exit code; the entry's ``rank      : R (local_rank: L)`` field before it,
when in the text, names the rank (a reader passing lines one by one gives the line that rank's stream)."""


def _rule_worker_failed(t: _Text) -> Optional[_Hit]:
    pos = t.first("failed (exitcode:")
    if pos < 0 or (found := _search(_WORKER_FAILED_RE, t, pos, before=0, after=200)) is None:
        return _failure_entry(t)
    m = found[1]
    code = int(m.group("code"))
    category, subtype, said = _launcher_exit_kind(code)
    facts: Facts = {"exitcode": code}
    who = "a worker"  # the line cut or wrapped after its exit code: no rank named
    if m.group("lr") is not None:
        local = int(m.group("lr"))
        facts.update(local_rank=local, rank=local, pid=int(m.group("pid")))
        who = f"local rank {local}"
    return _Hit(category, subtype, 0.6, pos, facts, f"torchrun: {who} failed ({said})",
                _EXIT_NOTE if code > 0 else "")


def _failure_entry(t: _Text) -> Optional[_Hit]:
    """A torchrun failure entry's exit code without its summary's header (see :data:`_ENTRY_EXIT_RE`); a
    non-zero code only (a signal's entry says ``Signal N (SIG..) received by PID``, which
    ``launcher.signal`` reads)."""
    pos = t.first(_ENTRY_NEEDLE)
    if pos < 0:
        return None
    line_start = t.text.rfind("\n", 0, pos) + 1  # '^' then matches only at a real line start
    m = _ENTRY_EXIT_RE.search(t.text, line_start, min(len(t.text), pos + 60))
    if m is None:
        return None
    code = int(m.group("code"))
    if code <= 0:
        return None
    category, subtype, said = _launcher_exit_kind(code)
    facts: Facts = {"exitcode": code, "pid": int(m.group("pid"))}
    start = m.start()
    named = list(_ENTRY_RANK_RE.finditer(t.text, t.text.rfind("\n", 0, max(0, start - 300)) + 1, start))
    if named:  # the last rank field before the exit code: this entry's
        facts["rank"] = int(named[-1].group("rank"))
        if named[-1].group("lr") is not None:
            facts["local_rank"] = int(named[-1].group("lr"))
    on = f"rank {facts['rank']}" if "rank" in facts else "a worker"
    return _Hit(category, subtype, 0.6, start, facts,
                f"torchrun: {on} failed ({said}; its failure entry without the summary's header)", _EXIT_NOTE)


_EXIT_NOTE = ("the launcher only saw the exit code; the worker's own error (for exit code 1 usually a Python "
              "exception) is in that worker's output, before this line")


def _launcher_exit_kind(code: int) -> Tuple[str, str, str]:
    """The kind of a worker exit a launcher reports: a signal's (negative code, or 128 + n) by the exit
    decision path; a plain non-zero code is ``process/exit`` -- the launcher's line shows no exception
    (the worker's traceback, when printed, is an exception of its own)."""
    category, subtype, said = _exit_kind(code)
    if 0 < code < 128 and (category, subtype) == ("process", "exception"):
        return "process", "exit", f"exit code {code}"
    return category, subtype, said


_SIGNALS_RE = re.compile(r"died with <Signals\.(?P<name>SIG\w+): (?P<sig>\d+)>")
_LOCAL_RANK_RE = re.compile(r"--local[_-]rank=(?P<rank>\d+)")
_CALLED_EXIT_RE = re.compile(r"\]' returned non-zero exit status (?P<code>\d{1,3})\b")
"""The old ``torch.distributed.launch``'s ``subprocess.CalledProcessError: Command '['python', '-u',
'train.py', '--local_rank=3', ...]' returned non-zero exit status 1.``: the worker launched with that
``--local_rank`` exited with that code (its own error, if any, was printed before). Only a command that
carries ``--local_rank`` is a launcher's worker; any other subprocess's exit (a build's ``ninja``) is not."""
_COMPOSER_NEEDLES = ("crashed with exit code ", ") exited with code ")
_COMPOSER_EXIT_RE = re.compile(r"\b(?:Global rank|Rank) (?P<rank>\d{1,5}) "
                               r"(?:\(PID (?P<pid>\d+)\) exited with code|crashed with exit code) "
                               r"(?P<code>-?\d{1,3})\b")
"""MosaicML Composer's launcher (``composer train.py ...``) reporting a rank's end:
``ERROR:composer.cli.launcher:Rank 1 crashed with exit code 1.`` (older) or ``Global rank 0 (PID 208865)
exited with code -11`` (newer) -- the code as ``subprocess`` gives it, a signal negative (``-7`` SIGBUS,
``-9``, ``-11``)."""
_COMPOSER_KILL_CODES = (-9, -15)
"""The codes of the signals Composer's launcher sends itself: SIGTERM to every rank still running once one
ended non-zero (or on Ctrl-C), SIGKILL to those alive 30 s later. Its last line, ``Global rank N (PID P)
exited with code C``, names the FIRST rank in rank order whose code is non-zero -- most often such a
survivor (rank 0, -15), not the rank that failed: that one the launcher reported first, ``Rank M crashed
with exit code C.`` (Composer itself skips -9/-15 in its crash report: "the launcher script killed the
training process")."""
_COMPOSER_KILL_NEEDLES = ("killing global rank ", "failed to kill global rank ")
_COMPOSER_KILL_RE = re.compile(r"(?:Killing|Failed to kill) global rank (?P<rank>\d{1,5}) \(PID \d{1,20}\) "
                               r"with SIGTERM")
COMPOSER_BARE_KILL_CONFIDENCE = UNMARKED_CONFIDENCE
"""The confidence of a ``Global rank N (PID P) exited with code -9/-15`` line read without the launcher's
kill lines or a ``Rank M crashed`` line beside it: the rank's own death as the text shows it, but more
often the launcher's own kill whose context is elsewhere -- below ``log_min_confidence``'s default, so a
log record of that line alone (live capture, ``trainguard replay``: one record per line) opens no incident;
the rank's own signal death is the monitor's ``Rank N crashed with exit code -9.``, printed before it."""
_COMPOSER_KILL_NOTE = ("Composer's launcher sends SIGTERM, then SIGKILL after 30 s, to the ranks still "
                       "running once one rank ended, and this line names the first rank in rank order that "
                       "ended non-zero: a 'Rank M crashed' line before it names the rank that failed; "
                       "without one, the signal came from outside (the OOM killer, the scheduler, an "
                       "operator)")
_RUNNER_NEEDLE = "error: failed to run "
_RUNNER_FAILED_RE = re.compile(r"Error: failed to run (?P<launcher>torchrun|python3?|deepspeed)\b"
                               r"[^\n]{0,3000}? on (?P<host>[\w.:-]{1,100})(?=,| *$|\n)", re.MULTILINE)
"""``colossalai run``'s report of a node's failed command (its last line, often all a user pastes): ``Error:
failed to run torchrun --nproc_per_node=4 ... train.py on 127.0.0.1, is localhost: True, exception:
Encountered a bad command exit code!`` (older: the line ends after the host). A process exit, no rank."""
_DEATH_SIGNAL_RE = re.compile(r"Received (?:(?P<sig>\d+)|Signals\.(?P<name>SIG[A-Z]{2,8})) death signal|"
                              r"got signal: (?P<sig2>\d+)")
"""The elastic agent's ``Received 15 death signal, shutting down workers``; torch >= 2.2 names the signal
(``Received Signals.SIGINT death signal, shutting down workers``: a Ctrl-C, the agent forwarding it);
``SignalException: Process N got signal: 15``."""
_STOP_SIGNALS = frozenset({1, 2, 3, 15})
"""The signals the elastic agent catches to shut its workers down (SIGHUP, SIGINT, SIGQUIT, SIGTERM): a
death signal the agent *received* is a request from outside to stop -- the job was terminated, whatever the
signal's number (``Received 1 death signal`` after the terminal that ran it closed, OpenMOSS/MOSS#237)."""
_GLUED_KILLED_RE = re.compile(r"(?<=[\d\]%|)])(?P<what>Killed)[ \t]*$", re.MULTILINE)
"""A shell's ``Killed`` glued to the progress line it interrupted: the bar's last redraw left the cursor
mid-line (``165376/296960 [=====>....] - ETA: 365s - loss: 2.1371Killed``, keras-team/keras#3476;
``...| 20/1094 [00:41<11:04,  1.62it/s]Killed``): the word at the very end of the line, right after a digit or
a bar's bracket."""
_BASH_JOB_RE = re.compile(r": line \d{1,6}: +\d{1,10} (?P<what>Segmentation fault|Killed|Illegal instruction"
                          r"|Floating point exception|Bus error)\b")
"""bash's job report (``<script>: line 6:  3305 Killed  $JACROOT/bin/jac-run "$@"``) anywhere in a line:
glued after a progress bar (vacancy/NSCL-PyTorch-Release#23), where the whole-line form cannot start at the
script's name."""
_SUBMITIT_RE = re.compile(r"Caught signal (?P<name>SIG[A-Z0-9]{2,8}) on \S{1,200}: this job is "
                          r"(?P<why>preempted|timed-out)")
"""submitit's handler for the signal Slurm sends before it ends a job (``submitit WARNING (...) - Caught
signal SIGHUP on learnfair0293: this job is preempted.``, then ``Requeued job ...`` / ``Exiting
gracefully after preemption/timeout.``; facebookincubator/submitit#1701): the scheduler took the job back
(preemption) or its time ran out."""
_SHELL_DEATH_RE = re.compile(r"^(?:[^\n]{0,200}: )?(?:line \d+: +\d+ )?(?:\*\*|__)?"
                             r"(?P<what>Segmentation fault|Killed|Illegal instruction"
                             r"|Floating point exception|Bus error)"
                             r"(?: *\(core dumped\))?(?:\*\*|__)?"
                             r"(?:(?<=\)) *[^\n]{0,300}| {2,}[^\n]{0,300}| \(\d{1,3}\)[^\n]{0,300}"
                             r"| process \d[^\n]{0,300})?[ \t]*$", re.MULTILINE)
"""A shell's report of its child's death: ``Segmentation fault (core dumped)``, ``Killed``,
``Illegal instruction (core dumped)``, ``Floating point exception``,
``run.sh: line 12: 4242 Killed  python train.py``, ``Bus error (core dumped)``, also wrapped in a paste's
markdown bold (``**Killed**``); an abort is left to the exit path (after a watchdog timeout it is the
teardown). Text after the word only as the shell prints it -- after ``(core dumped)``, after two or more
spaces (bash pads the word to a column before the command), Open MPI's ``Signal: Segmentation fault (11)``,
or dmesg's ``Killed process N`` --: ``INFO: Killed 2 stale dataloader workers``, ``Killed 3 enemies, reward
35.0`` are sentences (hR3's stop-48 probes)."""
_ZSH_DEATH_RE = re.compile(r"^(?:zsh: |[ \t]{0,12}(?:\[\d{1,4}\][ \t]+)?\d{1,10} )"
                           r"(?P<what>segmentation fault|killed|illegal instruction|floating point exception"
                           r"|bus error)(?: *\(core dumped\))?(?:[ \t]+[^\n]{0,300})?$", re.MULTILINE)
"""zsh's report of its child's death, in lower case: ``zsh: segmentation fault (core dumped)  python
train.py``, or with the job's pid first (``[1]    20121 floating point exception (core dumped)  python
...``, also without the job number)."""
_CORE_DUMPED_RE = re.compile(r"(?P<what>Segmentation fault|Illegal instruction|Floating point exception"
                             r"|Bus error)[ \t]{0,24}\(core dumped\)", re.IGNORECASE)
"""A shell's death report anywhere in a line: glued to a progress bar (``5.02it/s]Segmentation fault (core
dumped)``) or quoted mid-sentence (``there was an error Illegal instruction (core dumped) when I ran ...``);
``(core dumped)`` marks it as the report itself, not a word in prose. bash's job report pads the signal's name
to a column (``train.sh: line 21: 1749424 Segmentation fault      (core dumped) python main_train.py ...``,
its command line often longer than the whole-line forms take). (An abort is left to the exit path.)"""
_SHELL_L10N = {
    "已杀死": "killed", "段错误": "segmentation fault", "总线错误": "bus error",
    "非法指令": "illegal instruction", "浮点数例外": "floating point exception",
}
"""The same report in the shell's locale: bash prints the C library's ``strsignal`` text, which glibc
translates -- its zh_CN catalog's (libc.mo) words for SIGKILL, SIGSEGV, SIGBUS, SIGILL and SIGFPE (``已杀死``
after a DreamerV3 run's metrics, danijar/dreamerv3#203; ``段错误`` with its core-dumped note). Only the locale
a real paste showed: the other locales' words (stop 48's first form had nine more) read ordinary sentences
as deaths once a word starts a line ('Morto após 340 passos', 'Processus arrêté proprement', hR3 HIGH-1) and
cost the shared pre-scan on every long log (hR3 MEDIUM-2)."""
_CORE_DUMPED_L10N = ("核心已转储", "core dumped")
"""bash's ``(core dumped)`` note in the same locale (bash.mo's zh_CN text), or untranslated."""
_L10N_DEATH_RE = re.compile(r"^(?:[^\n]{0,200}[:\uff1a][ \t]*\d{1,10}[ \t]+)?(?:\*\*|__)?(?P<what>"
                            + "|".join(re.escape(w) for w in sorted(_SHELL_L10N, key=len, reverse=True))
                            + r")(?P<core>[ \t]*[(\uff08](?:" + "|".join(map(re.escape, _CORE_DUMPED_L10N))
                            + r")[)\uff09])?(?:\*\*|__)?"
                            r"(?:[ \t]{2,}[^\n]{0,300}|(?(core)[ \t]+[^\n]{0,300}))?[ \t]*$",
                            re.MULTILINE)
"""A localized shell death report (:data:`_SHELL_L10N`) as bash prints it: the word alone on its line, or
after bash's job-report prefix ending in the job's pid (``run.sh: 第 6 行\uff1a  3305 已杀死   python
train.py``), its ``(core dumped)`` note in the locale's words in ASCII or full-width brackets, the command
line after it or after two or more spaces (bash pads the word to a column) -- not a word that starts a
sentence."""
_SHELL_SIGNALS = {"segmentation fault": (11, "SIGSEGV"), "killed": (9, "SIGKILL"),
                  "illegal instruction": (4, "SIGILL"), "floating point exception": (8, "SIGFPE"),
                  "bus error": (7, "SIGBUS")}
_L10N_NEEDLES = tuple(word.lower() for word in _SHELL_L10N)
_RETURN_CODE_RE = re.compile(r"exits with return code = (?P<code>-?\d+)")
"""DeepSpeed's launcher: ``[launch.py:N:sigkill_handler] ['python', '-u', 'train.py', '--local_rank=1', ...]
exits with return code = -11`` (a signal), or ``= 1`` (a plain exit: the worker's own error is in its
output)."""
_RECEIVED_RE = re.compile(r"(?:Signal (?P<sig>\d+) \((?P<name>SIG\w+)\)|\*\*\* (?P<name2>SIG[A-Z]{2,8})"
                          r"(?: \(@(?:0x[0-9a-f]+|\(nil\))\)(?:, see \S{1,60})?)?) received by PID \d")
"""torchrun's failure table ``traceback : Signal 11 (SIGSEGV) received by PID 6421`` (when its header was
cut), and the failure-signal handler of Google's runtimes (glog / absl, as TPU, JAX and TensorFlow print it)
in its three forms: ``*** SIGTERM (@0x297b) received by PID 18396 ... from PID 10619``, with a null fault
address and its ``see`` link (redacted in open builds: ``*** SIGSEGV (@(nil)), see gl__________41#s15
received by PID 11743 (TID 12350) on cpu 17; stack trace: ***``, jax#12456), and without the address
(``*** SIGABRT received by PID 9361 (TID 9361) on cpu 40 from PID 9361; stack trace: ***``)."""
_SIGNAL_NUMBERS = {name: number for number, name in SIGNAL_NAMES.items()}
_INTERRUPTED_RE = re.compile(
    r"(?:exit code )?\d{1,3} ?[(\uff08]interrupted by signal (?P<sig>\d{1,2}) ?[:\uff1a] ?"
    r"(?P<name>SIG[A-Z]{2,8}) ?[)\uff09]")
"""An IDE's run console (PyCharm: ``Process finished with exit code 139 (interrupted by signal 11:
SIGSEGV)``): the process it ran was ended by that signal. Also pasted without its ``Process finished with
exit code`` and with no space after the colon (``139 (interrupted by signal 11:SIGSEGV)``, sangrockEG/S2C#8),
and with the full-width parentheses and colon a CJK input method or console gives it (``exit code 137
\uff08interrupted by signal 9\uff1a SIGKILL\uff09``, yolo family#15): the status (128 + the signal) before the
parenthesis is what makes it this report."""
_GDB_SIGNAL_RE = re.compile(r"Program (?:received|terminated with) signal (?P<name>SIG[A-Z]{2,8})")
"""gdb's report of the debugged process's fatal signal (``Program received signal SIGSEGV, Segmentation
fault.``)."""
_SPAWN_SIGNAL_RE = re.compile(r"process (?P<rank>\d+) terminated with signal (?P<name>SIG[A-Z]{2,8})")
"""``torch.multiprocessing.spawn``'s ``ProcessExitedException: process 1 terminated with signal SIGKILL``
(older torch: ``Exception: process 3 terminated with signal SIGKILL``). The process index is the worker's
index on its node, taken for the rank as torchrun's ``local_rank`` is (one node): the facts say it is a
local rank (``local_rank``), so correlation folds the report into whichever rank's own error text the paste
shows (``correlate._local_only``)."""
_SPAWN_EXIT_RE = re.compile(r"process (?P<rank>\d+) terminated with exit code (?P<code>\d{1,10})\b")
"""mp.spawn's ``ProcessExitedException: process 0 terminated with exit code 1``: the process ended itself
with that code (``sys.exit``, ``os._exit``, a native crash's status on Windows) -- an exception in the
function it ran is reported as ``-- Process N terminated with the following error:`` instead."""


_RAY_OOM_NEEDLES = ("killed due to memory pressure (oom)", "killed due to the node running low on memory")
_RAY_OOM_RE = re.compile(r"(?:(?P<workers>\d{1,6}) Workers \(tasks / actors\) killed due to memory pressure "
                         r"\(OOM\)|Task was killed due to the node running low on memory)")
"""Ray's memory monitor killing workers for host memory: the raylet's ``(raylet) ... node_manager.cc:3084: 4
Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed due to other reasons ...``
and the task's ``ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.``
-- a kill (SIGKILL) for host RAM, as the kernel's OOM killer."""
_RAY_WORKER_DIED = "a worker died or was killed while executing a task by an unexpected system error"
_RAY_WORKER_DIED_RE = re.compile(r"A worker died or was killed while executing a task by an unexpected "
                                 r"system error\.(?:[^\n]{0,400}?Worker PID: (?P<pid>\d{1,10}))?"
                                 r"(?:[^\n]{0,200}?Worker exit type: (?P<exit_type>[A-Z_]{3,40}))?")
"""The raylet's report of a worker process that vanished without an exception of its own: ``(raylet) A worker
died or was killed while executing a task by an unexpected system error. ... Worker PID: 87687 Worker exit
type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file.
Some common causes include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray
stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV ...`` (verl-project/verl#4921).
Read as a kill (SIGKILL from outside: Ray's first and most common cause, the host OOM killer), at a lower
confidence than a report that names the killer; a crash of its own would have printed its signal."""
_RAY_ACTOR_DEAD = "its worker process has died. worker exit type: "
_RAY_ACTOR_DEAD_RE = re.compile(r"The actor is dead because its worker process has died\. Worker exit type: "
                                r"(?P<exit_type>SYSTEM_ERROR|NODE_OUT_OF_MEMORY)\b")
"""The same loss as the caller of a dead actor reads it, in ``ray.exceptions.ActorDiedError: The actor died
unexpectedly before finishing this task. ... The actor is dead because its worker process has died. Worker
exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2 ...``
(verl, OpenRLHF); ``NODE_OUT_OF_MEMORY``: Ray's memory monitor killed it. A ``USER_ERROR`` exit is the actor's
own exception (its traceback is printed), not read here."""
_GLIBC_ABORT_RE = re.compile(
    r"(?:\*\*\* Error in `[^`\n]{1,300}': )?(?P<msg>double free or corruption \((?:!prev|fasttop|out|top)\)"
    r"|free\(\): (?:invalid pointer|invalid size|invalid next size \((?:fast|normal)\)|double free detected "
    r"in tcache 2)|munmap_chunk\(\): invalid pointer|corrupted size vs\. prev_size"
    r"|corrupted double-linked list"
    r"|malloc\(\): (?:corrupted top size|memory corruption|unaligned tcache chunk detected|invalid size "
    r"\(unsorted\)|unsorted double linked list corrupted)|malloc_consolidate\(\): invalid chunk size"
    r"|realloc\(\): invalid (?:pointer|next size|old size))")
"""glibc's heap checks, each of which aborts the process (SIGABRT) on the spot: ``double free or corruption
(!prev)`` -- older glibc wraps it as ``*** Error in `python': double free or corruption (!prev): 0x... ***``
and prints a backtrace (MendelXu/SAN#6) --, ``free(): invalid pointer``, ``munmap_chunk(): invalid pointer``,
``corrupted size vs. prev_size``, ``malloc(): corrupted top size`` ... Native code (an extension, a decoder
in a DataLoader worker, a library's threads at exit) corrupted the heap: the abort is that crash
(process/exit), not the out-of-memory or CUDA error an unexplained SIGABRT stands for on the exit path."""
_GLIBC_NEEDLES = ("double free or corruption", "free(): ", "munmap_chunk(): ", "corrupted size vs. prev_size",
                  "corrupted double-linked list", "malloc(): ", "malloc_consolidate(): ", "realloc(): ")
_TRACEBACK_HEAD = "traceback (most recent call last)"
_PYTHON_ERROR_LINE_RE = re.compile(r"(?m)^[ \t]*[A-Za-z_][\w.]{0,160}(?:Error|Exception)(?::|[ \t]*$)")
"""A Python traceback, or an exception's own line (``KeyError: 'labels'``: the text a traceback's message is
classified from), printed BEFORE a glibc abort: that exception is the root and the abort a teardown
consequence (native libraries' atexit after the error), so the abort is not read here (hR's review, stop 42:
``KeyError: 'labels'`` then ``double free or corruption (!prev)`` read process/exit, not the KeyError)."""
_OOM_KILLER_RE = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process "
                            r"(?P<pid>\d{1,10}) \((?P<comm>[^)\n]{1,64})\)"
                            r"|Detected \d{1,6} oom[-_]kill events?")
"""The OOM killer's own report: the kernel's (``dmesg``) ``Out of memory: Killed process 629 (python)`` /
``Memory cgroup out of memory: Killed process ...``, Slurm's ``slurmstepd: error: Detected 1 oom-kill
event(s) in StepId=...``."""
_SLURM_MEMORY_RE = re.compile(r"(?:(?:Job|Step) [\d.]{1,30} exceeded memory limit \(\d{1,20} > \d{1,20}\), "
                              r"being killed|Exceeded (?:job|step) memory limit(?! at some point))")
"""Slurm's memory enforcement (``JobAcctGatherParams=OverMemoryKill``): ``slurmstepd: error: Job 7518 exceeded
memory limit (626359956 > 512000000), being killed`` / ``Exceeded job memory limit`` -- Slurm kills the job
for host memory; the ``*** JOB N ... CANCELLED AT ... ***`` line that follows is that kill, not a
cancellation of its own. ``Exceeded step memory limit at some point.`` is NOT a kill: the accounting plugin's
notice that the step's peak passed the limit (printed at the step's end, whatever ended it), so the error
printed beside it stays the verdict."""
_MPIRUN_SIGNAL_RE = re.compile(r"process rank (?P<rank>\d{1,7}) with PID \S{1,20} on node \S{1,120} "
                               r"exited on signal (?P<sig>\d{1,2})\b")
"""Open MPI's launcher (``mpirun``, as Horovod and DeepSpeed's MPI runner start workers): ``mpirun noticed
that process rank 1 with PID 0 on node n1 exited on signal 4 (Illegal instruction: 4).`` -- worker rank 1 was
ended by that signal. The PID (as the host) is any token: pasters replace it (``with PID xxxxxx on node
xxxxxxxx``, Aware-of-the-history#2)."""
_DIED_FROM_SIGNAL_RE = re.compile(r"(?:\b(?P<who>rank|process|worker|task) (?P<rank>\d{1,7}) )?"
                                  r"died from signal (?P<sig>\d{1,2})\b")
"""A launcher's per-process report of a signal death (ezpz's ``rank 0 died from signal 11 and dumped core``
then ``rank 4 died from signal 9`` as it kills the rest, saforem2/ezpz#210): the first such line is the
process that crashed; ``rank N`` names its rank."""
_CONTAINER_FAILED_RE = re.compile(r"Container rank (?P<rank>\d{1,7}) status failed cmd \[[^\n]{0,4000}?\] "
                                  r"code (?P<code>-?\d{1,4})\b")
"""Paddle's launcher (``python -m paddle.distributed.launch``): ``LAUNCH ERROR ... Container failed !!!`` then
``Container rank 0 status failed cmd ['python', '-u', 'train.py', ...] code 1 log log/workerlog.0`` -- that
worker exited with that code (a negative code: killed by that signal); its own error is in its workerlog."""


def _died_from_signal(t: _Text) -> Optional[_Hit]:
    """:data:`_DIED_FROM_SIGNAL_RE`'s report: the first line whose signal is not the launcher's kill (9, 15),
    else the first line -- unless a Python exception was printed before it (a traceback's head, or an
    exception's line within 4096 characters): then the launcher is reporting the processes it killed after
    that error, and the error is the verdict (the glibc abort's guard)."""
    found: List[Tuple[int, Any]] = []
    for pos in t.find_all("died from signal "):
        start = max(0, pos - 30)
        own = (m for m in _DIED_FROM_SIGNAL_RE.finditer(t.text, start, pos + 24)
               if m.start() <= pos < m.end())
        m = next(own, None)  # this occurrence's own report, not the line's before it
        if m is not None and int(m.group("sig")) in SIGNAL_NAMES:
            found.append((m.start(), m))
    if not found:
        return None
    at, m = next(((p, m) for p, m in found if int(m.group("sig")) not in (9, 15)), found[0])
    if 0 <= t.first(_TRACEBACK_HEAD) < at or _PYTHON_ERROR_LINE_RE.search(t.text, max(0, at - 4096), at):
        return None
    signal = int(m.group("sig"))
    facts: Facts = {"signal": signal, "signal_name": SIGNAL_NAMES[signal]}
    if m.group("who") == "rank":
        facts["rank"] = int(m.group("rank"))
    return _signal_hit(at, facts, "a worker")


def _rule_launcher_signal(t: _Text) -> Optional[_Hit]:
    """A launcher saying how a worker (or the launcher itself) was ended by a signal: the old
    ``torch.distributed.launch``'s ``CalledProcessError: Command '[... '--local_rank=7' ...]' died with
    <Signals.SIGSEGV: 11>``, the elastic agent's ``Received 15 death signal`` / ``SignalException:
    Process N got signal: 15``."""
    pos = t.first("died with <signals.")
    if pos >= 0 and (found := _search(_SIGNALS_RE, t, pos, before=0, after=80)) is not None:
        m = found[1]
        facts: Facts = {"signal": int(m.group("sig")), "signal_name": m.group("name")}
        command = _search(_LOCAL_RANK_RE, t, pos, before=3000, after=0)
        if command is not None:
            facts["rank"] = int(command[1].group("rank"))
        return _signal_hit(found[0] + m.start(), facts, "a worker")
    pos = t.first("' returned non-zero exit status ")
    if pos >= 0 and (found := _search(_CALLED_EXIT_RE, t, pos, before=2, after=60)) is not None:
        command = _search(_LOCAL_RANK_RE, t, pos, before=3000, after=0)
        code = int(found[1].group("code"))
        if command is not None and code > 0:
            worker = int(command[1].group("rank"))
            category, subtype, said = _launcher_exit_kind(code)
            called: Facts = {"exitcode": code, "rank": worker, "local_rank": worker}
            return _Hit(category, subtype, 0.6, pos, called, f"torch.distributed.launch: the worker with "
                        f"--local_rank={worker} exited ({said})", _EXIT_NOTE)
    pos = t.first("terminated with signal sig")
    if pos >= 0 and (found := _search(_SPAWN_SIGNAL_RE, t, pos, before=40, after=40)) is not None:
        m = found[1]
        signal = _SIGNAL_NUMBERS.get(m.group("name"), 0)
        if signal:
            spawn_index = int(m.group("rank"))
            facts = {"signal": signal, "signal_name": m.group("name"), "rank": spawn_index,
                     "local_rank": spawn_index}
            return _signal_hit(found[0] + m.start(), facts, "a spawned worker")
    pos = t.first("terminated with exit code ")
    if pos >= 0 and (found := _search(_SPAWN_EXIT_RE, t, pos, before=40, after=40)) is not None:
        m = found[1]
        spawn_code, spawn_rank = int(m.group("code")), int(m.group("rank"))
        if spawn_code > 0:
            category, subtype, said = _launcher_exit_kind(spawn_code)
            spawn_facts: Facts = {"exitcode": spawn_code, "rank": spawn_rank, "local_rank": spawn_rank}
            return _Hit(category, subtype, 0.6, found[0] + m.start(), spawn_facts,
                        f"a spawned worker (rank {spawn_rank}) exited ({said})", _EXIT_NOTE)
    pos = t.first("program received signal sig", "program terminated with signal sig")
    if pos >= 0 and (found := _search(_GDB_SIGNAL_RE, t, pos, before=0, after=60)) is not None:
        name = found[1].group("name")
        signal = _SIGNAL_NUMBERS.get(name, 0)
        if signal in (4, 6, 7, 8, 9, 11):  # a fatal one (gdb also stops at SIGINT, SIGPIPE, ...)
            gdb: Facts = {"signal": signal, "signal_name": name, "reporter": "gdb"}
            return _signal_hit(found[0] + found[1].start(), gdb, "the debugged process")
    pos = t.first("exits with return code = ")
    if pos >= 0 and (found := _search(_RETURN_CODE_RE, t, pos, before=0, after=60)) is not None:
        code = int(found[1].group("code"))
        command = _search(_LOCAL_RANK_RE, t, pos, before=4000, after=0)
        rank = int(command[1].group("rank")) if command is not None else None
        if code > 0:
            category, subtype, said = _launcher_exit_kind(code)
            exit_facts: Facts = {"exitcode": code} if rank is None else {"exitcode": code, "rank": rank}
            on = f" (rank {rank})" if rank is not None else ""
            return _Hit(category, subtype, 0.6, pos, exit_facts, f"a worker{on} exited ({said})", _EXIT_NOTE)
        if code < 0:
            signal = -code
            facts = {"signal": signal, "signal_name": SIGNAL_NAMES.get(signal, f"signal {signal}")}
            if rank is not None:
                facts["rank"] = rank
            return _signal_hit(pos, facts, "a worker")
    composer = _composer_exit(t)
    if composer is not None:
        return composer
    pos = t.first(_RUNNER_NEEDLE)
    if pos >= 0 and (found := _search(_RUNNER_FAILED_RE, t, pos, before=0, after=4000)) is not None:
        runner: Facts = {"launcher": found[1].group("launcher"), "host": found[1].group("host")}
        return _Hit("process", "exit", 0.6, found[0] + found[1].start(), runner,
                    f"colossalai run: {runner['launcher']} failed on {runner['host']}",
                    "the multi-node runner reports that the command it started on that host exited with an "
                    "error; the workers' own output above (or on that host) says why")
    pos = t.first(" received by pid ")
    if pos >= 0 and (found := _search(_RECEIVED_RE, t, pos, before=120, after=20)) is not None:
        m = found[1]
        name = m.group("name") or m.group("name2")
        signal = int(m.group("sig")) if m.group("sig") else _SIGNAL_NUMBERS.get(name, 0)
        if signal:
            return _signal_hit(found[0] + m.start(), {"signal": signal, "signal_name": name}, "a worker")
    pos = t.first("interrupted by signal ")
    if pos >= 0 and (found := _search(_INTERRUPTED_RE, t, pos, before=60, after=40)) is not None:
        m = found[1]
        ide: Facts = {"signal": int(m.group("sig")), "signal_name": m.group("name"), "reporter": "ide"}
        return _signal_hit(found[0] + m.start(), ide, "the process")
    pos = t.first("exited on signal ")
    if pos >= 0 and (found := _search(_MPIRUN_SIGNAL_RE, t, pos, before=120, after=40)) is not None:
        m = found[1]
        signal = int(m.group("sig"))
        if signal in SIGNAL_NAMES:
            mpi: Facts = {"signal": signal, "signal_name": SIGNAL_NAMES[signal], "rank": int(m.group("rank")),
                          "launcher": "mpirun"}
            return _signal_hit(found[0] + m.start(), mpi, "mpirun: a worker")
    from_signal = _died_from_signal(t)
    if from_signal is not None:
        return from_signal
    pos = t.first("container rank ")
    if pos >= 0 and (found := _search(_CONTAINER_FAILED_RE, t, pos, before=0, after=4100)) is not None:
        m = found[1]
        paddle = _rank_exit(found[0] + m.start(), int(m.group("code")), int(m.group("rank")), "paddle",
                            "paddle.distributed.launch")
        if paddle is not None:
            return paddle
    pos = t.first("exceeded memory limit", "exceeded job memory limit", "exceeded step memory limit")
    if pos >= 0 and (found := _search(_SLURM_MEMORY_RE, t, pos, before=60, after=120)) is not None:
        memory: Facts = {"signal": 9, "signal_name": "SIGKILL", "scheduler": "slurm",
                         "killer": "slurm-memory-limit"}
        hit = _signal_hit(found[0] + found[1].start(), memory, "Slurm")
        return replace(hit, headline=f"{hit.headline}: the job exceeded its memory limit (host memory)",
                       note="Slurm killed the job because its tasks used more host RAM than the job asked "
                            "for (--mem / --mem-per-cpu): DataLoader workers, a dataset loaded into memory, "
                            "pinned buffers; ask for more memory or use less")
    pos = t.first(_SLURM_CANCELLED)
    if pos >= 0 and (found := _search(_SLURM_CANCELLED_RE, t, pos, before=120, after=120)) is not None:
        m = found[1]
        slurm: Facts = {"signal": 15, "signal_name": "SIGTERM", "scheduler": "slurm",
                        "slurm_job": m.group("id"), "host": m.group("host")}
        if m.group("reason"):
            slurm["reason"] = m.group("reason").strip().lower()
        return _signal_hit(found[0] + m.start(), slurm, f"Slurm {m.group('what').lower()} {m.group('id')}")
    pos = t.first("death signal", "got signal:")
    if (pos >= 0 and (found := _search(_DEATH_SIGNAL_RE, t, pos, before=40, after=40)) is not None
            and (signal := int(found[1].group("sig") or found[1].group("sig2")
                               or _SIGNAL_NUMBERS.get(found[1].group("name"), 0)))):
        m = found[1]
        facts = {"signal": signal, "signal_name": SIGNAL_NAMES.get(signal, f"signal {signal}")}
        hit = _signal_hit(found[0] + m.start(), facts, "the launcher")
        if signal in _STOP_SIGNALS:
            return replace(hit, category="process", subtype="terminated",
                           headline=f"the launcher was asked to stop ({facts['signal_name']}) and shut its "
                                    "workers down",
                           note="a signal from outside the job (a closed terminal or ssh session: SIGHUP; "
                                "the scheduler or an operator: SIGTERM; Ctrl-C: SIGINT) stopped the "
                                "launcher; nohup/tmux/screen keep a run alive after the session ends")
        return hit
    pos = t.first(*_RAY_OOM_NEEDLES)
    if pos >= 0 and (found := _search(_RAY_OOM_RE, t, pos, before=80, after=80)) is not None:
        ray: Facts = {"signal": 9, "signal_name": "SIGKILL", "killer": "ray-memory-monitor"}
        if found[1].group("workers"):
            ray["workers_killed"] = int(found[1].group("workers"))
        hit = _signal_hit(found[0] + found[1].start(), ray, "Ray's memory monitor")
        return replace(hit, headline=f"{hit.headline}: workers killed for host memory (Ray OOM)",
                       note="Ray's memory monitor killed workers because the node's host RAM crossed "
                            "RAY_memory_usage_threshold: rollout/dataloader/offload buffers in CPU memory; "
                            "give the node more memory, fewer workers per node, or lower CPU-side buffers")
    pos = t.first("killed process", "oom-kill event")
    if pos >= 0 and (found := _search(_OOM_KILLER_RE, t, pos, before=60, after=120)) is not None:
        m = found[1]
        facts = {"signal": 9, "signal_name": "SIGKILL", "killer": "oom-killer"}
        if m.group("pid"):
            facts.update(pid=int(m.group("pid")), process=m.group("comm"))
        hit = _signal_hit(found[0] + m.start(), facts, f"process {m.group('pid')} ({m.group('comm')})"
                          if m.group("pid") else "a process of the job")
        return replace(hit, headline=f"{hit.headline}: the host's OOM killer (out of host memory)",
                       note="the kernel's (or the job's cgroup's) OOM killer ended it: host RAM ran out -- "
                            "DataLoader workers, pinned memory, a dataset loaded into memory")
    pos = t.first(_RAY_WORKER_DIED, _RAY_ACTOR_DEAD)
    if pos >= 0 and ((found := _search(_RAY_WORKER_DIED_RE, t, pos, before=0, after=800)) is not None
                     or (found := _search(_RAY_ACTOR_DEAD_RE, t, pos, before=80, after=120)) is not None):
        m = found[1]
        died: Facts = {"signal": 9, "signal_name": "SIGKILL", "reporter": "raylet"}
        if "pid" in m.groupdict() and m.group("pid"):
            died["pid"] = int(m.group("pid"))
        if m.group("exit_type"):
            died["exit_type"] = m.group("exit_type")
        if died.get("exit_type") == "NODE_OUT_OF_MEMORY":
            died["killer"] = "ray-memory-monitor"
        hit = _signal_hit(found[0] + m.start(), died, "a Ray worker")
        return replace(hit, confidence=0.6, headline="a Ray worker died without an error of its own (raylet: "
                       f"{died.get('exit_type', 'unexpected system error')}), most often killed",
                       note="the raylet lost the worker process without an exception from it: most often the "
                            "host's OOM killer (check dmesg / the node's memory), else 'ray stop --force' or "
                            "a native crash; the dead worker's log under /tmp/ray/session_latest/logs says "
                            "which")
    pos = t.first(*_GLIBC_NEEDLES)
    if (pos >= 0 and not 0 <= t.first(_TRACEBACK_HEAD) < pos
            and _PYTHON_ERROR_LINE_RE.search(t.text, max(0, pos - 4096), pos) is None
            and (found := _search(_GLIBC_ABORT_RE, t, pos, before=320, after=120)) is not None):
        m = found[1]
        glibc: Facts = {"error": m.group("msg"), "signal": 6, "signal_name": "SIGABRT", "reporter": "glibc"}
        return _Hit("process", "exit", 0.6, found[0] + m.start("msg"), glibc,
                    f"glibc aborted the process: {m.group('msg')} (SIGABRT)",
                    "glibc found the heap corrupted and aborted the process: a native extension or library "
                    "wrote past a buffer or freed twice (often in DataLoader workers: num_workers=0 confirms "
                    "it); update or rebuild the native package")
    pos = t.first("segmentation fault", "killed", "illegal instruction", "floating point exception",
                  "bus error")
    if pos >= 0 and ((found := _search(_SHELL_DEATH_RE, t, pos, before=300, after=400)) is not None
                     or (found := _search(_ZSH_DEATH_RE, t, pos, before=300, after=400)) is not None):
        return _shell_death_hit(*found)
    l10n = next((l10n_m for needle in _L10N_NEEDLES for pos in t.find_all(needle)
                 if (l10n_m := _search(_L10N_DEATH_RE, t, pos, before=300, after=400)) is not None), None)
    if l10n is not None:
        said = l10n[1].group("what")
        signal, name = _SHELL_SIGNALS[_SHELL_L10N[said]]
        return _signal_hit(l10n[0] + l10n[1].start("what"),
                           {"signal": signal, "signal_name": name, "reporter": "shell", "said": said},
                           "the process")
    for pos in t.find_all("(core dumped)"):
        if (found := _search(_CORE_DUMPED_RE, t, pos, before=30, after=14)) is not None:
            return _shell_death_hit(*found)
    for pos in t.find_all(": line "):
        if (found := _search(_BASH_JOB_RE, t, pos, before=0, after=60)) is not None:
            return _shell_death_hit(*found)
    for pos in t.find_all("killed"):
        if t.text.startswith("Killed", pos) and \
                (found := _search(_GLUED_KILLED_RE, t, pos, before=1, after=40)) is not None:
            return _shell_death_hit(*found)
    pos = t.first("this job is ")
    if pos >= 0 and (found := _search(_SUBMITIT_RE, t, pos, before=250, after=40)) is not None:
        m = found[1]
        signal = _SIGNAL_NUMBERS.get(m.group("name"), 0)
        why = m.group("why")
        sub: Facts = {"signal": signal, "signal_name": m.group("name"), "reporter": "submitit",
                      "reason": "preemption" if why == "preempted" else "time limit"}
        return _Hit("process", "terminated", 0.7, found[0] + m.start(), sub,
                    f"Slurm {'preempted' if why == 'preempted' else 'timed out'} the job (submitit caught "
                    f"{m.group('name')})",
                    "the scheduler ended the job from outside (preemption, or its time limit): not a crash "
                    "-- submitit requeues it when the job is checkpointable")
    return None


def _shell_death_hit(offset: int, m: re.Match[str]) -> _Hit:
    """The hit for a shell's death report ``m`` (group ``what``: the signal in words) found at ``offset``."""
    signal, name = _SHELL_SIGNALS[m.group("what").lower()]
    return _signal_hit(offset + m.start("what"), {"signal": signal, "signal_name": name, "reporter": "shell"},
                       "the process")


_SLURM_CANCELLED = "cancelled at"
_SLURM_CANCELLED_RE = re.compile(r"\*\*\* (?P<what>JOB|STEP) (?P<id>[\d.]{1,30}) ON (?P<host>\S{1,120}) "
                                 r"CANCELLED AT \S{1,40}(?: DUE TO (?P<reason>[A-Z][A-Z ]{0,40}?))? \*\*\*")
"""slurmstepd's ``*** JOB 494583 ON node CANCELLED AT 2024-04-20T09:09:37 DUE TO TIME LIMIT ***`` (also a
``STEP``, and without a reason: ``scancel``): the scheduler ended the job -- SIGTERM to its tasks, SIGKILL
after the grace period."""


SINGLE_PROCESS_REPORTERS = ("gdb", "ide", "shell")
"""``facts["reporter"]`` of a signal death reported for one process (a debugger, an IDE's run console, a
shell's death report), not by a distributed launcher for one of its worker ranks."""


def _composer_exit(t: _Text) -> Optional[_Hit]:
    """Composer's launcher line for the first rank it saw end (see :data:`_COMPOSER_EXIT_RE`): a signal by the
    exit decision path, a plain non-zero code ``process/exit``; the culprit its rank. A ``Global rank N (PID
    P) exited with code -9/-15`` line is the launcher's own kill, read as nothing, when the text says the
    launcher killed that rank or that a rank crashed (:func:`_composer_kills`); with neither it is read as
    the rank's own death, at :data:`COMPOSER_BARE_KILL_CONFIDENCE`."""
    lines = sorted(_composer_lines(t), key=lambda line: line[0])
    if not lines:
        return None
    crashed = any(m.group("pid") is None for _, m in lines)
    killed = _composer_kills(t)
    for at, m in lines:
        code, rank = int(m.group("code")), int(m.group("rank"))
        kill = m.group("pid") is not None and code in _COMPOSER_KILL_CODES
        if kill and (crashed or rank in killed):
            continue  # the survivor the launcher stopped after another rank's end
        hit = _rank_exit(at, code, rank, "composer", "composer's launcher")
        if hit is not None and kill:
            return replace(hit, confidence=COMPOSER_BARE_KILL_CONFIDENCE, note=_COMPOSER_KILL_NOTE)
        if hit is not None:
            return hit
    return None


def _composer_lines(t: _Text) -> List[Tuple[int, re.Match[str]]]:
    """``(offset, match)`` of each Composer launcher line (at most ``MAX_HITS`` of each needle)."""
    out: List[Tuple[int, re.Match[str]]] = []
    for needle in _COMPOSER_NEEDLES:
        for pos in t.find_all(needle):
            own = (m for m in _COMPOSER_EXIT_RE.finditer(t.text, max(0, pos - 60), pos + 30)
                   if m.start() <= pos < m.end())
            m = next(own, None)  # this occurrence's line, not the one before it
            if m is not None:
                out.append((m.start(), m))
    return out


def _composer_kills(t: _Text) -> Set[int]:
    """The ranks Composer's launcher says it stopped (``Killing global rank N (PID P) with SIGTERM``,
    ``Failed to kill global rank N (PID P) with SIGTERM; terminating with SIGKILL instead``)."""
    ranks: Set[int] = set()
    for needle in _COMPOSER_KILL_NEEDLES:
        for pos in t.find_all(needle):
            if (found := _search(_COMPOSER_KILL_RE, t, pos, before=0, after=80)) is not None:
                ranks.add(int(found[1].group("rank")))
    return ranks


def _rank_exit(at: int, code: int, rank: int, launcher: str, who: str) -> Optional[_Hit]:
    """A launcher's report that the worker of ``rank`` ended with ``code``: a negative code is the signal it
    stands for (by the exit decision path), a positive one a plain exit (:func:`_launcher_exit_kind`); the
    culprit ``rank``. None for 0 or a negative code that is no known signal."""
    if code < 0 and -code in SIGNAL_NAMES:
        facts: Facts = {"signal": -code, "signal_name": SIGNAL_NAMES[-code], "rank": rank,
                        "launcher": launcher}
        return _signal_hit(at, facts, f"{who}: a worker")
    if code <= 0:
        return None
    category, subtype, said = _launcher_exit_kind(code)
    exited: Facts = {"exitcode": code, "rank": rank, "launcher": launcher}
    return _Hit(category, subtype, 0.6, at, exited, f"{who}: the worker of rank {rank} exited ({said})",
                _EXIT_NOTE)


def _signal_hit(pos: int, facts: Facts, who: str) -> _Hit:
    category, subtype, said = _exit_kind(128 + int(facts["signal"]))
    rank = facts.get("rank")
    on = f" (rank {rank})" if isinstance(rank, int) else ""
    return _Hit(category, subtype, 0.7, pos, facts, f"{who}{on} ended by {facts['signal_name']} ({said})",
                "the launcher reports the signal that ended the process; what sent it (the OOM-killer, the "
                "scheduler, a crash) is in the lines before")


# ----------------------------------------------------------------------------------------------------
# torchrun's ChildFailedError summary


_FAILURE_HEADER_RE = re.compile(r"^\[(?P<idx>\d+)\]:\s*$")
_FAILURE_FIELD_RE = re.compile(
    r"^\s{1,8}(?P<key>time|host|rank|exitcode|error_file|traceback)\s{0,8}: ?(?P<value>.*)$")
_RANK_FIELD_RE = re.compile(r"(?P<rank>-?\d+)(?: \(local_rank: (?P<local>-?\d+)\))?")
_EXIT_FIELD_RE = re.compile(r"(?P<code>-?\d+)(?: \(pid: (?P<pid>\d+)\))?\s*(?:\((?P<sig>SIG\w+)\))?")
_SIGNAL_MSG_RE = re.compile(r"Signal (?P<sig>\d+) \((?P<name>SIG\w+)\) received by PID (?P<pid>\d+)")
_SEPARATOR_RE = re.compile(r"^\s*(?:={8,}|-{8,})\s*$")
_MAX_FAILURES = 64
_MAX_TRACEBACK_LINES = 400


def _parse_failures(lines: Sequence[str]) -> List[Tuple[bool, Dict[str, Any], List[str]]]:
    """``(is_root, fields, traceback lines)`` of each failure block after ``Failures:``."""
    out: List[Tuple[bool, Dict[str, Any], List[str]]] = []
    root = False
    current: Optional[Tuple[bool, Dict[str, Any], List[str]]] = None
    in_traceback = False
    for line in lines:
        if line.startswith("Root Cause (first observed failure):"):
            root, current, in_traceback = True, None, False
            continue
        if _FAILURE_HEADER_RE.match(line):
            if len(out) >= _MAX_FAILURES:
                break
            current = (root, {}, [])
            out.append(current)
            in_traceback = False
            continue
        if _SEPARATOR_RE.match(line):
            if root and current is not None:
                break  # the closing border
            current, in_traceback = None, False
            continue
        if current is None:
            continue
        field_match = _FAILURE_FIELD_RE.match(line)
        if field_match and not (in_traceback and _indent(line) > 2):
            key, value = field_match.group("key"), field_match.group("value").strip()
            current[1][key] = value
            in_traceback = key == "traceback"
            if in_traceback and value:
                current[2].append(value)
            continue
        if in_traceback and len(current[2]) < _MAX_TRACEBACK_LINES:
            current[2].append(line[2:] if line.startswith("  ") else line)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _failure_facts(fields: Mapping[str, Any], traceback_lines: Sequence[str]) -> Tuple[Facts, str, str]:
    """Facts of one failure, its traceback text, and a short description of its error."""
    facts: Facts = {}
    if (m := _RANK_FIELD_RE.match(fields.get("rank", ""))) is not None:
        facts["rank"] = int(m.group("rank"))
        if m.group("local") is not None:
            facts["local_rank"] = int(m.group("local"))
    if (m := _EXIT_FIELD_RE.match(fields.get("exitcode", ""))) is not None:
        facts["exitcode"] = int(m.group("code"))
        if m.group("pid"):
            facts["pid"] = int(m.group("pid"))
        if m.group("sig"):
            facts["signal_name"] = m.group("sig")
    for key in ("time", "host"):
        if fields.get(key):
            facts[key] = fields[key]
    error_file = fields.get("error_file", "")
    facts["error_file"] = None if error_file in ("", "<N/A>") else error_file
    text = "\n".join(traceback_lines).strip()
    error = ""
    if (sig := _SIGNAL_MSG_RE.search(text[:400])) is not None:
        facts.update(signal=int(sig.group("sig")), signal_name=sig.group("name"))
        error = sig.group(0)
    elif text.startswith("Traceback"):
        parsed = [e for e in parse_traceback_text(text) if e.relation == ""]
        if parsed:
            last = parsed[-1]
            error = f"{last.exc_type}: {_first_line(last.message)}" if last.message else last.exc_type
    elif text and not text.startswith("To enable traceback"):
        error = _first_line(text)
    if error:
        facts["error"] = _shorten(error, 300)
    if "signal" not in facts and isinstance(facts.get("exitcode"), int) and facts["exitcode"] < 0:
        facts["signal"] = -facts["exitcode"]
        facts.setdefault("signal_name", SIGNAL_NAMES.get(facts["signal"], f"signal {facts['signal']}"))
    return facts, text, error


def _rule_torchrun(t: _Text, depth: int) -> Optional[_Hit]:
    pos = t.first("root cause (first observed failure):")
    if pos < 0:
        return None
    start = t.lower.rfind("failures:", max(0, pos - 400_000), pos)
    start = t.text.rfind("\n", 0, start) + 1 if start >= 0 else t.text.rfind("\n", 0, pos) + 1
    title_start = t.text.rfind("\n", 0, max(0, start - 1))
    title_block = t.text[max(0, title_start - 400): start].splitlines()
    job = next((ln.strip()[: -len(" FAILED")] for ln in reversed(title_block)
                if ln.strip().endswith(" FAILED")), "")
    end = t.text.find("\n=====", pos)
    end = len(t.text) if end < 0 else end + 200
    blocks = _parse_failures(t.text[start:end].split("\n"))
    failures: List[Facts] = []
    root_facts: Optional[Facts] = None
    root_text = ""
    for is_root, fields, tb_lines in blocks:
        one, text, _error = _failure_facts(fields, tb_lines)
        failures.append(one)
        if is_root and root_facts is None:
            root_facts, root_text = one, text
    if root_facts is None:
        return None
    facts: Facts = {"root_cause_rank": root_facts.get("rank"), "failures": failures,
                    "failed_ranks": sorted({f["rank"] for f in failures if isinstance(f.get("rank"), int)})}
    if job:
        facts["job"] = job
    for key in ("exitcode", "signal", "signal_name", "time", "host", "error", "error_file", "local_rank"):
        if root_facts.get(key) is not None:
            facts[f"root_cause_{key}" if key != "time" else "first_failure_time"] = root_facts[key]
    # the root cause's own kind: its exception if it printed one, else its exit code / signal
    root_kind: Optional[Classification] = None
    if root_text.startswith("Traceback") and depth < 2:
        parsed = [e for e in parse_traceback_text(root_text) if e.relation == ""]
        if parsed:
            from . import _classify_exception  # the package classifies the root cause's own traceback

            root_kind = _classify_exception(parsed[-1].exc_type, parsed[-1].message, depth + 1)
    if root_kind is not None:
        category, subtype, confidence = root_kind.category, root_kind.subtype, min(0.9, root_kind.confidence)
        facts["root_cause_rule"] = root_kind.rule
        if root_kind.facts:
            facts["root_cause_facts"] = dict(root_kind.facts)
    elif isinstance(root_facts.get("exitcode"), int):
        category, subtype, _said = _launcher_exit_kind(root_facts["exitcode"])
        confidence = 0.8
    else:
        category, subtype, confidence = "process", "exit", 0.5
    how = root_facts.get("error") or (f"exit code {root_facts['exitcode']}" if "exitcode" in root_facts
                                      else "")
    if "signal_name" in root_facts and "exitcode" in root_facts and "received" not in how:
        how = f"exit code {root_facts['exitcode']}, {root_facts['signal_name']}"
    count = len(facts["failed_ranks"]) or len(failures)
    headline = (f"torchrun: rank {facts['root_cause_rank']} failed first ({_shorten(how, 120)}); "
                f"{count} rank{'s' if count != 1 else ''} failed")
    note = ("torchrun's root cause is the first observed failure; the other ranks' failures usually follow "
            "from it")
    evidence = [t.lower.find(key, pos, end) for key in ("rank      :", "exitcode  :", "traceback :")]
    error = root_facts.get("error")
    if isinstance(error, str) and error:
        evidence.append(t.text.find(error[:80], pos, end))
    return _Hit(category, subtype, confidence, pos, facts, headline, note,
                extra_lines=tuple(p for p in evidence if p >= 0))



SUMMARY_CUT_RULE = "torchrun.summary-without-root"


def summary_without_root(exc_type: str, message: str) -> Classification:
    """torchrun's ``ChildFailedError`` whose summary names no root cause (the paste cut it off, or it shows
    only ``<NO_OTHER_FAILURES>``): the launcher's report that a worker failed, not an exception of the job.
    ``process/exit`` at a low confidence, so that it folds into the failure the agent's own line names
    (``failed (exitcode: -9) local_rank: 5``) instead of leading as a crash of its own."""
    job = next((ln.strip()[: -len(" FAILED")] for ln in message.splitlines()[:8]
                if ln.strip().endswith(" FAILED")), "")
    facts: Facts = {"exc_type": exc_type, "summary_cut": True}
    if job:
        facts["job"] = job
    headline = f"torchrun: {job or 'a worker'} failed (its summary names no root cause)"
    return Classification("process", "exit", SUMMARY_CUT_RULE, 0.3, headline, facts, (exc_type,),
                          "the launcher's summary without its root-cause entry: the failed worker's own "
                          "line (its exit code or signal) or traceback says what happened")

TEARDOWN_RULE = "deepspeed.launcher-teardown"
_TEARDOWN_NEEDLE = "sigkill_handler] Killing subprocess "
_TEARDOWN_RE = re.compile(r"\[launch\.py:\d{1,5}:sigkill_handler\] Killing subprocess (?P<pid>\d{1,10})\b")
"""DeepSpeed's launcher (``deepspeed/launcher/launch.py``) tearing its workers down: its ``sigkill_handler``
runs when a worker exited non-zero (or the launcher was signalled), logs ``Killing subprocess PID`` for
every worker, then raises ``CalledProcessError``. The line names a PID, never a rank."""


def launcher_teardown(text: str) -> Optional[Classification]:
    """DeepSpeed's ``[launch.py:N:sigkill_handler] Killing subprocess PID`` in ``text`` -- the launcher
    stopping every worker because one of them failed -- when no rule and no Python traceback said more:
    ``process/exit`` with no rank (which worker failed, and why, is in that worker's own output; when the
    text shows it after this line, the process detector folds this exit into it). None without the line."""
    pos = text.find(_TEARDOWN_NEEDLE)
    if pos < 0:
        return None
    start = text.rfind("\n", 0, pos) + 1
    m = _TEARDOWN_RE.search(text, max(start, pos - 40), pos + len(_TEARDOWN_NEEDLE) + 12)
    if m is None:
        return None
    line = text[start:text.find("\n", pos) if "\n" in text[pos:] else len(text)]
    facts: Facts = {"pid": int(m.group("pid")), "launcher": "deepspeed"}
    return Classification("process", "exit", TEARDOWN_RULE, 0.6,
                          "DeepSpeed's launcher killed its workers (a worker failed; its own error says why)",
                          facts, (_shorten(line.strip(), 300),),
                          "DeepSpeed's launcher stops every worker when one exits non-zero: the failed "
                          "worker's own error (a traceback, an exit code with its --local_rank) says what "
                          "happened")


GATES = {
    "torchrun.child-failed": ("root cause (first observed failure):",),
    "torchrun.worker-failed": ("failed (exitcode:", _ENTRY_NEEDLE),
    "launcher.signal": (_RUNNER_NEEDLE, *_COMPOSER_NEEDLES, *_RAY_OOM_NEEDLES, _RAY_WORKER_DIED,
                        _RAY_ACTOR_DEAD, *_GLIBC_NEEDLES,
                        "died with <signals.",
                        "' returned non-zero exit status ",
                        "terminated with signal sig", "terminated with exit code ",
                        "program received signal sig",
                        "program terminated with signal sig", "exits with return code = ",
                        " received by pid ", "death signal", "got signal:", "segmentation fault", "killed",
                        "oom-kill event", "exited on signal ", "died from signal ", "container rank ",
                        "exceeded memory limit",
                        "exceeded job memory limit", "exceeded step memory limit",
                        "illegal instruction", "floating point exception", "interrupted by signal ",
                        "(core dumped)",
                        "bus error", _SLURM_CANCELLED, ": line ", "this job is ", *_L10N_NEEDLES),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    TEARDOWN_RULE: (
        "DeepSpeed's ``[launch.py:N:sigkill_handler] Killing subprocess PID`` when no other rule and no "
        "Python traceback matched → process/exit, no culprit (the launcher stopping its workers after one "
        "failed; that worker's own error, printed after it, leads and this exit folds into it)"
    ),
    SUMMARY_CUT_RULE: (
        "(with ``exc_type`` ChildFailedError) a torchrun summary that names no root cause (cut off, or only "
        "``<NO_OTHER_FAILURES>``) → process/exit at a low confidence: the launcher's report, which the "
        "failed worker's own exit line or traceback explains"
    ),
    'torchrun.child-failed': (
        "torchrun's ``ChildFailedError`` summary: the root cause's own kind (its traceback, else its signal "
        'by the decision path; a plain non-zero exit code with no traceback → process/exit), the culprit its '
        '``rank :`` field'
    ),
    'torchrun.worker-failed': (
        '``failed (exitcode: N) local_rank: R`` → a signal by the exit decision path, a plain non-zero code '
        '→ process/exit (the worker\'s own exception, if printed, is an incident of its own); the culprit R. '
        'Also a torchrun failure entry\'s ``exitcode  : N (pid: P)`` field without the summary\'s header → '
        'process/exit, the culprit its ``rank      : R`` field (or the stream the line came from)'
    ),
    'launcher.signal': (
        "``died with <Signals.SIGSEGV: 11>`` (torch.distributed.launch; its ``CalledProcessError`` for a "
        "command with ``--local_rank=N`` that ``returned non-zero exit status 1`` → process/exit, the "
        "culprit N), ``Received 15 death signal`` (or ``Received Signals.SIGINT death signal``), "
        "``colossalai run``'s ``Error: failed to run torchrun ... on <host>`` → process/exit, MosaicML "
        "Composer's launcher ``Rank N crashed with exit code C`` / ``Global rank N (PID P) exited with code "
        "C`` → process/exit (C < 0: by the decision path for signal -C), the culprit N (``Global rank N ... "
        "exited with code -9/-15`` beside ``Killing global rank N`` / ``Failed to kill global rank N`` or a "
        "``Rank M crashed`` line: the launcher's own kill of a survivor, read as nothing; alone: at 0.5, "
        "below ``log_min_confidence``), Ray's memory "
        "monitor's ``N Workers (tasks / actors) killed due to memory pressure (OOM)`` / ``Task was killed "
        "due to the node running low on memory`` → process/killed (host RAM), "
        "``SignalException: ... got signal: 15``, an IDE's ``exit code 139 (interrupted by signal 11: "
        "SIGSEGV)`` (also with full-width ``\uff08 \uff1a \uff09``), DeepSpeed's ``exits with return code "
        "= -11`` (``= 1``: "
        "process/exit; the culprit its ``--local_rank``), "
        "``Signal 11 (SIGSEGV) received by PID`` / glog's and absl's ``*** SIGTERM (@0x..) received by PID`` "
        "(also ``(@(nil)), see ...`` or no address), "
        "mp.spawn's ``process 1 terminated with signal SIGKILL`` (the rank; ``... with exit code 1``: "
        "process/exit), gdb's ``Program received signal "
        "SIGSEGV``, a "
        "shell's ``Segmentation fault (core dumped)`` / ``Killed`` / ``Illegal instruction`` / "
        "the same in the shell's zh_CN locale, alone on its line or in bash's job report (glibc's words: "
        "``已杀死``, ``段错误``, ...) / "
        "zsh's lower-case ``20121 floating point exception (core dumped)`` / any of them with "
        "``(core dumped)`` mid-line (glued to a progress bar, quoted in a sentence) / "
        "``Bus error`` / "
        "``Floating point exception`` / Slurm's ``*** JOB|STEP N ON host CANCELLED AT ... [DUE TO TIME "
        "LIMIT] ***`` (SIGTERM from the scheduler) "
        "→ by the exit decision path for that signal; the OOM killer's report (dmesg's ``Out of memory: "
        "Killed process N (python)``, Slurm's ``Detected 1 oom-kill event(s)``, Slurm's memory limit "
        "``Job N exceeded memory limit (A > B), being killed`` -- it wins over the ``CANCELLED AT`` line it "
        "causes) → process/killed (SIGKILL); Open MPI's ``mpirun noticed that process rank N with PID P on "
        "node H exited on signal S`` → by the exit decision path for S, the culprit N; a launcher's "
        "``rank N died from signal S [and dumped core]`` (ezpz) → by the exit decision path for S, the "
        "culprit N (the first line of another signal than 9/15, the launcher's kills; none after a Python "
        "exception printed before it: that error is the verdict); Paddle's launcher "
        "``Container rank N status failed cmd [...] code C`` → process/exit (C < 0: by the decision path for "
        "signal -C), the culprit N; the raylet's ``A worker died or was killed while executing a task by an "
        "unexpected system error ... Worker exit type: SYSTEM_ERROR`` (or a dead actor's ``The actor is dead "
        "because its worker process has died. Worker exit type: SYSTEM_ERROR|NODE_OUT_OF_MEMORY``) → "
        "process/killed at a lower confidence "
        "(a worker gone without an error of its own: Ray's first cause, the OOM killer); glibc's "
        "heap-corruption aborts (``double free or corruption (!prev)``, also older glibc's ``*** Error in "
        "`python': ... ***``, ``free(): invalid pointer``, ``munmap_chunk(): invalid pointer``, ``corrupted "
        "size vs. prev_size``, ``malloc(): corrupted top size``, ...) → process/exit (SIGABRT: a native "
        "crash, "
        "not the OOM or CUDA error the exit path reads an unexplained abort as); a shell's ``Killed`` glued "
        "to the end of the progress line it interrupted (``- loss: 2.1371Killed``) and bash's job report "
        "``<script>: line N: PID Killed ...`` anywhere in a line → by the exit decision path (SIGKILL: "
        "process/killed); the elastic agent's death signal (``Received N death signal``, ``got signal: N``) "
        "for SIGHUP, SIGINT, SIGQUIT or SIGTERM → process/terminated (the launcher asked to stop from "
        "outside); submitit's ``Caught signal SIGx on <host>: this job is preempted|timed-out`` → "
        "process/terminated"
    ),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
