"""The wild-log corpus as the classifier's regression suite (issue 17): real logs users pasted in public
issue threads (``tests/fixtures/wild/<id>/``: the log, its ``source.txt`` and ``label.json``), each imported
with ``trainguard replay``'s defaults into a data directory (the gateway, processor and pipeline of
``trainguard serve``, in process).

* every label follows the schema and names catalogue kinds, every case has its source;
* the product's verdict on every log is the one recorded in ``verdicts.json`` (a regression baseline,
  right or wrong: a deliberate change re-records it with ``python bench/logs.py --record`` and the diff
  shows which logs moved);
* floors on the figures, per part (tune / held out), at what the recorded verdicts score.

``bench/logs.py`` prints the full table through ``trainguard serve`` and the replay CLI.
"""

from __future__ import annotations

import json
from typing import Dict, List

import pytest

from bench.wild import corpus, judge

CASES = corpus.load(kinds=corpus.catalogue_kinds())
RECORDED: Dict[str, judge.Verdict] = {
    k: judge.Verdict.from_dict(v)
    for k, v in json.loads((corpus.WILD / "verdicts.json").read_text(encoding="utf-8")).items()}
FLOORS = {"tune": {"category": 0.951, "subtype": 0.929}, "heldout": {"category": 0.870, "subtype": 0.829}}
"""Right category / subtype, anomalous logs, at least (the recorded verdicts' figures, rounded down). Lowered
once when the corpus grew from 206 to 240 logs (those 34 new logs were labelled and recorded before any
change to the classifier, so they scored what it did on logs it had never seen), raised with each
classifier change since; the held-out floor down by a point again at 255 -> 260 logs (a new held-out log,
recorded before any change made for it, is missed: 51/66). Lowered again at 260 -> 301 logs: 41 new logs
(16 held out, 25 tuned) labelled from their threads and recorded before any classifier change made for them
(tuned 196/219 and 189/219, held out 62/82 and 59/82); raised with the launcher-line, mismatch and reader
changes that followed (made on tuned misses only) to what they hold: tuned 201/219 and 195/219, held out
65/82 and 62/82; the loss-scale collapse rule (reductions in a row, made on tuned logs only): tuned 203/219
and 197/219, held out unchanged; fairseq's minimum-loss-scale failure known by its split message and its
``FloatingPointError: Minimum loss`` line (made on a tuned log only): tuned 204/219 and 198/219, held out
unchanged; NCCL's proxy ``Failed to execute operation Init from rank N`` is comm/init-failure (a tuned log):
tuned 204/219 and 199/219, held out unchanged; the reader keeps an NCCL error message with its ``Last error:``
line (a tuned log): tuned 204/219 and 200/219, held out unchanged. At 301 -> 351 logs: 50 new logs (16 held
out, 34 tuned) labelled from their threads and recorded before any classifier change made for them: tuned
233/253 and 229/253 (the tuned floors down a point), held out 81/98 and 77/98 (the held-out floors up to
what the enlarged held-out part scores). Then, from tuned misses only: NCCL's bootstrap bind failure, its
buffer OOM and a ``Duplicate GPU detected`` line of its own, an IB completion error as a lost peer, a NaN in a
progress-table row, a NaN loss after an open fp16 scale collapse as its consequence: tuned 238/253 and
236/253, held out 83/98 and 79/98. At 351 -> 362 logs (11 more, recorded before any change: 9 tuned, 2 held
out, none missed): tuned 247/262 and 245/262, held out 85/100 and 81/100; an exception's frames read by the
pipeline: held out 86/100 and 82/100. At 362 -> 370 logs (8 more comm/timeout and process/exit logs, recorded
before any change: 6 tuned, 2 held out, both right): tuned 252/268 and 250/268, held out 88/102 and 84/102;
then, from tuned misses only, the heartbeat monitor's stuck-watchdog line and a lost rank's own signal exit
leading its peer's connection-closed report: tuned 254/268 and 252/268, held out unchanged.
Lowered again at 370 -> 393 logs (issue 17, third pass): 23 new logs (5 held out) labelled from their threads
and recorded before any change (tuned 270/286 and 266/286, held out 91/107 and 87/107); the torchrun
summary-without-root rule (a tuned log) then: tuned 270/286 and 267/286, held out unchanged.
Lowered again at 395 -> 443 logs (issue 17, stop 30): 48 new logs (14 held out) labelled from their threads
and recorded before any change (tuned 297/321 and 292/321, held out 101/122 and 96/122 -- the held-out floors
were set by a script from those verdicts and read only at the end of the pass, bench/results/logs_issue17_stop30.txt). Then, from tuned
misses only: an exception line wrapped in markdown read as that exception, a retyped ``cuda error:<reason>``,
mp.spawn's ``terminated with exit code N`` as that rank's exit: tuned 300/321 and 296/321; a traceback cut
inside process-group set-up frames kept as one item (and torchelastic's ``_create_tcp_store`` a set-up
function): tuned 302/321 and 298/321; held out at the end 101/122 and 97/122 (the old 108 unchanged at 92 and
88).
Lowered again at 443 -> 490 logs (issue 17, stop 31): 47 new logs (10 held out), mostly the numeric families
(fp16 overflow / loss-scale lines of DeepSpeed, apex, fairseq, ColossalAI; NaN losses and NaN gradient norms of
HF, ESPnet, mmdet, Megatron; anomaly-mode backward NaNs) and torchrun exits, labelled from their threads and
recorded before any classifier change (tuned 329/358 and 325/358; the held-out floors set by a script from the
recorded verdicts without printing them, bench/results/logs_issue17_stop31.txt). Then, from tuned misses only:
a NaN loss on the line of a NaN grad norm is the loss, Megatron's forward-loss NaN check and a loop's
``outputs is NaN`` guard are the loss, anomaly mode's warning alone is the backward NaN, more overflow
wordings, a printed loss scale of 1 is no overflow: tuned 332/358 and 328/358 (floors raised by script only).
Stop 32, from tuned misses only: an fp16 overflow line that is no collapse opens an info-severity notice
(``amp_text_overflow_notice``; overflow lines naming no scale read too): tuned 342/358 and 338/358, held out
116/132 and 111/132 (aggregate read once); the NCCL watchdog's timeout stack without its message
(``WorkNCCL::checkTimeout`` frames) is a collective timeout naming no rank: tuned 343/358 and 339/358, held out
117/132 and 112/132 (floors raised by script only). At 490 -> 511 logs (stop 32): 21 new logs (4 held out),
labelled from their threads and recorded before any classifier change made for them: tuned 356/375 and 352/375
(the tuned floors down a point: the new tuned logs score 13/17), held out 120/136 and 115/136. Then, from tuned
misses only: a SIGBUS death reported in text is process/exit, gloo's 'Application timeout caused pair closure',
a quoted NaN loss, an IDE's 'exit code 139 (interrupted by signal 11: SIGSEGV)': tuned 360/375 and 356/375,
held out 121/136 and 116/136. A c10 stack alone raised in libc10_cuda, ProcessGroupNCCL's other timeout lines
alone, a shell's 'Bus error (core dumped)': tuned 361/375 and 357/375, held out unchanged.
At 511 -> 544 logs (stop 33): 33 new logs (9 held out; comm/timeout, process/exit, memory/cuda-error pastes)
labelled from their threads before being classified, recorded together with four changes made on tuned misses
(the old launcher's ``returned non-zero exit status`` by ``--local_rank``, an extension's ``CUDA Runtime
Error:``, the ``[rankN]:`` prefix over a sub-group's ``[PG ... Rank M]`` tag, several ranks aborted together
read as the watchdogs' teardown -- with that label convention applied to one tuned and one held-out label):
tuned 384/399 and 380/399, held out 128/145 and 123/145 (the held-out subtype floor down a point). At 544 ->
553 logs: 9 new logs (4 held out; watchdog timeouts wrapped at a fixed width, glued to tqdm, Ray- and
time-prefixed, elided; shells' SIGFPE reports) labelled before being classified, recorded with two changes
made on tuned misses (bash's ``Floating point exception(core dumped)`` and zsh's lower-case ``20121 floating
point exception (core dumped)``; DeepSpeed's ``OVERFLOW! Rank 0 Skipping step.`` wrapped before its scale):
tuned 390/404 and 386/404, held out 131/149 and 126/149 (the held-out category floor down a point). At 553 ->
559 logs: 6 new shell SIGILL / SIGBUS reports (4 held out) labelled before being classified, recorded with a
shell's ``... (core dumped)`` report read anywhere in a line (a tuned log quoting it mid-sentence): tuned
392/406 and 388/406, held out 135/153 and 130/153. At 559 -> 569 logs: 10 new CUDA-error logs (illegal
instruction, illegal access, no kernel image; 5 held out) labelled before being classified and recorded with no
classifier change (the 5 tuned ones were all right): tuned 397/411 and 393/411, held out 138/158 and
133/158. At 569 -> 571 logs: two fairseq minimum-loss-scale quotes (1 held out), no classifier change: tuned
398/412 and 394/412, held out 139/159 and 134/159. Stop 34: one rank's bare SIGABRT relabelled comm/timeout by
rule (7 labels, 2 held out) with aborts_together_timeout_ranks 1: tuned 400/412 and 396/412, held out 143/159
and 138/159. 571 -> 627 logs in five batches (56 new, 19 held out), each labelled from its thread and
recorded before any change made for it, and five changes made on tuned misses only (a watchdog message without
its start, device-side asserts wrapped / with a legacy signature / no kernel name, a failure entry without its
summary header, a numbered ``NCCL Error N``, more OOM wordings and Slurm's ``CANCELLED AT``): tuned 436/449 and
432/449, held out 159/178 and 152/178 (floors set by script from these figures, rounded down).
Lowered again at 631 -> 663 logs (stop 35): 32 new logs (12 held out) from classes thin in the corpus -- ROCm/HIP
errors (invalid device function, HSA memory access faults, hipErrorLaunchFailure, ROCm device-side assertions),
collective mismatch reports, TensorPipe RPC resets / EOFs, gloo connect failures -- labelled from their threads
and recorded before any classifier change: tuned 452/472 and 448/472 (the 20 new tuned logs 13/20), held out
166/191 and 159/191 (floors rounded down from these). Then, from tuned misses only: a kernel fault as ROCm
prints it (HIP's device-side assertion, the HSA memory access fault, a queue aborted with HSA_STATUS_ERROR_*):
tuned 456/472 and 452/472, held out 168/191 and 161/191; TensorPipe's RPC agent errors (a refused
connection or a failed first request #0 an init failure, a later EOF / reset a lost peer): tuned 459/472 and
455/472, held out 170/191 and 163/191. At 663 -> 676 logs: 13 new logs (3 held out; HIP / TF-ROCm OOMs,
Xid 31/43 dmesg blocks, a watchdog thread's illegal access, group-creation timeouts, a DeepSpeed exit line)
labelled before being classified and recorded with no classifier change: tuned 467/482 and 463/482 (the tuned
category floor down a point), held out 173/194 and 166/194; ROCm's out-of-memory statuses
(``HIP_ERROR_OutOfMemory``, ``hipErrorOutOfMemory``) read as CUDA's: tuned 468/482 and 464/482, held out
unchanged. Stop 36, from tuned pastes only: a launcher's exit line for a rank, then that rank's own error text,
is the error's consequence (and DeepSpeed's ``Killing subprocess`` teardown a process/exit naming no rank), and
a torchrun entry's ``traceback :`` field is that rank's traceback: tuned 470/482 and 466/482, held out
unchanged. At 676 -> 698 logs: 22 new logs (3 held out; launcher summaries beside or without a worker's cause,
DeepSpeed teardowns, gloo peer closures and barrier timeouts, store-barrier init failures, illegal accesses in
Ray / FSDP workers, fairseq's minimum loss scale, an exploding gradient norm) labelled before being classified
and recorded with no classifier change: tuned 487/501 and 479/501 (the tuned subtype floor down a point: the 19
new tuned logs 13/19), held out 176/197 and 169/197. A flush-left frame's flush-left code line read as its
code line (pytorch/gloo#148): tuned 488/501 and 480/501, held out unchanged. At 698 -> 703 logs: 5 new logs
(2 held out; NCCL's unhandled CUDA errors, gloo connectFullMesh failures in init, DeepSpeed's loss-scale
minimum) labelled before being classified, no classifier change: tuned 490/504 and 482/504 (new tuned 2/3),
held out 178/199 and 171/199. At 703 -> 720 logs (stop 37): 17 new logs (5 held out by the hash split; CUDA
errors from watchdogs, Ray workers and terminate lines, segfault exits, a quoted watchdog timeout) labelled
before being classified and recorded with no classifier change: tuned 503/516 and 495/516 (new tuned 12/12),
held out 182/204 and 175/204 (floors unchanged). At 720 -> 740 logs (stop 38): 20 new logs (5 held out by the
hash split; NCCL's own 'Cuda failure 700' WARN lines, cuDNN / Paddle cuDNN failures, ECC aborts, collective
mismatches printed by user code, NCCL internal errors under Ray / [rankN] prefixes, a store connect timeout in a
rendezvous test, DataLoader bus errors, a PyCharm-style segfault exit) labelled before being classified and
recorded with no classifier change: tuned 516/531 and 508/531 (new tuned 13/15), held out 186/209 and 178/209
(the held-out category floor down a point: 0.8899). Then, from tuned misses and stress variants: NCCL's numbered
'Cuda failure N', a status-only IDE segfault line, a wrap after a space in a screen-padded paste, a torchrun
summary without its ChildFailedError line read whole: tuned 518/531 and 510/531, held out unchanged. At 740 ->
751 logs: 11 new logs (1 held out; Duplicate GPU invalid-usage errors, illegal instructions from TRT-LLM,
Fooocus and Darknet, DeepSpeed's cuBLAS 'kernel execution error' lines, NCCL unhandled CUDA errors in NVLS
init, old 'NCCL Error 1' and CI-stamped aborts) labelled before being classified and recorded with no
classifier change: tuned 525/541 and 513/541 (new tuned 7/10 category; the tuned subtype floor down a point),
held out 187/210 and 179/210. Then NCCL invalid-usage / old-wording / CI-stamp / DeepSpeed cuBLAS families: tuned
528/541 and 520/541, held out 188/210 and 180/210. At 751 -> 760 logs: 9 new logs (5 held out; SIGBUS exits
from torchrun and accelerate's relay, a summary cut inside its root cause, index_select device-side asserts
plain / with THC's C++ signature / blank-line separated / interleaved mid-line, shell segfault reports)
labelled before being classified and recorded with no classifier change: tuned 531/545 and 523/545 (new tuned
3/4), held out 193/215 and 185/215. Stop 39: the same-moment rule (correlate rule 9) moved no verdict. At 760 ->
782 logs: 22 new logs (7 held out; Caffe / Caffe2 / CNTK / DIGITS CUDA and cuDNN failures, THC launch failures,
thrust cudaErrorIllegalAddress typed with spaces, in backticks or in Chinese prose, SIGSEGV exits from the
elastic agent and DeepSpeed's teardown, SIGFPE shell reports, DataLoader bus errors split over lines, listed in
a sentence or from Paddle) labelled before being classified and recorded with no classifier change: tuned
542/560 and 534/560 (new tuned 10/15; the tuned category floor down a point: 0.9679), held out 199/222 and
191/222. At 1060 -> 1087 logs (stop 45, hL, fresh batch 8: 27 new logs, 7 held out, labelled before being
classified, 5f92fbb): tuned 740/771 (0.9598; the tuned category floor down to 0.959: the new tuned logs score
19/20 but the floor sat at the older figure's edge) and 721/771 subtype (0.9352: the new tuned logs 15/20);
after this stop's tuned-side change 740/771 and 722/771 (the tuned subtype floor down to 0.936), held out
281/316 and 269/316 before and after it. At 1087 -> 1112 logs (stop 46, hL, fresh batch 9: 25 new logs, 5 held
out, labelled before being classified, aa50343; JAX, Composer, Megatron, ColossalAI, Horovod, Ray, inductor,
PEFT, Slurm stacks on purpose): the new tuned logs scored 10/20 at their first measurement (tuned 751/791 and
733/791); after this stop's first tuned-side change (Composer's launcher lines) 753/791 = 0.9519 and 735/791 =
0.9292 -- the tuned floors down to 0.951 and 0.929 (the older 771 tuned logs unchanged: the drop is the new
batch's unread stacks, not a regression); held out 285/321 and 273/321 before and after it. At 1137 -> 1167
logs (stop 47, hL2, fresh batch 11: 30 new logs, 14 held out, labelled before being classified, c35c7e9;
ROCm, Habana, Horovod/mpirun, Ray, JAX/TPU, SageMaker, caffe2 stacks on purpose): held out 306/345 and 293/345
= 0.8493 (the 14 new held-out logs 11/14 and 10/14; the 331 older ones unchanged at 295/331 and 283/331) --
the held-out subtype floor down to 0.849; the tuned-side changes that followed (mpirun with a redacted PID,
absl's signal-handler forms, old gloo's pair ``Connect timeout``) left the held-out figures where they were
(tuned 785 -> 788/822 and 767 -> 770/822). At 1298 -> 1325 logs (stop 50, hL8, fresh batch 17: 27 new logs, 13
held out, labelled before being classified, c723b30c; TensorFlow collectives, AWS Neuron, Megatron, Caffe, Keras,
JAX/T5X, DeepSpeed, Slurm stacks on purpose): held out 348/397 = 0.8766 and 333/397 = 0.8388 (the 13 new
held-out logs 6/13 and 5/13 at their first measurement; the 384 older ones unchanged at 342/384 and 328/384) --
the held-out floors down to 0.876 and 0.838; the tuned-side change that followed (TensorFlow's collective
``Shape mismatch in the collective instance N`` as comm/mismatch) left the held-out figures where they were
(tuned 885 -> 886/928 and 861 -> 863/928). At 1325 -> 1351 logs (stop 50, hL9, fresh batch 18: 26 new logs, 13
held out, labelled before being classified, e9d34ef0; JAX, Composer, Horovod, Ray/verl, DeepSpeed checkpoint
resumes, bitsandbytes, Caffe, NCCL Cuda failure 802 and process/terminated shapes on purpose): held out 357/410 =
0.8707 and 340/410 = 0.8293 (the 13 new held-out logs 9/13 and 7/13 at their first measurement; the 397 older
ones unchanged at 348/397 and 333/397) -- the held-out floors down to 0.870 and 0.829; no classifier change
followed (the batch's one tuned miss is a loss series, which the replay path reads line by line); tuned
898/941 = 0.9543 and 875/941 = 0.9299, the tuned floors unchanged."""


