"""The training container's end as Kubernetes saw it: exit code, signal and reason (``OOMKilled``) from the
pod's status, read from the Kubernetes API by the sidecar (I/O at the edges, parsing pure).

Why: a process killed by the OOM-killer or a cgroup memory limit cannot report anything, and an exit-code
file written by a wrapper shell only says 137. The kubelet records what happened in the pod's
``status.containerStatuses[].state.terminated`` -- ``exitCode``, ``signal``, ``reason`` (``OOMKilled``,
``Error``, ``Completed``, ``ContainerCannotRun`` ...) and the container's termination message -- and the
sidecar can read it with ``get`` on its own pod.

Contract:

* :func:`container_end` (pure): the termination of container ``name`` in a Pod object (``containerStatuses``,
  then ``initContainerStatuses``), or None while it runs / has not started. A container that already
  restarted (``restartCount`` > 0, running again) reports its last termination only when asked with
  ``include_last=True``.
* :class:`KubeConfig`: where the API is and who we are. In a pod: ``https://$KUBERNETES_SERVICE_HOST:
  $KUBERNETES_SERVICE_PORT``, the service account's token (re-read at every request: it is rotated), CA
  and namespace; the pod's name from ``POD_NAME`` (downward API) or ``HOSTNAME``, its namespace from
  ``POD_NAMESPACE`` or the service account. ``api`` overrides the address (``kubectl proxy`` at
  ``http://127.0.0.1:8001`` when testing outside a cluster: then no token is needed).
* :class:`PodStatusReader`: ``read()`` returns the container's end or None and never raises -- also an
  end it would miss because the kubelet restarted the container in place, or is backing off before doing
  so, between two reads (its ``restartCount`` grew since the first read, or ``lastState.terminated`` is
  the attempt, by ``containerID``, that the first read saw: the end is that last state); the last
  error (no RBAC ``get`` on pods: 403, no such pod or container, API unreachable, an answer that is not a
  Pod) is kept in ``error`` with what to do about it, and ``misconfigured`` says whether waiting can fix it.
  The service account's token is sent only over TLS or to this machine.
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple
from urllib.parse import quote, urlparse

from trainguard_engine.catalogue import signal_of_exit_code

log = logging.getLogger("trainguard.agent.kube")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
UNINFORMATIVE_REASONS = ("Error", "Completed", "")
"""Termination reasons that say no more than the exit code itself."""


@dataclass(frozen=True)
class ContainerEnd:
    container: str
    exit_code: int
    signal: int          # from the status, else from a 128 + n exit code, else 0
    reason: str          # "OOMKilled", "Error", "Completed", ...
    message: str         # the container's termination message ("" when none)
    finished_at: str     # RFC 3339, as the API gives it
    restart_count: int

    @property
    def telling_reason(self) -> str:
        """The reason when it says more than the exit code (``OOMKilled``), else ""."""
        return "" if self.reason in UNINFORMATIVE_REASONS else self.reason


def container_statuses(pod: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    """The pod's container statuses: ``containerStatuses``, then ``initContainerStatuses`` (sidecars)."""
    status = pod.get("status") or {}
    return [entry for key in ("containerStatuses", "initContainerStatuses")
            for entry in status.get(key) or [] if isinstance(entry, Mapping)]


def _status_of(pod: Mapping[str, Any], name: str) -> Optional[Mapping[str, Any]]:
    return next((entry for entry in container_statuses(pod) if entry.get("name") == name), None)


def container_end(pod: Mapping[str, Any], name: str, *, include_last: bool = False) -> Optional[ContainerEnd]:
    """The termination of container ``name`` in the Pod object ``pod`` (see the module doc)."""
    entry = _status_of(pod, name)
    if entry is None:
        return None
    terminated = (entry.get("state") or {}).get("terminated")
    if not terminated and include_last:
        terminated = (entry.get("lastState") or {}).get("terminated")
    if not isinstance(terminated, Mapping):
        return None
    code = int(terminated.get("exitCode", 0) or 0)
    sig = int(terminated.get("signal", 0) or 0) or signal_of_exit_code(code)
    return ContainerEnd(name, code, sig, str(terminated.get("reason") or ""),
                        str(terminated.get("message") or ""), str(terminated.get("finishedAt") or ""),
                        int(entry.get("restartCount", 0) or 0))


def _attempts(pod: Mapping[str, Any], name: str) -> Tuple[int, str, str]:
    """Container ``name``'s (restartCount, containerID of its current attempt, containerID of the attempt in
    ``lastState.terminated``); (-1, "", "") when the pod does not list it (yet)."""
    entry = _status_of(pod, name)
    if entry is None:
        return -1, "", ""
    last = (entry.get("lastState") or {}).get("terminated") or {}
    return (int(entry.get("restartCount", 0) or 0), str(entry.get("containerID") or ""),
            str(last.get("containerID") or "") if isinstance(last, Mapping) else "")


