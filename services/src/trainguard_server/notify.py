"""Webhook notifications of new incidents (Slack-compatible JSON), de-duplicated and rate-limited.

Contract of :class:`WebhookNotifier` (a processor listener: ``processor.listeners.append(notifier)``):

* **What is sent**: an incident the first time it is seen at or above ``min_severity`` (warning < error <
  critical), not explained by another (a consequence folded into its cause is not news), as
  ``{"text": ...}`` -- what Slack's and Mattermost's incoming webhooks take -- naming the severity, the kind,
  the title, the run, where it started (rank, step) and a link to its dashboard page when ``dashboard_url``
  is set.
* **Once per incident**: the ids sent are remembered (:data:`REMEMBERED`, shared fairly: past it the
  project remembered most forgets its oldest, never another project's -- security.md H52) and, with
  ``state`` (the incident store), saved so that a restart -- which re-emits the incidents it restores --
  sends nothing twice.
* **Rate limit**: at most ``max_per_minute`` messages in any minute; what exceeds it is counted and sent as
  one summary ("N more incidents ...", by project) when the minute allows again. Nothing is dropped
  silently. **Shared fairly** between projects (security.md H51): the next message is the oldest of the
  project with the fewest messages in the last minute, and while the minute is full only the waiting
  incidents of projects that had at least their share of it (``max_per_minute`` over the projects sending or
  waiting) go into the summary -- another project's wait for a free slot (one frees within the minute) and
  are sent on their own, before the summary. Before, every incident queued while the minute was full went into
  the summary, so one project's flood of incidents hid every other project's behind "N more".
* **Never blocks the processor**: the listener only queues, bounded by ``max_queue`` **shared by project**
  (each its share: ``max_queue`` over the projects waiting); a project's incidents past its share -- or, the
  queue full, the newest of the project waiting the most, to make room for a project under its share -- are
  held into the summary, by project, like those over the rate limit. Before (F9 of stop 45) one bound served
  every project and an incident past it was dropped, not even summarised, and already remembered as sent: one
  project's flood during a slow post made another project's incident vanish for good. An id is remembered as
  sent once its incident is queued or held. A daemon thread posts, retrying a failed post ``retries`` times
  with backoff, then counts it failed.
* ``stats`` counts sent / deduplicated / suppressed (held into summaries: over the rate limit or past a
  project's share of the queue) / failed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from trainguard_engine.pipeline import PipelineOutput
from trainguard_engine.quotas import EvictedRuns
from trainguard_engine.records import Incident

from .storage.base import IncidentStore

log = logging.getLogger("trainguard.notify")

SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2, "critical": 3}
STATE_KEY = "notify/webhook-sent"
REMEMBERED = 10_000


@dataclass
class NotifyStats:
    sent: int = 0
    deduplicated: int = 0
    suppressed: int = 0
    failed: int = 0


def _slack_text(value: str) -> str:
    """``value`` shown as text by Slack / Mattermost: ``&``, ``<`` and ``>`` escaped as their formatting rules
    ask. The title and run come from training jobs: unescaped, an exception message ``<!channel>`` paged the
    whole channel and ``<https://x|text>`` showed a link disguised as other text."""
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def message(incident: Incident, dashboard_url: str = "") -> Dict[str, Any]:
    """The Slack-compatible body for one incident (what comes from the job escaped: :func:`_slack_text`)."""
    where = f"rank {incident.lead_rank}, step {incident.first_step}" if incident.first_step >= 0 else \
        f"rank {incident.lead_rank}"
    link = f"\n<{dashboard_url.rstrip('/')}/ui/#/incidents/{incident.incident_id}|open in TrainGuard>" \
        if dashboard_url else ""
    kind = f"{incident.category}/{incident.subtype}"
    run = _slack_text(incident.run_id).replace("`", "'")
    return {"text": f"*[{incident.severity.upper()}] {_slack_text(kind)}* -- {_slack_text(incident.title)}\n"
                    f"run `{run}` ({_slack_text(incident.project or 'default project')}), from {where}{link}"}