def test_the_corpus_is_large_labelled_and_sourced() -> None:
    """A log may be one line: users paste a bare error line alone (the issue's "error lines with no
    traceback around them"), often inside a sentence; what it must be is not empty."""
    assert len(CASES) >= 150
    assert {c.case_id for c in CASES} == set(RECORDED), "re-record: python bench/logs.py --record"
    parts = [c.part for c in CASES]
    assert parts.count("heldout") >= len(CASES) // 5
    for case in CASES:
        source = (case.path / "source.txt").read_text(encoding="utf-8")
        assert "github.com/" in source or "http" in source, case.case_id
        assert case.lines() >= 1 and case.log.read_text(encoding="utf-8").strip(), case.case_id
    categories = {c.label.category for c in CASES}
    assert {"comm", "memory", "process", "loss", "gradient"} <= categories


def test_a_label_names_its_field_when_it_is_wrong() -> None:
    good = {"kind": "comm/timeout", "category": "comm", "culprit_rank": None, "multi_rank": True,
            "consequences": [], "uncertain": False, "framework": "pytorch", "torch_version": None}
    assert corpus.parse_label(good, "x").kind == "comm/timeout"
    for field, bad, said in (("kind", "comm/slow", "'comm/slow' is not a catalogue kind"),
                             ("category", "memory", "category"), ("culprit_rank", -1, "culprit_rank"),
                             ("framework", "jax", "framework"), ("consequences", ["nope"], "'nope'")):
        with pytest.raises(corpus.LabelError, match=said):
            corpus.parse_label(dict(good, **{field: bad}), "x", corpus.catalogue_kinds())


