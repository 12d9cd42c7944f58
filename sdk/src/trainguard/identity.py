"""Who is this process? Run, trace, rank and host identity read from the launcher's environment.

Precedence for every field: an explicit option, then ``TRAINGUARD_*``, then torchrun/TorchElastic, then
Slurm, then Open MPI / PMI, then a default. Pure except for :func:`detect`, which reads the live process.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

_K8S_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class RunIdentity:
    """The identity fields stamped on every envelope of this process."""

    run_id: str
    trace_id: str
    run_name: str
    host: str
    pid: int
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    group_rank: int = -1
    launcher: str = "none"  # "torchelastic", "slurm", "mpi", "none"
    tags: Dict[str, str] = field(default_factory=dict)  # e.g. k8s.pod, slurm.job_id


def _first(env: Mapping[str, str], *names: str) -> Optional[str]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def _int(env: Mapping[str, str], default: int, *names: str) -> int:
    value = _first(env, *names)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        return default


def from_environment(env: Mapping[str, str], *, pid: int, host: str, generated_run_id: str,
                     parent_pid: int = 0,
                     script: str = "", k8s_namespace: Optional[str] = None,
                     run_id: Optional[str] = None, trace_id: Optional[str] = None,
                     run_name: Optional[str] = None, rank: Optional[int] = None,
                     local_rank: Optional[int] = None,
                     world_size: Optional[int] = None) -> RunIdentity:
    """Build the identity from an environment mapping; explicit arguments win over the environment.

    ``generated_run_id`` is used only when neither an option nor a launcher names the run, in which case
    every rank of a multi-process job would get its own: set ``TRAINGUARD_RUN_ID`` to join them.
    """
    tags: Dict[str, str] = {}
    elastic_id = _first(env, "TORCHELASTIC_RUN_ID")
    if elastic_id == "none":
        # torchrun's default when no --rdzv-id is given: the same for every job. The ranks of one
        # node share the launcher process, so name the run after it (multi-node jobs: pass --rdzv-id
        # or TRAINGUARD_RUN_ID so every node agrees).
        master = f"{_first(env, 'MASTER_ADDR') or 'local'}-{_first(env, 'MASTER_PORT') or '0'}"
        elastic_id = f"torchrun-{master}-{parent_pid}"
    slurm_job = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if elastic_id is not None or _first(env, "TORCHELASTIC_RESTART_COUNT") is not None:
        launcher = "torchelastic"
    elif slurm_job is not None:
        launcher = "slurm"
    elif _first(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK") is not None:
        launcher = "mpi"
    else:
        launcher = "none"
    if slurm_job is not None:
        array_task = _first(env, "SLURM_ARRAY_TASK_ID")
        tags["slurm.job_id"] = slurm_job
        if array_task is not None:
            tags["slurm.array_task_id"] = array_task
    if elastic_id is not None:
        tags["torchelastic.run_id"] = elastic_id
        restarts = _first(env, "TORCHELASTIC_RESTART_COUNT")
        if restarts is not None:
            tags["torchelastic.restart_count"] = restarts
    if _first(env, "KUBERNETES_SERVICE_HOST") is not None:
        tags["k8s.pod"] = _first(env, "POD_NAME", "HOSTNAME") or host
        namespace = _first(env, "POD_NAMESPACE") or k8s_namespace
        if namespace:
            tags["k8s.namespace"] = namespace

    launcher_run = elastic_id
    if launcher_run is None and slurm_job is not None:
        array_task = _first(env, "SLURM_ARRAY_TASK_ID")
        launcher_run = f"slurm-{slurm_job}" + (f"-{array_task}" if array_task else "")
    resolved_run = run_id or _first(env, "TRAINGUARD_RUN_ID") or launcher_run or generated_run_id
    resolved_trace = trace_id or _first(env, "TRAINGUARD_TRACE_ID") or launcher_run or resolved_run
    default_name = os.path.splitext(os.path.basename(script))[0] if script else resolved_run
    return RunIdentity(
        run_id=resolved_run,
        trace_id=resolved_trace,
        run_name=run_name or _first(env, "TRAINGUARD_RUN_NAME") or default_name or resolved_run,
        host=host,
        pid=pid,
        rank=rank if rank is not None else _int(
            env, 0, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
        local_rank=local_rank if local_rank is not None else _int(
            env, 0, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
        world_size=world_size if world_size is not None else _int(
            env, 1, "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
        group_rank=_int(env, -1, "GROUP_RANK", "SLURM_NODEID"),
        launcher=launcher,
        tags=tags,
    )


def detect(generated_run_id: str, **overrides: Optional[object]) -> RunIdentity:
    """The identity of the live process (reads os.environ, the hostname and, in Kubernetes, the namespace)."""
    namespace: Optional[str] = None
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("POD_NAMESPACE"):
        try:
            with open(_K8S_NAMESPACE_FILE, encoding="utf-8") as fh:
                namespace = fh.read().strip() or None
        except OSError:
            namespace = None
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return from_environment(os.environ, pid=os.getpid(), host=socket.gethostname(), parent_pid=os.getppid(),
                            generated_run_id=generated_run_id, script=script,
                            k8s_namespace=namespace, **overrides)  # type: ignore[arg-type]
