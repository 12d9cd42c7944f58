"""security.md H42 (stop 44): ``trainguard serve`` gives freed heap memory back to the OS after a burst.

An HTTP/2 flood of 800 KB header blocks on the gRPC port left the server at ~1.1 GB resident for the rest of
its life though nothing held that memory (glibc keeps what was freed; ``malloc_trim(0)`` gave back all but
~250 MB). :class:`MemoryTrim` checks every ``memory_trim_interval_s`` and trims when the resident size grew by
``memory_trim_min_growth_mb`` since the last give-back. Clock, resident size and the trim are injected: no
duration is asserted."""

from __future__ import annotations

from pathlib import Path
from typing import List

from trainguard_server.memory_trim import MemoryTrim, resident_bytes

MiB = 2**20


class _Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.rss = 100 * MiB
        self.trims: List[float] = []

    def trim(self) -> int:
        self.trims.append(self.now)
        self.rss = 120 * MiB  # what the allocator gave back leaves this much
        return 1


def test_a_burst_is_given_back_once_the_check_is_due_and_growth_passes_the_bound() -> None:
    fake = _Fake()
    trim = MemoryTrim(30.0, 64 * MiB, rss=lambda: fake.rss, trim=fake.trim, clock=lambda: fake.now)
    fake.rss = 900 * MiB  # the burst
    fake.now = 10.0
    assert trim.tick() is None and fake.trims == []  # not due yet
    fake.now = 30.0
    assert trim.tick() == (900 * MiB, 120 * MiB, 0.0)
    assert fake.trims == [30.0] and trim.base == 120 * MiB
    fake.rss = 150 * MiB  # +30 MiB since: under the bound
    fake.now = 60.0
    assert trim.tick() is None and fake.trims == [30.0]
    fake.rss = 200 * MiB  # +80 MiB since the last give-back
    fake.now = 90.0
    assert trim.tick() is not None and fake.trims == [30.0, 90.0]


def test_memory_that_went_back_on_its_own_lowers_the_base() -> None:
    fake = _Fake()
    fake.rss = 500 * MiB
    trim = MemoryTrim(30.0, 64 * MiB, rss=lambda: fake.rss, trim=fake.trim, clock=lambda: fake.now)
    fake.rss = 200 * MiB
    fake.now = 30.0
    assert trim.tick() is None and trim.base == 200 * MiB
    fake.rss = 300 * MiB  # +100 MiB from the lower base
    fake.now = 60.0
    assert trim.tick() is not None


def test_off_with_interval_zero_and_a_failing_trim_turns_it_off() -> None:
    fake = _Fake()
    off = MemoryTrim(0.0, 64 * MiB, rss=lambda: fake.rss, trim=fake.trim, clock=lambda: fake.now)
    fake.rss, fake.now = 900 * MiB, 1000.0
    assert not off.enabled and off.tick() is None and fake.trims == []

    def broken() -> int:
        raise OSError("no")

    failing = MemoryTrim(1.0, MiB, rss=lambda: fake.rss, trim=broken, clock=lambda: fake.now)
    fake.rss, fake.now = 2000 * MiB, 2000.0
    assert failing.tick() is None and not failing.enabled


def test_the_real_trim_runs_in_this_process() -> None:
    """glibc's malloc_trim through ctypes, and /proc/self/statm (the CI machine is Linux with glibc)."""
    clock = [0.0]
    trim = MemoryTrim(1.0, 1, clock=lambda: clock[0])
    assert trim.enabled and resident_bytes() > 0
    junk = [bytearray(4096) for _ in range(20_000)]  # ~80 MiB of small blocks, then freed
    del junk
    trim.base = 0  # whatever the allocator kept: the growth bound is passed
    clock[0] = 1.0
    done = trim.tick()
    assert done is not None and trim.trims == 1


def test_serve_builds_it_from_the_settings(tmp_path: Path) -> None:
    from trainguard_server.config import Settings
    from trainguard_server.server import EmbeddedServer

    server = EmbeddedServer(Settings(data_dir=str(tmp_path)))
    trim = server.memory_trim()
    assert trim.interval_s == 30.0 and trim.min_growth_bytes == 64 * MiB
    off = EmbeddedServer(Settings(data_dir=str(tmp_path), memory_trim_interval_s=0,
                                  memory_trim_min_growth_mb=8)).memory_trim()
    assert not off.enabled and off.min_growth_bytes == 8 * MiB