@pytest.fixture(scope="module")
def verdicts() -> Dict[str, judge.Verdict]:
    """Every log imported as its own run through one in-process backend (``judge.replay_all``: one data
    directory and processor for the corpus instead of one per log -- the per-log test costs a few ms);
    ``test_one_log_alone_gets_the_same_verdict`` keeps the one-backend-per-log path honest."""
    return judge.replay_all(CASES)


def test_one_log_alone_gets_the_same_verdict(verdicts: Dict[str, judge.Verdict]) -> None:
    # a few tuned logs of different kinds through their own backend, as `trainguard replay` imports one log
    for case in [c for c in CASES if c.part == "tune"][::97]:
        assert judge.replay_local(case) == verdicts[case.case_id] == RECORDED[case.case_id], case.case_id


@pytest.mark.parametrize("case_id", [c.case_id for c in CASES])
def test_verdict_is_the_recorded_one(case_id: str, verdicts: Dict[str, judge.Verdict]) -> None:
    assert verdicts[case_id] == RECORDED[case_id]


def test_the_figures_hold_their_floors(verdicts: Dict[str, judge.Verdict]) -> None:
    scores: List[judge.Score] = [judge.score(c, verdicts[c.case_id]) for c in CASES]
    for part, floors in FLOORS.items():
        mine = [s for s in scores if s.part == part]
        assert sum(s.category for s in mine) / len(mine) >= floors["category"], part
        assert sum(s.subtype for s in mine) / len(mine) >= floors["subtype"], part
