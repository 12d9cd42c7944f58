"""Ray's coloured worker prefix pasted without its escape bytes (``[36m(WorkerDict pid=..., ip=...)[0m``):
the reader drops the colour residue of that shape only, so the line reads as the worker's line it is.
``mem-illegal-address-title-fatal-aborted-ray-verl-184-1`` (tuned; verl-project/verl#184, added by 6325b8f)
has a Ray worker's ``Fatal Python error: Aborted`` under such a prefix: before, the residue hid the line
start that faulthandler's report needs and the paste read as nothing."""

from __future__ import annotations

import pytest

from trainguard_server.replay.logs import clean_line

from .local_import import WILD, imported, shown

CASE = "mem-illegal-address-title-fatal-aborted-ray-verl-184-1"


@pytest.mark.parametrize("raw, clean", [
    ("[36m(WorkerDict pid=3175143, ip=10.49.193.113)[0m Fatal Python error: Aborted",
     "(WorkerDict pid=3175143, ip=10.49.193.113) Fatal Python error: Aborted"),
    ("[36m(WorkerDict pid=3175143, ip=10.49.193.113)[0m", "(WorkerDict pid=3175143, ip=10.49.193.113)"),
    # SYNTHETIC: a bold colour, and the real escape bytes (removed as before)
    ("[1;36m(pid=12) [rank3]: x", "[1;36m(pid=12) [rank3]: x"),  # no closing [0m: not Ray's shape, kept
    ("[1;36m(pid=12)[0m [rank3]: x", "(pid=12) [rank3]: x"),
    ("\x1b[36m(pid=12)\x1b[0m x", "(pid=12) x"),
    # SYNTHETIC: other bracketed text stays
    ("elapsed [10m(5s)] x", "elapsed [10m(5s)] x"),
    ("[rank0]: Traceback (most recent call last):", "[rank0]: Traceback (most recent call last):"),
])
def test_only_rays_prefix_loses_its_colour_residue(raw: str, clean: str) -> None:
    assert clean_line(raw) == clean


def test_the_workers_fatal_error_under_a_residue_prefix_is_read() -> None:
    kinds = shown(imported(WILD / CASE / "log.txt"))
    assert kinds and kinds[0].startswith("memory/")
