"""Webhook notifications of new incidents (Slack-compatible JSON), de-duplicated and rate-limited.

Contract of :class:`WebhookNotifier` (a processor listener: ``processor.listeners.append(notifier)``):

* **What is sent**: an incident the first time it is seen at or above ``min_severity`` (warning < error <
  critical), not explained by another (a consequence folded into its cause is not news), as
  ``{"text": ...}`` -- what Slack's and Mattermost's incoming webhooks take -- naming the severity, the kind,
  the title, the run, where it started (rank, step) and a link to its dashboard page when ``dashboard_url``
  is set.
* **Once per incident**: the ids sent are remembered (bounded, newest kept) and, with ``state`` (the
  incident store), saved so that a restart -- which re-emits the incidents it restores -- sends nothing
  twice.
* **Rate limit**: at most ``max_per_minute`` messages in any minute; what exceeds it is counted and sent as
  one summary ("N more incidents ...") when the minute allows again. Nothing is dropped silently.
* **Never blocks the processor**: the listener only queues (bounded, ``max_queue``; overflow counted);
  a daemon thread posts, retrying a failed post ``retries`` times with backoff, then counts it failed.
* ``stats`` counts sent / deduplicated / suppressed (rate-limited into summaries) / failed / dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Optional

from trainguard_engine.pipeline import PipelineOutput
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
    dropped: int = 0


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
        self._sent_ids: OrderedDict[str, None] = OrderedDict(
            (i, None) for i in self._load_sent())
        self._queue: Deque[Dict[str, Any]] = deque()
        self._max_queue = max_queue
        self._window: Deque[float] = deque()   # send times within the last minute
        self._held = 0                         # incidents over the limit, not yet summarised
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
            if incident.incident_id in self._sent_ids:
                self.stats.deduplicated += 1
                continue
            self._sent_ids[incident.incident_id] = None
            while len(self._sent_ids) > REMEMBERED:
                self._sent_ids.popitem(last=False)
            fresh.append(message(incident, self.dashboard_url))
        if not fresh:
            return
        self._save_sent()
        with self._cond:
            for body in fresh:
                if len(self._queue) >= self._max_queue:
                    self.stats.dropped += 1
                    continue
                self._queue.append(body)
            self._cond.notify_all()

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
                while not self._queue and not self._held and not self._stop:
                    self._cond.wait(1.0)
                if self._stop and not self._queue and not self._held:
                    return
            now = self.clock()
            while self._window and now - self._window[0] >= 60.0:
                self._window.popleft()
            body: Optional[Dict[str, Any]] = None
            with self._cond:
                if len(self._window) < self.max_per_minute:
                    if self._held:  # the minute allows again: one summary of what was held back
                        body = {"text": f"... and {self._held} more TrainGuard incident(s) in the last "
                                        f"minute (over the limit of {self.max_per_minute} messages/minute): "
                                        f"see the dashboard"}
                        self._held = 0
                    elif self._queue:
                        body = self._queue.popleft()
                else:
                    while self._queue:  # over the limit: hold them for the summary
                        self._queue.popleft()
                        self._held += 1
                        self.stats.suppressed += 1
            if body is None:
                if self._stop:
                    return
                time.sleep(0.25)  # over the limit: wait for the minute to allow the summary
                continue
            self._window.append(now)
            self._send(body)

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
    def _load_sent(self) -> list:
        if self.state is None:
            return []
        blob = self.state.load_state(STATE_KEY)
        try:
            return list(json.loads(blob))[-REMEMBERED:] if blob else []
        except (ValueError, TypeError):
            return []

    def _save_sent(self) -> None:
        if self.state is not None:
            self.state.save_state(STATE_KEY, json.dumps(list(self._sent_ids)).encode())


def _http_post(url: str, data: bytes, timeout: float) -> None:
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": "trainguard-webhook"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status >= 300:
            raise urllib.error.HTTPError(url, response.status, "webhook refused", response.headers, None)