@dataclass(frozen=True)
class KubeConfig:
    api: str                  # base URL, no trailing slash
    namespace: str
    pod: str
    token_file: str = ""      # "" : no Authorization header (kubectl proxy)
    ca_file: str = ""         # "" : the system's CAs

    @classmethod
    def from_environment(cls, env: Mapping[str, str], *, api: str = "",
                         service_account: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
        """In-cluster settings (see the module doc); ValueError says what is missing."""
        if not api:
            host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give --kube-api")
            api = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        namespace = env.get("POD_NAMESPACE", "")
        if not namespace and (service_account / "namespace").exists():
            namespace = (service_account / "namespace").read_text().strip()
        pod = env.get("POD_NAME") or env.get("HOSTNAME", "")
        if not namespace or not pod:
            raise ValueError("the pod's name and namespace are unknown: set POD_NAME and POD_NAMESPACE from "
                             "the downward API (fieldRef metadata.name / metadata.namespace)")
        token = service_account / "token"
        ca = service_account / "ca.crt"
        # the token goes only where it cannot be read on the way: TLS, or this machine (kubectl proxy)
        safe = api.startswith("https://") or urlparse(api).hostname in ("127.0.0.1", "localhost", "::1")
        return cls(api.rstrip("/"), namespace, pod, str(token) if token.exists() and safe else "",
                   str(ca) if ca.exists() and api.startswith("https") else "")

    @property
    def pod_url(self) -> str:
        namespace, pod = quote(self.namespace, safe=""), quote(self.pod, safe="")
        return f"{self.api}/api/v1/namespaces/{namespace}/pods/{pod}"


class PodStatusReader:
    """Reads the pod and returns ``container``'s end (see the module doc)."""

    def __init__(self, config: KubeConfig, container: str, *, timeout_s: float = 5.0) -> None:
        self.config = config
        self.container = container
        self.timeout_s = timeout_s
        self.error = ""
        self.reads = 0
        self.seen_container = False
        self.misconfigured = False  # the last read failed in a way waiting will not fix (RBAC, names)
        self.first_restarts: Optional[int] = None  # the container's restartCount when first seen
        self.watched_id = ""                        # and the containerID of that attempt
        self._context: Optional[ssl.SSLContext] = None
        if config.api.startswith("https"):
            self._context = ssl.create_default_context(cafile=config.ca_file or None)

    def read(self) -> Optional[ContainerEnd]:
        try:
            pod = self._get()
            if not isinstance(pod, Mapping) or pod.get("kind", "Pod") != "Pod":
                raise ValueError(f"the answer is not a Pod object: {str(pod)[:200]}")
            names = sorted(str(c.get("name")) for c in container_statuses(pod))
            end = container_end(pod, self.container)
            restarts, current_id, last_id = _attempts(pod, self.container)
            if end is None and self.first_restarts is not None and (
                    restarts > self.first_restarts or (last_id and last_id == self.watched_id)):
                # the attempt this reader saw ended and the kubelet restarted it in place (or is backing off
                # before it does) between two reads: its end is the last state
                end = container_end(pod, self.container, include_last=True)
        except urllib.error.HTTPError as exc:
            self.misconfigured = exc.code in (401, 403, 404)
            self._failed(_http_advice(exc.code, self.config))
            return None
        except Exception as exc:  # a cut connection, a proxy's HTML page: never into the agent's loop
            self.misconfigured = False
            self._failed(f"cannot read the pod from {self.config.api}: {type(exc).__name__}: {exc}")
            return None
        self.reads += 1
        if names and self.container not in names:  # the kubelet lists every container once it runs
            self.misconfigured = True
            self._failed(f"pod {self.config.namespace}/{self.config.pod} has no container named "
                         f"{self.container!r} (it has {', '.join(names)}): check "
                         "TRAINGUARD_AGENT_POD_CONTAINER")
            return None
        self.misconfigured = False
        if self.first_restarts is None and restarts >= 0:
            self.first_restarts, self.watched_id = restarts, current_id
        self.seen_container = self.seen_container or bool(names)
        self.error = ""
        return end

    def _get(self) -> Any:
        request = urllib.request.Request(self.config.pod_url, headers={"Accept": "application/json"})
        if self.config.token_file:
            token = Path(self.config.token_file).read_text().strip()
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as response:
            return json.loads(response.read())

    def _failed(self, message: str) -> None:
        if message != self.error:
            log.warning("%s", message)
        self.error = message


def _http_advice(status: int, config: KubeConfig) -> str:
    where = f"pod {config.namespace}/{config.pod}"
    if status in (401, 403):
        return (f"the Kubernetes API refused to show {where} (HTTP {status}): give the pod's service account "
                f"'get' on pods in {config.namespace} (a Role and RoleBinding: deploy/k8s)")
    if status == 404:
        return f"the Kubernetes API has no {where} (HTTP 404): check POD_NAME / POD_NAMESPACE"
    return f"the Kubernetes API answered HTTP {status} for {where}"

