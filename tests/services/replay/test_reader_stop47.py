"""Stop 47 (hL): a paste that ends inside a Python traceback -- the exception line cut off by the paster or by
the excerpt it came from -- is the process raising there, when nothing else in the paste says what failed.

The reader (``trainguard_server.replay.logs``) emits such a block as one exception item of no known type
(``process/exception``) at the end of pasted text, unless the traceback is a launcher's own (torchrun,
``torch.distributed.launch``, DeepSpeed's / Accelerate's launchers: the workers' errors and the launcher's
summary tell the failure), ends in start-up or supervision code only (runpy, torchelastic's agent, a
console script stub), or the paste already holds an exception or a line the classifier recognises. A live
tail (not ``headless``) never does this: its output goes on after a flush."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_server.replay.logs import LogSegmenter, clean_line

from .local_import import WILD, imported, lines_of, pasted, shown

HEALTHY = Path(__file__).resolve().parents[2] / "fixtures" / "healthy47"


@pytest.mark.parametrize("case", [
    # nnU-Net + torch.compile: flush-left frames cut inside the forward (tuned side of batch 9)
    "proc-exception-nnunet-compile-epoch-600-flush-left-frames-cut-triton-3708-1",
    # Composer's FSDP state_dict at close: the traceback cut inside FSDP's state_dict (batch 9)
    "proc-exception-composer-fsdp-state-dict-backward-pre-checkpoint-close-llm-foundry-247-1",
    # mp.spawn's SimpleQueue creation cut inside ctx.Lock() (no space left on /dev/shm, per the thread)
    "ckpt-shm-errno28-joblib-warning-spawn-queue-cut-vits-397-1",
])
def test_a_paste_cut_inside_its_traceback_is_an_exception(case: str) -> None:
    assert shown(imported(WILD / case / "log.txt"))[:1] == ["process/exception"]


@pytest.mark.parametrize("case, kind", [
    # torchrun's own traceback, cut: the rank's exit stays the reading
    ("comm-root-exit1-rank5-1", "process/exit"),
    ("proc-segv-ucx-caught-signal-torchrun-ace-346-1", "process/exit"),
    # torchelastic's agent interrupted (SignalException frame innermost, cut)
    ("proc-terminated-ctrl-c-sigint-agent-f5-tts-728-1", "process/terminated"),
])
def test_a_launchers_cut_traceback_leaves_the_launcher_reading(case: str, kind: str) -> None:
    assert shown(imported(WILD / case / "log.txt"))[:1] == [kind]


def test_runpy_frames_alone_are_not_an_exception(tmp_path: Path) -> None:
    path = pasted(tmp_path, ["Traceback (most recent call last):",
                             '  File "/usr/lib/python3.10/runpy.py", line 196, in _run_module_as_main',
                             "    return _run_code(code, main_globals, None,",
                             '  File "/usr/lib/python3.10/runpy.py", line 86, in _run_code',
                             "    exec(code, run_globals)"])
    assert shown(imported(path)) == []


def test_a_recognised_line_before_the_cut_traceback_keeps_the_reading_alone(tmp_path: Path) -> None:
    lines = lines_of("proc-exception-nnunet-compile-epoch-600-flush-left-frames-cut-triton-3708-1")
    path = pasted(tmp_path, ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", *lines])
    assert shown(imported(path)) == ["memory/oom"]


def test_a_live_tail_does_not_read_a_flushed_traceback_as_an_exception() -> None:
    segmenter = LogSegmenter(0)  # the agent's: not headless
    text = ["Traceback (most recent call last):", '  File "/app/train.py", line 10, in <module>',
            "    main()", '  File "/app/train.py", line 7, in main']
    for number, line in enumerate(text, 1):
        segmenter.feed(number, clean_line(line), None)
    assert [item.kind for item in segmenter.flush()] == ["log"] * len(text)


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir() if p.is_dir()))
def test_healthy_paste_opens_nothing(case: str) -> None:
    """tests/fixtures/healthy47: five real pastes of runs that were training (fairseq epoch lines with
    oom=0 and loss_scale, LLaMA2-Accessory epoch lines with checkpoint saves, TFTrainer INFO dict lines,
    RADIANT Train Epoch + grad_norm lines, Alpaca HF dict lines; each source.txt cites its thread)."""
    assert (HEALTHY / case / "source.txt").read_text(encoding="utf-8").startswith("URL: https://github.com/")
    assert shown(imported(HEALTHY / case / "log.txt")) == []


def test_a_healthy_paste_ending_in_a_warnings_stack_stays_quiet(tmp_path: Path) -> None:
    """A healthy run's log with a stack printed by a warning in the middle (not at the end) opens nothing."""
    lines = lines_of("../healthy47/tftrainer-info-dict-lines-loss-falling-transformers-9613-1")
    path = pasted(tmp_path, [*lines[:4], '  File "/app/train.py", line 10, in <module>', "    main()", *lines[4:]])
    assert shown(imported(path)) == []
