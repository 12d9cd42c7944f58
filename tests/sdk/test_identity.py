"""Run, trace and rank identity come from the launcher's environment and can be overridden."""

from __future__ import annotations

from trainguard.identity import from_environment

BASE = {"pid": 42, "host": "node-7", "generated_run_id": "gen123", "script": "/x/train.py"}


def test_torchrun_environment() -> None:
    env = {"TORCHELASTIC_RUN_ID": "job-9", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16",
           "GROUP_RANK": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    ident = from_environment(env, **BASE)
    assert (ident.run_id, ident.trace_id, ident.rank, ident.local_rank, ident.world_size,
            ident.group_rank, ident.launcher) == ("job-9", "job-9", 5, 1, 16, 2, "torchelastic")
    assert ident.tags["torchelastic.restart_count"] == "1"
    assert ident.run_name == "train"


def test_slurm_environment() -> None:
    env = {"SLURM_JOB_ID": "777", "SLURM_ARRAY_TASK_ID": "3", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_NTASKS": "32", "SLURM_NODEID": "4"}
    ident = from_environment(env, **BASE)
    assert (ident.run_id, ident.rank, ident.local_rank, ident.world_size, ident.group_rank,
            ident.launcher) == ("slurm-777-3", 9, 1, 32, 4, "slurm")
    assert ident.tags == {"slurm.job_id": "777", "slurm.array_task_id": "3"}


def test_torchrun_inside_slurm_prefers_torchrun_ranks() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "TORCHELASTIC_RUN_ID": "el", "RANK": "3"}
    ident = from_environment(env, **BASE)
    assert (ident.run_id, ident.rank, ident.launcher) == ("el", 3, "torchelastic")


def test_kubernetes_pod_and_namespace() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "trainer-0", "POD_NAMESPACE": "ml"}
    ident = from_environment(env, **BASE)
    assert ident.tags == {"k8s.pod": "trainer-0", "k8s.namespace": "ml"}
    ident = from_environment({"KUBERNETES_SERVICE_HOST": "x"}, k8s_namespace="from-file", **BASE)
    assert ident.tags["k8s.namespace"] == "from-file"


def test_no_launcher_generates_a_run_id_and_overrides_win() -> None:
    ident = from_environment({}, **BASE)
    assert (ident.run_id, ident.trace_id, ident.rank, ident.world_size, ident.launcher) == (
        "gen123", "gen123", 0, 1, "none")
    env = {"TRAINGUARD_RUN_ID": "mine", "TRAINGUARD_TRACE_ID": "t-1", "RANK": "2",
           "TORCHELASTIC_RUN_ID": "el"}
    ident = from_environment(env, run_name="exp", rank=7, **BASE)
    assert (ident.run_id, ident.trace_id, ident.rank, ident.run_name) == ("mine", "t-1", 7, "exp")


def test_garbage_ranks_fall_back_to_defaults() -> None:
    ident = from_environment({"RANK": "abc", "WORLD_SIZE": ""}, **BASE)
    assert (ident.rank, ident.world_size) == (0, 1)


def test_torchrun_without_rdzv_id_gets_a_per_launcher_run_id() -> None:
    """torchrun sets TORCHELASTIC_RUN_ID=none by default: every job would share it."""
    env = {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    ident = from_environment(env, parent_pid=777, **BASE)
    assert ident.run_id == ident.trace_id == "torchrun-10.0.0.5-29500-777"
    assert ident.launcher == "torchelastic"
    other_job = from_environment(env, parent_pid=778, **BASE)
    assert other_job.run_id != ident.run_id
