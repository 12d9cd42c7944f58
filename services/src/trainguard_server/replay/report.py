"""What ``trainguard replay`` shows: a progress line on stderr while importing, then the summary and the run's
status and incidents on stdout.

:class:`Progress` redraws one line (``\\r``) at most every ``interval`` s when its stream is a terminal, and
prints a plain line every ``plain_every`` s otherwise (logs of CI jobs); ``enabled=False`` silences it.
"""

from __future__ import annotations

import time
from typing import IO, Any, Callable, Dict, List, Optional, TextIO

from .importer import ReplaySummary


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


class Progress:
    """Bytes of the input files read (logs twice: a quick scan for timestamps, then the import) and
    events sent, as a percentage and a rate."""

    def __init__(self, stream: TextIO, *, enabled: bool = True, interval: float = 0.2,
                 plain_every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval = interval if self.tty else plain_every
        self.clock = clock
        self.total = 0
        self.done = 0
        self.events = 0
        self._started = self._last = clock()
        self._drawn = False

    def start(self, total_bytes: int) -> None:
        self.total = max(0, total_bytes)
        self._started = self._last = self.clock()

    def add_bytes(self, n: int) -> None:
        """Record ``n`` more bytes read; redraw when due."""
        self.done += n
        self._tick()

    def update(self, events: int) -> None:
        """Record ``events`` sent so far; redraw when due."""
        self.events = events
        self._tick()

    def _tick(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def _line(self, now: float) -> str:
        elapsed = max(1e-9, now - self._started)
        share = 100.0 * self.done / self.total if self.total else 100.0
        return (f"replay: {share:5.1f}% of {_size(self.total)} read, {self.events:,} events sent "
                f"({self.events / elapsed:,.0f} events/s, {elapsed:.0f} s)")

    def _draw(self, now: float) -> None:
        if self.tty:
            self.stream.write("\r" + self._line(now) + "\x1b[K")
            self._drawn = True
        else:
            self.stream.write(self._line(now) + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r" + self._line(self.clock()) + "\x1b[K\n")
            self.stream.flush()


def print_summary(summary: ReplaySummary, out: IO[str]) -> None:
    """The import summary: per file what was read and skipped, then what the backend answered."""
    w = out.write
    w(f"replay of run {summary.run_id} into {summary.backend} ({summary.elapsed_s:.1f} s)\n")
    for src in summary.sources:
        w(f"  {src.kind} {src.path} (rank {src.rank}): {src.describe()}\n")
        for line, reason in src.malformed_lines:
            w(f"    line {line}: {reason}\n")
        if src.malformed > len(src.malformed_lines):
            w(f"    ... {src.malformed - len(src.malformed_lines)} more malformed lines\n")
    if summary.time_note:
        w(f"  times: {summary.time_note}\n")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(summary.built.items()))
    w(f"  events: {summary.sent} sent ({kinds or 'none'}), {summary.accepted} accepted, "
      f"{summary.duplicates} duplicates, {sum(summary.rejected.values())} rejected\n")
    for code, n in sorted(summary.rejected.items()):
        why = ""
        if code == "out_of_range":
            why = (" (older than the backend's max past age: the files span more than its window, see times)"
                   if summary.too_old_expected else " (outside the backend's time window)")
        w(f"    rejected {code}: {n}{why}\n")
    for sample in summary.rejected_samples:
        w(f"      {sample}\n")
    if summary.exits:
        said = ", ".join(f"rank {r}: {code}{' (inferred)' if inferred else ''}"
                         for r, (code, inferred) in sorted(summary.exits.items()))
        w(f"  exit codes: {said}\n")
    if summary.error:
        w(f"  ERROR: {summary.error}\n")


def _origins(incident: Dict[str, Any], origins: Dict[str, str], most: int = 8) -> str:
    """``train.log:12, 40, 41`` -- the imported lines among an incident's evidence, by file."""
    by_file: Dict[str, List[int]] = {}
    for evidence in incident.get("evidence", []):
        where = origins.get(str(evidence.get("event_id", "")))
        if where:
            name, _, line = where.rpartition(":")
            by_file.setdefault(name, []).append(int(line))
    said = []
    for name, lines in by_file.items():
        shown = sorted(set(lines))
        said.append(f"{name}:" + ", ".join(map(str, shown[:most])) + (" ..." if len(shown) > most else ""))
    return "; ".join(said)


def print_status(run: Optional[Dict[str, Any]], incidents: List[Dict[str, Any]], out: IO[str], *,
                 complete: bool = True, origins: Optional[Dict[str, str]] = None) -> None:
    """The run's status and its incidents, most severe first (what to look at); ``origins`` (event id ->
    ``file:line``, :attr:`ReplaySummary.origins`): the lines each incident came from."""
    w = out.write
    if run is None:
        w("backend: the run is not visible (yet)\n")
        return
    codes = ", ".join(f"rank {r}: {c}" for r, c in sorted(run.get("exit_codes", {}).items(),
                                                           key=lambda kv: int(kv[0])))
    w(f"run {run['run_id']} ({run.get('run_name') or '-'}): status {run.get('status')}, health "
      f"{run.get('health')}, last step {run.get('last_step')}, ranks {run.get('ranks')}"
      + (f", exit codes {codes}" if codes else "") + ("" if complete else " (still processing)") + "\n")
    if not incidents:
        w("  no incidents\n")
    order = {"critical": 0, "error": 1, "warning": 2, "info": 3}
    for inc in sorted(incidents, key=lambda i: (order.get(i.get("severity", ""), 9), i.get("first_ns", 0))):
        w(f"  {str(inc.get('severity', '')).upper()} {inc['category']}/{inc['subtype']} from step "
          f"{inc.get('first_step')} (rank {inc.get('lead_rank')}): {inc.get('title', '')}\n")
        if inc.get("fingerprint"):
            w(f"    fingerprint {inc['fingerprint']}\n")
        lines = _origins(inc, origins or {})
        if lines:
            w(f"    from {lines}\n")
        for check in list(inc.get("checks", []))[:3]:
            w(f"    check: {check}\n")