class WebhookNotifier:
    """See the module doc."""

    def __init__(self, url: str, *, min_severity: str = "critical", max_per_minute: int = 10,
                 dashboard_url: str = "", state: Optional[IncidentStore] = None, max_queue: int = 1000,
                 retries: int = 3, timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 post: Optional[Callable[[str, bytes, float], None]] = None) -> None:
        if min_severity not in SEVERITY_ORDER:
            raise ValueError(f"min_severity must be one of {', '.join(SEVERITY_ORDER)}")
        if max_per_minute < 1:
            raise ValueError("max_per_minute must be >= 1")
        self.url = url
        self.min_rank = SEVERITY_ORDER[min_severity]
        self.max_per_minute = max_per_minute
        self.dashboard_url = dashboard_url
        self.state = state
        self.retries = retries
        self.timeout_s = timeout_s
        self.clock = clock
        self._post = post or _http_post
        self.stats = NotifyStats()
        #: ``project NUL incident id`` of the incidents sent (the engine's fair bounded memory: before, the
        #: oldest id went whatever its project, so 10,000 of one project's incidents made every other
        #: project's open incidents be posted again at their next update)
        self._legacy_ids: Set[str] = set()
        self._sent_ids = EvictedRuns((key, 0) for key in self._load_sent())
        self._queues: Dict[str, Deque[Dict[str, Any]]] = {}  # project -> its bodies waiting, oldest first
        self._queued = 0
        self._max_queue = max_queue
        #: (send time, project; None: a summary) of the messages sent within the last minute
        self._window: Deque[Tuple[float, Optional[str]]] = deque()
        self._held: Dict[str, int] = {}        # project -> incidents over the limit, not yet summarised
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="trainguard-webhook", daemon=True)
        self._thread.start()

    # --- the processor's side ---------------------------------------------------------------------
    def __call__(self, output: PipelineOutput) -> None:
        fresh = []
        for incident in output.incidents:
            if incident.explained_by or SEVERITY_ORDER.get(incident.severity, 0) < self.min_rank:
                continue
            key = f"{incident.project}\x00{incident.incident_id}"
            if key in self._sent_ids or incident.incident_id in self._legacy_ids:
                self.stats.deduplicated += 1
                continue
            fresh.append((key, incident.project, message(incident, self.dashboard_url)))
        if not fresh:
            return
        with self._cond:
            for key, project, body in fresh:
                if key in self._sent_ids:  # the same incident twice in one output
                    self.stats.deduplicated += 1
                    continue
                self._enqueue(project, body)
                self._sent_ids.put(key, 0, REMEMBERED)  # remembered once queued or held, never before
            self._cond.notify_all()
        self._save_sent()

    def _enqueue(self, project: str, body: Dict[str, Any]) -> None:
        """(Under the lock.) Queue ``body`` within its project's share of ``max_queue`` (``max_queue`` over
        the projects waiting, this one included); past it the incident is held -- counted into the summary, by
        project. When the whole queue is full and this project is under its share, the newest incident of the
        project waiting the most is held instead, to make room. Before (F9 of stop 45), the bound was one for
        all projects and an incident past it was dropped -- neither posted nor summarised -- so during a slow
        post one project's flood made another project's single incident vanish (and, already remembered as
        sent, it was never posted at its next update either)."""
        waiting = self._queues.get(project)
        mine = len(waiting) if waiting else 0
        projects = set(self._queues) | set(self._held) | {project}
        share = max(1, self._max_queue // len(projects))
        if mine < share and self._queued >= self._max_queue and self._queues:
            # the project waiting the most (stable: the first queued wins ties)
            largest = max(self._queues, key=lambda p: len(self._queues[p]))
            if len(self._queues[largest]) > mine:
                self._queues[largest].pop()  # its newest: its older incidents keep their turn
                self._queued -= 1
                self._hold(largest, 1)
                if not self._queues[largest]:
                    del self._queues[largest]
        if mine >= share or self._queued >= self._max_queue:
            self._hold(project, 1)
            return
        self._queues.setdefault(project, deque()).append(body)
        self._queued += 1

    def _hold(self, project: str, n: int) -> None:
        """(Under the lock.) ``n`` of ``project``'s incidents go into the next summary."""
        self._held[project] = self._held.get(project, 0) + n
        self.stats.suppressed += n

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (within ``timeout``), then stop."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # --- the sender thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._held and not self._stop:
                    self._cond.wait(1.0)
                if self._stop and not self._queued and not self._held:
                    return
            now = self.clock()
            while self._window and now - self._window[0][0] >= 60.0:
                self._window.popleft()
            with self._cond:
                sent = self._sent_by_project()
                if len(self._window) >= self.max_per_minute:
                    self._hold_over_share(sent)
                    body, project = None, None
                else:
                    body, project = self._next(sent)
            if body is None:
                if self._stop:
                    return
                time.sleep(0.25)  # over the limit: wait for the minute to allow the next message
                continue
            self._window.append((now, project))
            self._send(body)

    def _sent_by_project(self) -> Dict[str, int]:
        sent: Dict[str, int] = {}
        for _, project in self._window:
            if project is not None:  # a summary's slot is nobody's
                sent[project] = sent.get(project, 0) + 1
        return sent

    def _share(self, sent: Dict[str, int]) -> int:
        """(Under the lock.) The messages a minute one project may take: the limit over the projects that
        sent in the last minute or are waiting (at least 1)."""
        projects = set(sent) | set(self._queues) | set(self._held)
        return max(1, self.max_per_minute // max(1, len(projects)))

    def _hold_over_share(self, sent: Dict[str, int]) -> None:
        """(Under the lock; the minute is full.) The waiting incidents of projects that had their share of
        the minute go into the summary; the others' wait for the next free slot."""
        share = self._share(sent)
        for project in [p for p in self._queues if sent.get(p, 0) >= share]:
            waiting = self._queues.pop(project)
            self._queued -= len(waiting)
            self._hold(project, len(waiting))

    def _next(self, sent: Dict[str, int]) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """(Under the lock; a slot is free.) A waiting incident of a project below its share (the one with
        the fewest messages in the minute; ties: the first queued), else the summary of what was held,
        else the next waiting incident."""
        share = self._share(sent)
        below = [p for p in self._queues if sent.get(p, 0) < share]
        if below or not self._held:
            candidates = below or list(self._queues)
            if not candidates:
                return None, None
            project = min(candidates, key=lambda p: sent.get(p, 0))  # stable: the first queued wins ties
            waiting = self._queues[project]
            body = waiting.popleft()
            self._queued -= 1
            if not waiting:
                del self._queues[project]
            return body, project
        total = sum(self._held.values())
        by = ", ".join(f"{_slack_text(p or 'default project')}: {n}"
                       for p, n in sorted(self._held.items(), key=lambda kv: (-kv[1], kv[0])))
        self._held = {}
        return {"text": f"... and {total} more TrainGuard incident(s) in the last minute (over the limit of "
                        f"{self.max_per_minute} messages/minute; {by}): see the dashboard"}, None

    def _send(self, body: Dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                self._post(self.url, data, self.timeout_s)
                self.stats.sent += 1
                return
            except Exception as exc:
                if attempt == self.retries:
                    self.stats.failed += 1
                    log.warning("webhook post failed after %d tries: %s", attempt + 1, exc)
                    return
                time.sleep(min(5.0, 0.2 * 2 ** attempt))

    # --- remembering what was sent --------------------------------------------------------------
    def _load_sent(self) -> List[str]:
        if self.state is None:
            return []
        blob = self.state.load_state(STATE_KEY)
        try:
            saved = list(json.loads(blob)) if blob else []
        except (ValueError, TypeError):
            return []
        # [project, id] pairs; a bare id (saved before H52) is remembered under no project
        keys = []
        for item in saved[-REMEMBERED:]:
            if isinstance(item, list) and len(item) == 2:
                keys.append(f"{item[0]}\x00{item[1]}")
            elif isinstance(item, str):  # a bare id, saved before H52: its project is not known
                self._legacy_ids.add(item)
        return keys

    def _save_sent(self) -> None:
        if self.state is not None:
            self.state.save_state(STATE_KEY, json.dumps([key.split("\x00", 1) for key, _ in
                                                        self._sent_ids.items()]).encode())


def _http_post(url: str, data: bytes, timeout: float) -> None:
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": "trainguard-webhook"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status >= 300:
            raise urllib.error.HTTPError(url, response.status, "webhook refused", response.headers, None)
