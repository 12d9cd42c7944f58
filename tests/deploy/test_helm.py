"""The Helm chart (helm/trainguard) and the training manifests with the agent sidecar (deploy/k8s), checked
without a cluster: rendered by real Helm 3 and Helm 4 binaries, linted, every manifest validated against
the strict Kubernetes JSON schemas (1.25 / 1.29 and 1.37), the PyTorchJob against a schema built from the
Kubeflow training SDK's models and the FlinkDeployment against the validator generated from the Flink
operator's CRD (tests/deploy/manifests.py). Then what the manifests mean: commands that the `trainguard`
parser accepts, TRAINGUARD_* variables that are real settings with valid values, probes on routes that
exist, secret references that resolve, pods that can share SQLite, the Flink job's real arguments, the
agent interface, and the shell snippets run for real."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import pytest
import yaml

from tests.deploy.manifests import (
    CHART,
    FLINK_FIELDS,
    FLINK_MODELS,
    HELMS,
    ROOT,
    Doc,
    helm,
    load_yaml,
    render,
    validate,
    validate_core,
)
from tests.support.http_stub import QuietHandler
from trainguard_server.agent.cli import resolve_env
from trainguard_server.agent.kube import SERVICE_ACCOUNT_DIR, KubeConfig, PodStatusReader
from trainguard_server.cli import build_parser
from trainguard_server.config import Settings, parse_roles

CASES: Dict[str, Optional[str]] = {
    "default": None,
    "embedded": "ci/embedded-values.yaml",
    "external": "ci/external-values.yaml",
    "flink": "ci/flink-values.yaml",
    "existing-secret": "ci/existing-secret-values.yaml",
    "shared": "ci/shared-values.yaml",
}
CHART_K8S = ("1.25", "1.37")  # Chart.yaml: kubeVersion >=1.25; the newest schemas bundled
EXAMPLES = ROOT / "deploy" / "k8s"
AGENT_ENV = {"TRAINGUARD_AGENT_UPSTREAM", "TRAINGUARD_TOKEN", "TRAINGUARD_AGENT_LISTEN",
             "TRAINGUARD_AGENT_LISTEN_GRPC", "TRAINGUARD_AGENT_SPOOL_DIR", "TRAINGUARD_AGENT_LOG_FILES",
             "TRAINGUARD_AGENT_EXIT_FILE", "TRAINGUARD_AGENT_WATCH_PROCESS", "TRAINGUARD_AGENT_HANG_FLOOR_S",
             "TRAINGUARD_AGENT_POD_CONTAINER"}
IDENTITY_ENV = {"TRAINGUARD_RUN_ID", "RANK", "WORLD_SIZE", "POD_NAME", "POD_NAMESPACE"}
# example file -> Kubernetes versions (native sidecars need 1.29)
EXAMPLE_K8S = {"job.yaml": ("1.29", "1.37"), "job-classic-sidecar.yaml": ("1.25", "1.37"),
               "pytorchjob.yaml": ("1.29", "1.37")}
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding")  # shipped with every example: the agent reads its pod
API_VOLUME = "trainguard-agent-api"  # the examples' projected volume of the agent's API credentials
# what the kubelet's automount puts in SERVICE_ACCOUNT_DIR (the kube-api-access-* volume): the token for the
# API server (3607 s, rotated), the cluster's CA and the pod's namespace
AUTOMOUNT_SOURCES: List[Doc] = [
    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]


def docs_of(case: str, which: str = "helm4") -> List[Doc]:
    return render(CASES[case], which=which)


def kinds(docs: List[Doc]) -> Dict[Tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_specs(docs: List[Doc]) -> Iterator[Tuple[Doc, Doc]]:
    for doc in docs:
        if doc["kind"] == "Deployment":
            yield doc, doc["spec"]["template"]["spec"]


def env_of(container: Doc) -> Dict[str, Any]:
    """name -> value, or the valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def resolved_env(container: Doc, secrets: Dict[Tuple[str, str], str]) -> Dict[str, str]:
    """The container's environment as the kubelet would give it, secrets taken from ``secrets``."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = secrets[(ref["name"], ref["key"])]
    return out


def rendered_secrets(docs: List[Doc]) -> Dict[Tuple[str, str], str]:
    return {(d["metadata"]["name"], k): base64.b64decode(v).decode() for d in docs if d["kind"] == "Secret"
            for k, v in d.get("data", {}).items()}


def settings_from(env: Dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings() under exactly this environment: every TRAINGUARD_* must be a field with a valid value."""
    fields = set(Settings.model_fields)
    for key in list(os.environ):
        if key.startswith("TRAINGUARD_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("TRAINGUARD_"):
            assert key[len("TRAINGUARD_"):].lower() in fields, f"{key} is not a Settings field"
            monkeypatch.setenv(key, value)
    return Settings()


# --- rendering and schemas -----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", HELMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_chart_lints_strictly(case: str, which: str) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(CHART / CASES[case])] if CASES[case] else [])  # type: ignore[operator]
    out = helm(which, *args).stdout
    assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rendered_manifest_is_valid_for_kubernetes_1_25_and_1_37(case: str) -> None:
    docs = docs_of(case)
    assert docs
    validate(docs, CHART_K8S)


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_3_and_helm_4_render_the_same_manifests(case: str) -> None:
    def comparable(docs: List[Doc]) -> List[Doc]:
        return [dict(d, data=sorted(d["data"])) if d["kind"] == "Secret" else d for d in docs]  # tokens: random

    assert comparable(docs_of(case, "helm3")) == comparable(docs_of(case, "helm4"))


def test_the_validators_reject_what_is_wrong() -> None:
    """The checks bite: a misspelt field, an unknown Flink field or version, a bad PyTorchJob field."""
    deployment = next(d for d in docs_of("default") if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(AssertionError, match="readinessProbes"):
        validate([broken], ("1.37",))
    flink = next(d for d in docs_of("flink") if d["kind"] == "FlinkDeployment")
    for path, value, message in ((("spec", "flinkVersion"), "v9_9", "flinkVersion"),
                                 (("spec", "job", "upgradeMode"), "sometimes", "upgradeMode"),
                                 (("spec", "jobManager", "resource", "cpu"), "one", "cpu"),
                                 (("spec", "jobs"), {}, "unknown fields"),
                                 (("spec", "podTemplate", "spec", "containers", 0, "envs"), [], "envs")):
        bad = json.loads(json.dumps(flink))
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(AssertionError, match=message):
            validate([bad], ("1.37",))
    job = workload("pytorchjob.yaml")
    for mutate, message in ((lambda j: j["spec"].update(runPolicy={"backofLimit": 1}), "backofLimit"),
                            (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas="1"), "replicas"),
                            (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
                             ["initContainers"][0].update(restartPolicy=1), "restartPolicy")):
        bad = json.loads(json.dumps(job))
        mutate(bad)
        with pytest.raises(AssertionError, match=message):
            validate([bad], ("1.37",))


def test_the_flink_field_lists_are_fields_of_the_crd() -> None:
    declared = (FLINK_MODELS / "flink.apache.org" / "v1beta1" / "FlinkDeployment.d.ts").read_text()
    for level, names in FLINK_FIELDS.items():
        for name in names:
            assert f'"{name}"?:' in declared, (level, name)


# --- what the default (embedded) install is ---------------------------------------------------------------
def test_default_install_is_one_serve_pod_on_a_read_write_once_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = docs_of("default")
    by = kinds(docs)
    assert sorted(by) == sorted([("ServiceAccount", "trainguard"), ("Secret", "trainguard-tokens"),
                                 ("PersistentVolumeClaim", "trainguard-data"), ("Service", "trainguard-gateway"),
                                 ("Service", "trainguard-api"), ("Deployment", "trainguard")])
    deployment = by[("Deployment", "trainguard")]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert by[("PersistentVolumeClaim", "trainguard-data")]["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and (args.http_port, args.grpc_port) == (4318, 4317)
    settings = settings_from(resolved_env(container, rendered_secrets(docs)), monkeypatch)
    assert parse_roles(settings.roles) == ("gateway", "processor", "api")  # serve runs every role
    assert (settings.queue, settings.event_store, settings.metric_store) == ("sqlite", "sqlite", "sqlite")
    assert str(settings.data_dir) == "/var/lib/trainguard" and settings.host == "0.0.0.0"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/var/lib/trainguard"]]["persistentVolumeClaim"]["claimName"] == "trainguard-data"
    assert "affinity" not in pod  # one pod: nothing to pin


def test_generated_tokens_are_tokens_the_server_accepts_and_are_kept_on_uninstall() -> None:
    from trainguard_server.storage.common import parse_operator_token

    secret = kinds(docs_of("default"))[("Secret", "trainguard-tokens")]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    parse_operator_token("ingest", values["ingest-token"])
    parse_operator_token("read", values["read-token"])
    again = rendered_secrets(render(None, ("tokens.project=again",)))
    assert again[("trainguard-tokens", "ingest-token")] != values["ingest-token"]  # random per install


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_secret_reference_resolves(case: str) -> None:
    """To a key of a Secret the chart renders, or to a Secret the values name (the operator creates it)."""
    values = yaml.safe_load((CHART / CASES[case]).read_text()) if CASES[case] else {}  # type: ignore[operator]
    external = {s for s in re.findall(r"(?:existingSecret|name|secretName): (\S+)", yaml.safe_dump(values))}
    docs = docs_of(case)
    rendered = rendered_secrets(docs)
    refs = [e["valueFrom"]["secretKeyRef"] for _, pod in pod_specs(docs) for c in pod["containers"]
            for e in c.get("env", []) if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]
    refs += [e["valueFrom"]["secretKeyRef"] for d in docs if d["kind"] == "FlinkDeployment"
             for c in d["spec"]["podTemplate"]["spec"]["containers"] for e in c.get("env", [])
             if "valueFrom" in e]
    assert refs
    for ref in refs:
        assert (ref["name"], ref["key"]) in rendered or ref["name"] in external, ref
    for _, pod in pod_specs(docs):
        for volume in pod["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["secretName"] in external


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes_ask_routes_the_server_has_on_ports_the_container_opens(case: str) -> None:
    from trainguard_server.api.app import create_app
    from trainguard_server.api.deps import Services

    app = create_app(Services(events=None, metrics=None, incidents=None, projects=None))  # type: ignore[arg-type]
    routes = {path for path, ops in app.openapi()["paths"].items() if "get" in ops}  # the server's GET routes
    probed = set()
    for _, pod in pod_specs(docs_of(case)):
        for container in pod["containers"]:
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                get = container[kind]["httpGet"]
                assert get["path"] in routes and get["port"] in ports, (container["name"], kind, get)
                probed.add(get["path"])
            # the port the probe asks is the port the command binds
            args = build_parser().parse_args(container["args"])
            assert args.http_port == ports[container["readinessProbe"]["httpGet"]["port"]]
    assert probed == {"/healthz", "/readyz"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_services_reach_named_ports_of_the_pods_they_select(case: str) -> None:
    docs = docs_of(case)
    pods = [(d["spec"]["template"]["metadata"]["labels"], p) for d, p in pod_specs(docs)]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selected = [p for labels, p in pods if svc["spec"]["selector"].items() <= labels.items()]
        assert selected, svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            for pod in selected:
                assert any(port["targetPort"] == p["name"] for c in pod["containers"] for p in c["ports"])
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {"trainguard-gateway", "trainguard-api"} == names  # the agent's upstream in deploy/k8s


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_run_as_the_images_user_without_privileges(case: str) -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    for _, pod in pod_specs(docs_of(case)):
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == uid
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/var/lib/trainguard", "/tmp"}
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


# --- split mode against existing Kafka / Elasticsearch / ClickHouse ------------------------------------------
def test_split_mode_points_every_process_at_the_existing_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = docs_of("external")
    values = yaml.safe_load((CHART / "ci/external-values.yaml").read_text())
    secrets = {("trainguard-kafka", "client-config.json"): '{"security.protocol": "SASL_SSL"}',
               ("trainguard-es", "api-key"): "key", ("trainguard-clickhouse", "password"): "pw",
               **rendered_secrets(docs)}
    roles = {}
    for deployment, pod in pod_specs(docs):
        (container,) = pod["containers"]
        env = resolved_env(container, secrets)
        args = build_parser().parse_args(container["args"])
        settings = settings_from(env, monkeypatch)
        roles[deployment["metadata"]["name"]] = (args.command, parse_roles(getattr(args, "roles", None)
                                                                           or settings.roles))
        assert settings.queue == "kafka"
        assert settings.kafka_bootstrap_servers == values["queue"]["kafka"]["bootstrapServers"]
        assert settings.kafka_topic == "tg.ingest" and settings.kafka_partitions == 24
        assert settings.kafka_replication_factor == 3 and settings.kafka_create_topics is False
        assert settings.kafka_retention_ms == 604800000
        assert json.loads(settings.kafka_client_config) == {"security.protocol": "SASL_SSL"}
        assert settings.event_store == "elasticsearch"
        assert settings.elasticsearch_hosts == values["eventStore"]["elasticsearch"]["hosts"]
        assert settings.elasticsearch_api_key == "key"
        assert settings.elasticsearch_ca_certs == "/etc/trainguard/es-ca/ca.crt"
        assert any(m["mountPath"] == "/etc/trainguard/es-ca" for m in container["volumeMounts"])
        assert settings.metric_store == "clickhouse" and settings.clickhouse_url == ""
        assert (settings.clickhouse_host, settings.clickhouse_port, settings.clickhouse_user) == \
            ("clickhouse.data.svc", 8443, "trainguard")
        assert settings.clickhouse_secure is True and settings.clickhouse_password == "pw"
        assert settings.processor_runtime == "embedded"
    assert roles == {"trainguard-gateway": ("gateway", ("gateway",)),
                     "trainguard-api": ("api", ("api",)),
                     # `processor` alone serves no HTTP: serve with roles processor,api (probes)
                     "trainguard-processor": ("serve", ("processor", "api"))}
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d, _ in pod_specs(docs)}
    assert replicas == {"trainguard-gateway": 2, "trainguard-api": 2, "trainguard-processor": 1}


@pytest.mark.parametrize("case", ["external", "flink"])
def test_split_pods_share_one_volume_on_one_node(case: str) -> None:
    """SQLite WAL needs its processes on one host: every pod mounts the one RWO claim, and a required pod
    affinity on kubernetes.io/hostname selects every one of them (the first matches its own term)."""
    check_one_node(docs_of(case))


# split mode where exactly one store is still SQLite: the one-node rules come back
ONE_FILE_STORE = ["stateStore.type=sqlite", "eventStore.type=sqlite", "metricStore.type=sqlite"]


@pytest.mark.parametrize("store", ONE_FILE_STORE)
def test_split_mode_with_one_store_on_sqlite_stays_on_one_node(store: str) -> None:
    check_one_node(render(CASES["shared"], (store,)))


def test_split_mode_on_shared_state_drops_the_one_node_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kafka, PostgreSQL, Elasticsearch and ClickHouse: no pod opens a file another opens, so none is pinned
    to a node (no pod affinity at all), none mounts a claim (the data dir is an emptyDir) and no claim is
    made; every process points at the same PostgreSQL; three processors share one consumer group."""
    docs = docs_of("shared")
    dsn = "postgresql://tg@pg-0.data.svc:5432/trainguard?sslmode=require"
    secrets = {("trainguard-postgres", "dsn"): dsn, **rendered_secrets(docs)}
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    replicas, groups = {}, set()
    for deployment, pod in pod_specs(docs):
        name = deployment["metadata"]["name"]
        replicas[name] = deployment["spec"]["replicas"]
        assert "affinity" not in pod, name
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/var/lib/trainguard"]] == {"name": "data", "emptyDir": {}}, name
        settings = settings_from(resolved_env(container, secrets), monkeypatch)
        assert (settings.queue, settings.state_store, settings.event_store, settings.metric_store) == \
            ("kafka", "postgres", "elasticsearch", "clickhouse"), name
        assert (settings.postgres_dsn, settings.postgres_schema, settings.postgres_pool_size) == \
            (dsn, "tg_prod", 4), name
        assert settings.bootstrap_ingest_token and settings.bootstrap_read_token  # from the Secret, not the dir
        groups.add(settings.kafka_group_id)
    assert replicas == {"trainguard-gateway": 2, "trainguard-api": 2, "trainguard-processor": 3}
    assert len(groups) == 1 and kinds(docs)[("Deployment", "trainguard-processor")]["spec"]["strategy"] == \
        {"type": "Recreate"}
    # nothing to persist: split mode on shared state renders without a volume too
    quiet = render(CASES["shared"], ("persistence.enabled=false",))
    assert [d["kind"] for d in quiet] == [d["kind"] for d in docs]


def check_one_node(docs: List[Doc]) -> None:
    pods = list(pod_specs(docs))
    assert len(pods) == 3
    claims = set()
    for _, pod in pods:
        claims |= {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        for other, _ in pods:
            labels = other["spec"]["template"]["metadata"]["labels"]
            assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert claims == {"trainguard-data"}
    assert kinds(docs)[("PersistentVolumeClaim", "trainguard-data")]["spec"]["accessModes"] == ["ReadWriteOnce"]
    processor = kinds(docs)[("Deployment", "trainguard-processor")]
    assert processor["spec"]["strategy"]["type"] == "Recreate"


# --- the Flink runtime --------------------------------------------------------------------------------------
def test_flink_mode_runs_our_job_with_its_real_arguments_against_the_processors_topics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard_server.processor.flink_main import build_parser as job_parser

    docs = docs_of("flink")
    by = kinds(docs)
    flink = by[("FlinkDeployment", "trainguard-flink")]
    job = flink["spec"]["job"]
    assert job["entryClass"] == "org.apache.flink.client.python.PythonDriver"
    args = list(job["args"])
    assert args[:4] == ["-pyclientexec", "/opt/pyflink/bin/python", "-pym", "trainguard_server.processor.flink_main"]
    ns = job_parser().parse_args(args[4:])
    (processor,) = by[("Deployment", "trainguard-processor")]["spec"]["template"]["spec"]["containers"]
    env = resolved_env(processor, {("trainguard-es", "username"): "u", ("trainguard-es", "password"): "p",
                                   **rendered_secrets(docs)})
    settings = settings_from(env, monkeypatch)
    assert settings.processor_runtime == "flink" and settings.queue == "kafka"
    assert (ns.kafka, ns.topic, ns.results_topic) == (settings.kafka_bootstrap_servers, settings.kafka_topic,
                                                      settings.kafka_results_topic)
    assert ns.group_id != settings.kafka_group_id  # the job reads the ingest topic as a group of its own
    assert ns.parallelism == job["parallelism"] == 4
    assert settings.clickhouse_url == "http://default@clickhouse.data.svc:8123"
    assert (settings.elasticsearch_username, settings.elasticsearch_password) == ("u", "p")
    # what the image provides (deploy/flink/Dockerfile): the venv's python, the connector jars in lib/
    flink_dockerfile = (ROOT / "deploy" / "flink" / "Dockerfile").read_text()
    assert "python3 -m venv /opt/pyflink" in flink_dockerfile and str(ns.jars) == "/opt/flink/lib"
    assert "tools/flink_jars.py /opt/flink/lib" in flink_dockerfile
    image = re.search(r"^FROM flink:(\d+\.\d+)\.\d+", flink_dockerfile, re.M).group(1)  # type: ignore[union-attr]
    assert job["jarURI"].endswith(f"/flink-python-{image}.0.jar")
    # the job's defaults for --client-config and --overrides come from its environment
    (main,) = flink["spec"]["podTemplate"]["spec"]["containers"]
    assert main["name"] == "flink-main-container"
    flink_env = env_of(main)
    assert flink_env["TRAINGUARD_KAFKA_CLIENT_CONFIG"] == env["TRAINGUARD_KAFKA_CLIENT_CONFIG"]
    monkeypatch.setenv("TRAINGUARD_KAFKA_CLIENT_CONFIG", flink_env["TRAINGUARD_KAFKA_CLIENT_CONFIG"])
    monkeypatch.setenv("TRAINGUARD_DETECTION_OVERRIDES", flink_env["TRAINGUARD_DETECTION_OVERRIDES"])
    with_env = job_parser().parse_args(args[4:])
    assert json.loads(with_env.client_config) == {"security.protocol": "SSL"}
    assert json.loads(with_env.overrides) == {"stall_min_s": 30}
    assert all(isinstance(v, str) for v in flink["spec"]["flinkConfiguration"].values())
    assert flink["spec"]["image"] == "registry.example.com/trainguard-flink:0.1.0"


def test_flink_runtime_without_the_chart_submitting_the_job() -> None:
    docs = render("ci/flink-values.yaml", ("flink.deploy=false",))
    assert "FlinkDeployment" not in {d["kind"] for d in docs}


# --- existing Secret and claim ------------------------------------------------------------------------------
def test_an_existing_secret_and_claim_are_used_and_nothing_is_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = docs_of("existing-secret")
    present = {d["kind"] for d in docs}
    assert not present & {"Secret", "PersistentVolumeClaim", "ServiceAccount"}, present
    ((_, pod),) = pod_specs(docs)
    assert pod["serviceAccountName"] == "trainguard-runner"
    (container,) = pod["containers"]
    env = env_of(container)
    assert env["TRAINGUARD_BOOTSTRAP_INGEST_TOKEN"] == {"secretKeyRef": {"name": "my-trainguard-tokens", "key": "ingest"}}
    assert env["TRAINGUARD_BOOTSTRAP_READ_TOKEN"] == {"secretKeyRef": {"name": "my-trainguard-tokens", "key": "read"}}
    assert env["TRAINGUARD_BOOTSTRAP_PROJECT"] == "research"
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["trainguard-data-ssd"]


def test_embedded_values_pass_settings_tokens_and_ingress(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = docs_of("embedded")
    by = kinds(docs)
    ((_, pod),) = pod_specs(docs)
    (container,) = pod["containers"]
    settings = settings_from(resolved_env(container, rendered_secrets(docs)), monkeypatch)
    assert settings.bootstrap_ingest_token == \
        "tg_ingest_0123456789abcdef_0123456789abcdef0123456789abcdef0123456789abcdef"
    assert settings.max_queue_depth == 1000000 and settings.webhook_min_severity == "error"
    assert json.loads(settings.detection_overrides) == {"stall_min_s": 30}
    assert container["image"] == "registry.example.com/trainguard-server:0.1.0"
    assert by[("PersistentVolumeClaim", "trainguard-data")]["spec"]["storageClassName"] == "fast-ssd"
    rule = by[("Ingress", "trainguard")]["spec"]["rules"][0]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "trainguard-api", "port": {"name": "http"}}


def test_the_schemas_settings_are_real_settings() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    offered = set(schema["properties"]["settings"]["propertyNames"]["enum"])
    assert offered <= set(Settings.model_fields)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])  # every documented value is in the schema


# --- values that cannot work fail with a message ----------------------------------------------------------
@pytest.mark.parametrize("sets,message", [
    (["queue.type=kafka"], "queue.type=kafka needs queue.kafka.bootstrapServers"),
    (["mode=split"], "mode=split runs gateway, processor and api as separate pods"),
    (["mode=split", "queue.type=kafka", "queue.kafka.bootstrapServers=k:9092", "persistence.enabled=false"],
     "mode=split needs persistence.enabled=true"),
    (["processor.runtime=flink"], "processor.runtime=flink needs queue.type=kafka"),
    (["stateStore.type=postgres"], "stateStore.type=postgres needs stateStore.postgres.dsn"),
    (["stateStore.type=postgres", "stateStore.postgres.dsn=host=pg", "stateStore.postgres.dsnKey=dsn"],
     "not both"),
    (["stateStore.type=postgres", "stateStore.postgres.dsnKey=dsn"],
     "name keys of stateStore.postgres.existingSecret"),
    (["stateStore.postgres.schema=Prod"], "^[a-z_][a-z0-9_]{0,62}$"),
    (["queue.type=kafka", "queue.kafka.bootstrapServers=k:9092", "processor.runtime=flink", "processor.replicas=2"],
     "processor.replicas > 1 needs processor.runtime=embedded"),
    (["eventStore.type=elasticsearch"], "needs eventStore.elasticsearch.hosts"),
    (["metricStore.type=clickhouse"], "metricStore.type=clickhouse needs metricStore.clickhouse.url"),
    (["metricStore.type=clickhouse", "metricStore.clickhouse.host=ch", "metricStore.clickhouse.passwordKey=pw"],
     "name keys of metricStore.clickhouse.existingSecret"),
    (["tokens.existingSecret=s", "tokens.ingestToken=tg_ingest_0123456789abcdef_" + "0" * 48],
     "tokens.existingSecret holds the tokens"),
    (["tokens.ingestToken=secret123"], "ingestToken"),
    (["mode=cluster"], "mode"),
    (["settings.webhok_url=x"], "webhok_url"),
    (["settings.queue=kafka"], "queue"),
    (["queue.kafka.partitions=0"], "partitions"),
    (["flink.upgradeMode=sometimes"], "upgradeMode"),
])
@pytest.mark.parametrize("which", HELMS)
def test_values_that_cannot_work_fail_with_a_message(which: str, sets: List[str], message: str) -> None:
    args = ["template", "t", str(CHART)]
    for item in sets:
        args += ["--set", item]
    proc = helm(which, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# --- deploy/k8s: training manifests with the agent ------------------------------------------------------
def workload(name: str) -> Doc:
    """The example's Job or PyTorchJob (the file also holds the agent's ServiceAccount, Role, RoleBinding)."""
    (doc,) = [d for d in load_yaml(EXAMPLES / name) if d["kind"] not in RBAC_KINDS]
    return doc


def example_pods(doc: Doc) -> List[Doc]:
    if doc["kind"] == "Job":
        return [doc["spec"]["template"]["spec"]]
    return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]


def agent_and_trainer(pod: Doc) -> Tuple[Doc, Doc]:
    containers = pod.get("initContainers", []) + pod["containers"]
    agent = next(c for c in containers if c["name"] == "trainguard-agent")
    trainer = next(c for c in pod["containers"] if c is not agent)
    return agent, trainer


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_the_example_manifests_are_valid(name: str) -> None:
    docs = load_yaml(EXAMPLES / name)
    # the service account and its rights first: they exist when the controller creates the pods
    assert [d["kind"] for d in docs] == [*RBAC_KINDS, workload(name)["kind"]]
    validate(docs, EXAMPLE_K8S[name])


def test_the_sidecar_snippet_makes_a_valid_pod_like_the_job_example() -> None:
    snippet, *objects = load_yaml(EXAMPLES / "agent-sidecar.yaml")
    assert set(snippet) == {"serviceAccountName", "automountServiceAccountToken", "initContainers", "volumes",
                            "trainerContainer"}
    trainer = {"name": "trainer", "image": "my-trainer:1", **snippet["trainerContainer"]}
    pod: Doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
                "spec": {"serviceAccountName": snippet["serviceAccountName"],
                         "automountServiceAccountToken": snippet["automountServiceAccountToken"],
                         "volumes": snippet["volumes"], "initContainers": snippet["initContainers"],
                         "containers": [trainer]}}
    for version in ("1.29", "1.37"):
        validate_core(pod, version)
        validate(objects, (version,))
    # the agent reads the pod's trainer ("trainer": yours is named in TRAINGUARD_AGENT_POD_CONTAINER)
    check_pod_container(pod["spec"], *agent_and_trainer(pod["spec"]))
    check_the_agent_may_read_its_pod(pod["spec"], objects, "ml")
    job_docs = load_yaml(EXAMPLES / "job.yaml")
    job_pod = workload("job.yaml")["spec"]["template"]["spec"]
    assert snippet["initContainers"] == job_pod["initContainers"]
    assert snippet["volumes"] == job_pod["volumes"]
    assert snippet["serviceAccountName"] == job_pod["serviceAccountName"]
    assert snippet["automountServiceAccountToken"] == job_pod["automountServiceAccountToken"]
    assert objects == [d for d in job_docs if d["kind"] in RBAC_KINDS]
    job_trainer = env_of(job_pod["containers"][0])
    assert env_of(trainer).items() <= job_trainer.items()


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_the_sidecar_speaks_the_agent_interface(name: str) -> None:
    doc = workload(name)
    gateway = kinds(render())[("Service", "trainguard-gateway")]  # release trainguard in namespace trainguard
    http_port = next(p["port"] for p in gateway["spec"]["ports"] if p["name"] == "http")
    for pod in example_pods(doc):
        agent, trainer = agent_and_trainer(pod)
        native = agent in pod.get("initContainers", [])
        assert native == (name != "job-classic-sidecar.yaml")
        if native:
            assert agent["restartPolicy"] == "Always"  # native sidecar: the Job ends with the trainer
        assert bool(pod.get("shareProcessNamespace")) == (not native)
        assert agent["image"] == "trainguard-server:0.1.0"
        command = agent.get("command", []) + agent["args"]
        assert command == ["agent"] or (command[:2] == ["/bin/sh", "-c"] and \
            command[2].rstrip().endswith("exec trainguard agent"))
        env = env_of(agent)
        helpers = {k for k in env if k.startswith("TG_")}  # inputs of $(VAR) or the rank script
        assert set(env) - helpers <= AGENT_ENV | IDENTITY_ENV, set(env) - AGENT_ENV - IDENTITY_ENV - helpers
        required = AGENT_ENV - {"TRAINGUARD_AGENT_WATCH_PROCESS"}
        assert required <= set(env)
        assert ("TRAINGUARD_AGENT_WATCH_PROCESS" in env) == (not native)  # needs the shared process namespace
        assert {"TRAINGUARD_RUN_ID", "WORLD_SIZE", "POD_NAME", "POD_NAMESPACE"} <= set(env)
        assert "RANK" in env or "RANK=" in " ".join(command)
        assert env["TRAINGUARD_AGENT_UPSTREAM"] == f"http://trainguard-gateway.trainguard.svc:{http_port}"
        assert env["TRAINGUARD_AGENT_LISTEN"] == "127.0.0.1:4318"
        assert env["TRAINGUARD_AGENT_LISTEN_GRPC"] == "127.0.0.1:4317"
        float(env["TRAINGUARD_AGENT_HANG_FLOOR_S"])
        # the trainer's SDK sends to the agent, with the same token and identity
        trainer_env = env_of(trainer)
        assert trainer_env["TRAINGUARD_ENDPOINT"] == "http://" + env["TRAINGUARD_AGENT_LISTEN"]
        assert trainer_env["TRAINGUARD_TOKEN"] == env["TRAINGUARD_TOKEN"] == \
            {"secretKeyRef": {"name": "trainguard-ingest", "key": "token"}}
        for key in ("TRAINGUARD_RUN_ID", "POD_NAME", "POD_NAMESPACE"):
            assert trainer_env[key] == env[key], key
        if doc["kind"] == "Job":
            assert trainer_env["RANK"] == env["RANK"] and trainer_env["WORLD_SIZE"] == env["WORLD_SIZE"]
        # probes ask the agent's /healthz on its listen address from inside the container
        for probe in ("startupProbe", "livenessProbe"):
            code = agent[probe]["exec"]["command"]
            assert code[:2] == ["python", "-c"] and f"http://{env['TRAINGUARD_AGENT_LISTEN']}/healthz" in code[2]
        # the files the agent reads are on a volume both containers mount; the spool is the agent's
        mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
        trainer_mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
        for path in (os.path.dirname(env["TRAINGUARD_AGENT_LOG_FILES"].split(",")[0]),
                     os.path.dirname(env["TRAINGUARD_AGENT_EXIT_FILE"])):
            assert mounts[path]["name"] == trainer_mounts[path] and mounts[path].get("readOnly")
        assert env["TRAINGUARD_AGENT_SPOOL_DIR"] in mounts
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert all("emptyDir" in volumes[m["name"]] for m in agent["volumeMounts"]
                   if m["mountPath"] != str(SERVICE_ACCOUNT_DIR))  # that one: check_only_the_agent_gets_...


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_identity_comes_from_what_the_controllers_set(name: str) -> None:
    doc = workload(name)
    for pod in example_pods(doc):
        for container in agent_and_trainer(pod):
            defined: List[str] = []
            for e in container["env"]:
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, (container["name"], e["name"], ref)  # defined before use
                path = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
                label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
                if label and doc["kind"] == "Job":
                    # the Job controller's label with the Job's uid (legacy name for old clusters)
                    expected = "controller-uid" if "classic" in name else "batch.kubernetes.io/controller-uid"
                    assert label.group(1) == expected
                elif label:
                    assert label.group(1) in {"training.kubeflow.org/replica-type",
                                              "training.kubeflow.org/replica-index",
                                              "training.kubeflow.org/job-name"}
                defined.append(e["name"])


Grant = Tuple[str, str, str, Tuple[str, ...]]


def granted(docs: List[Doc], namespace: str, service_account: str) -> Set[Grant]:
    """(verb, apiGroup, resource, resourceNames) that the RoleBindings of ``namespace`` in ``docs`` grant the
    service account ``namespace/service_account`` through Roles of that namespace (RBAC as the API server
    evaluates it; a subject matches by kind, name and namespace)."""
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == namespace}
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
    out: Set[Grant] = set()
    for binding in docs:
        if binding["kind"] != "RoleBinding" or binding["metadata"]["namespace"] != namespace \
                or subject not in binding.get("subjects", []):
            continue
        ref = binding["roleRef"]
        assert (ref["apiGroup"], ref["kind"]) == ("rbac.authorization.k8s.io", "Role"), ref
        for rule in roles[ref["name"]].get("rules", []):  # KeyError: bound to a Role that is not there
            assert not rule.get("nonResourceURLs"), rule
            out |= {(verb, group, resource, tuple(rule.get("resourceNames", [])))
                    for verb in rule["verbs"] for group in rule["apiGroups"] for resource in rule["resources"]}
    return out


def source_files(sources: List[Doc]) -> Dict[str, Doc]:
    """path in the volume -> the projected source (one entry each) that puts a file there."""
    out: Dict[str, Doc] = {}
    for source in sources:
        if "serviceAccountToken" in source:
            out[source["serviceAccountToken"]["path"]] = source
        for kind in ("configMap", "secret", "downwardAPI", "clusterTrustBundle"):
            if kind == "clusterTrustBundle" and kind in source:
                out[source[kind]["path"]] = source
            elif kind in source:
                for item in source[kind].get("items", [{"path": "<every key>"}]):
                    out[item["path"]] = {kind: dict(source[kind], items=[item])}
    return out


def check_only_the_agent_gets_the_api_credentials(pod: Doc) -> None:
    """No token auto-mounted into every container (the trainer runs user code): the pod turns the automount
    off, and the agent alone mounts, read-only where it reads them (kube.SERVICE_ACCOUNT_DIR), a projected
    volume of what the automount gives -- a token for the API server at `token`, the cluster CA
    (kube-root-ca.crt) at `ca.crt`, the namespace (metadata.namespace) at `namespace` -- and no other
    container mounts it or any other token."""
    assert pod.get("automountServiceAccountToken") is False, "the token is auto-mounted into every container"
    agent, _ = agent_and_trainer(pod)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    here = [m for m in agent.get("volumeMounts", []) if m["mountPath"].rstrip("/") == str(SERVICE_ACCOUNT_DIR)]
    assert len(here) == 1, f"the agent mounts no credentials at {SERVICE_ACCOUNT_DIR}"
    (mount,) = here
    assert mount.get("readOnly") is True and not mount.get("subPath") and not mount.get("subPathExpr"), mount
    assert "projected" in volumes.get(mount["name"], {}), f"{mount['name']} is not a projected volume"
    files = source_files(volumes[mount["name"]]["projected"]["sources"])
    assert set(files) == {"token", "ca.crt", "namespace"}, sorted(files)  # the automount's, nothing more
    assert "serviceAccountToken" in files["token"], "no serviceAccountToken at path token"
    token = files["token"]["serviceAccountToken"]
    assert "audience" not in token  # the API server's own: a token it accepts
    assert token.get("expirationSeconds", 3600) >= 600  # the API server's minimum
    assert files["ca.crt"] == {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                                                 "path": "ca.crt"}]}}
    namespace = files["namespace"].get("downwardAPI", {}).get("items", [{}])[0]
    assert namespace.get("fieldRef", {}).get("fieldPath") == "metadata.namespace", files["namespace"]
    # the other containers: neither this volume nor any token (the automount is off: only mounts give one)
    carries_token = {n for n, v in volumes.items()
                     if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
    assert carries_token == {mount["name"]}, carries_token
    for container in pod.get("initContainers", []) + pod["containers"] + pod.get("ephemeralContainers", []):
        if container is not agent:
            for m in container.get("volumeMounts", []):
                assert m["name"] not in carries_token, f"{container['name']} mounts the agent's token"
                assert not m["mountPath"].startswith(str(SERVICE_ACCOUNT_DIR)), (container["name"], m)


def check_the_agent_may_read_its_pod(pod: Doc, docs: List[Doc], namespace: str) -> None:
    """The pod runs as a service account of ``docs`` in ``namespace``, whose token the agent alone mounts,
    that may `get` pods there and do nothing else; the other objects are in the same namespace, none
    cluster-wide."""
    account = pod.get("serviceAccountName", "")
    assert account and account != "default", "the pod needs serviceAccountName"
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert account in accounts, f"no ServiceAccount {account}"
    assert not {d["kind"] for d in docs} & {"ClusterRole", "ClusterRoleBinding"}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] in RBAC_KINDS} == {namespace}
    # the agent reads the token from /var/run/secrets/kubernetes.io/serviceaccount: mounted there, in the
    # agent's container only
    check_only_the_agent_gets_the_api_credentials(pod)
    # its one request, GET /api/v1/namespaces/<ns>/pods/<pod> (any pod name: the controllers pick them)
    assert granted(docs, namespace, account) == {("get", "", "pods", ())}
    # and no Role in the file grants more, wildcards included, to anyone
    for role in (d for d in docs if d["kind"] == "Role"):
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}], role


def check_pod_container(pod: Doc, agent: Doc, trainer: Doc) -> None:
    """TRAINGUARD_AGENT_POD_CONTAINER names the trainer (a main container of this pod, not the agent);
    POD_NAME / POD_NAMESPACE come from the downward API."""
    env = env_of(agent)
    name = env["TRAINGUARD_AGENT_POD_CONTAINER"]
    assert name != agent["name"]
    assert name in [c["name"] for c in pod.get("initContainers", []) + pod["containers"]], name
    assert name == trainer["name"] and trainer in pod["containers"]  # its end is in status.containerStatuses
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_the_sidecar_reads_the_trainers_end_from_its_pod_with_only_get_on_pods(name: str) -> None:
    docs = load_yaml(EXAMPLES / name)
    doc = workload(name)
    for pod in example_pods(doc):
        agent, trainer = agent_and_trainer(pod)
        check_pod_container(pod, agent, trainer)
        if doc["kind"] == "PyTorchJob":
            assert trainer["name"] == "pytorch"  # the operator's container name
        check_the_agent_may_read_its_pod(pod, docs, doc["metadata"]["namespace"])
    # what the checks catch (docs: ServiceAccount, Role, RoleBinding, the workload)
    wrong: List[Tuple[Callable[[Doc, List[Doc], Doc], Any], str]] = [
        (lambda p, d, a: a["env"].append({"name": "TRAINGUARD_AGENT_POD_CONTAINER", "value": a["name"]}),
         "the agent's own container"),
        (lambda p, d, a: a["env"].append({"name": "TRAINGUARD_AGENT_POD_CONTAINER", "value": "train"}),
         "no such container"),
        (lambda p, d, a: a["env"].append({"name": "POD_NAME", "value": "x"}), "POD_NAME not from the pod"),
        (lambda p, d, a: p.pop("serviceAccountName"), "no serviceAccountName"),
        (lambda p, d, a: a.update(volumeMounts=[m for m in a["volumeMounts"] if m["name"] != API_VOLUME]),
         "no token for the agent"),
        (lambda p, d, a: p.pop("automountServiceAccountToken"), "the token auto-mounted (the default)"),
        (lambda p, d, a: p.update(automountServiceAccountToken=True), "the token auto-mounted"),
        (lambda p, d, a: agent_and_trainer(p)[1]["volumeMounts"].append(
            {"name": API_VOLUME, "mountPath": str(SERVICE_ACCOUNT_DIR), "readOnly": True}),
         "the trainer mounts the agent's token"),
        (lambda p, d, a: agent_and_trainer(p)[1]["volumeMounts"].append(
            {"name": API_VOLUME, "mountPath": "/creds", "readOnly": True}), "the trainer mounts it elsewhere"),
        (lambda p, d, a: api_volume(p)["projected"]["sources"].pop(0), "the projected volume has no token"),
        (lambda p, d, a: api_volume(p)["projected"]["sources"][0]["serviceAccountToken"].update(path="tok"),
         "the token at another path"),
        (lambda p, d, a: api_volume(p)["projected"]["sources"][0]["serviceAccountToken"].update(audience="x"),
         "a token for another audience"),
        (lambda p, d, a: api_volume(p)["projected"]["sources"].pop(1), "no cluster CA"),
        (lambda p, d, a: api_volume(p)["projected"]["sources"][2]["downwardAPI"]["items"][0]["fieldRef"]
         .update(fieldPath="metadata.name"), "the namespace file from another field"),
        (lambda p, d, a: next(m for m in a["volumeMounts"] if m["name"] == API_VOLUME).update(mountPath="/creds"),
         "the credentials where the agent does not read them"),
        (lambda p, d, a: next(m for m in a["volumeMounts"] if m["name"] == API_VOLUME).pop("readOnly"),
         "the credentials writable"),
        (lambda p, d, a: d[1]["rules"][0]["verbs"].append("list"), "a broader verb"),
        (lambda p, d, a: d[1]["rules"][0].update(resources=["*"]), "a wildcard resource"),
        (lambda p, d, a: d[2]["subjects"][0].update(namespace="default"), "another namespace's account"),
        (lambda p, d, a: d[2]["metadata"].update(namespace="default"), "a binding in another namespace"),
        (lambda p, d, a: d[2]["roleRef"].update(kind="ClusterRole", name="view"), "a ClusterRole")]
    assert api_volume(example_pods(doc)[0])["projected"]["sources"] == AUTOMOUNT_SOURCES  # what they mutate
    for mutate, what in wrong:
        bad_docs = json.loads(json.dumps(docs))
        bad_pod = example_pods(bad_docs[-1])[0]
        agent, trainer = agent_and_trainer(bad_pod)
        mutate(bad_pod, bad_docs, agent)
        with pytest.raises(AssertionError):
            check_pod_container(bad_pod, agent, trainer)
            check_the_agent_may_read_its_pod(bad_pod, bad_docs, doc["metadata"]["namespace"])
            raise RuntimeError(f"not caught: {what}")


def api_volume(pod: Doc) -> Doc:
    return next(v for v in pod["volumes"] if v["name"] == API_VOLUME)


def kubelet_service_account_dir(pod: Doc, container: Doc, root: Path, meta: Doc) -> Path:
    """A directory with what the kubelet puts at SERVICE_ACCOUNT_DIR in ``container`` of ``pod`` (metadata
    ``meta``): the automount's token, CA and namespace when the pod leaves the automount on, else the projected
    volume the container mounts there, if any. The token is the one FakeKubeAPI knows: the account's user."""
    out = root / container["name"]
    out.mkdir(parents=True)
    if pod.get("automountServiceAccountToken", True):
        sources = AUTOMOUNT_SOURCES
    else:
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        sources = [s for m in container.get("volumeMounts", []) if m["mountPath"] == str(SERVICE_ACCOUNT_DIR)
                   for s in volumes[m["name"]]["projected"]["sources"]]
    user = f"system:serviceaccount:{meta['namespace']}:{pod.get('serviceAccountName', 'default')}"
    for path, source in source_files(sources).items():
        if "serviceAccountToken" in source:
            (out / path).write_text(user + "\n")
        elif "configMap" in source:
            assert source["configMap"]["name"] == "kube-root-ca.crt"
            (out / path).write_text("-----BEGIN CERTIFICATE-----\n")  # unused: the fake API is http
        else:
            (out / path).write_text(meta[source["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"].split(".")[1]])
    return out


class FakeKubeAPI(QuietHandler):
    """GET /api/v1/namespaces/<ns>/pods/<name> as the API server answers it: the bearer token is a service
    account's name (system:serviceaccount:<ns>:<name>), authorized by the RBAC objects of ``docs``."""
    docs: List[Doc] = []
    pods: Dict[Tuple[str, str], Doc] = {}
    requests: List[str] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        match = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", self.path)
        user = self.headers.get("Authorization", "").removeprefix("Bearer ").split(":")
        if len(user) != 4 or user[:2] != ["system", "serviceaccount"]:
            return self.send_json(401, {"reason": "Unauthorized"})
        if match is None or ("get", "", "pods", ()) not in granted(self.docs, match.group(1), user[3]) \
                or user[2] != match.group(1):
            return self.send_json(403, {"reason": "Forbidden"})
        pod = self.pods.get((match.group(1), match.group(2)))
        self.send_json(200 if pod else 404, pod or {"reason": "NotFound"})


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_the_sidecar_gets_an_oom_kill_from_the_api_with_the_shipped_rights(name: str, tmp_path: Path) -> None:
    """The agent's reader, configured from the sidecar's environment as the kubelet resolves it, asks a fake
    API server that authorizes with the file's RBAC objects, for a pod whose trainer was OOM-killed."""
    docs = load_yaml(EXAMPLES / name)
    doc = workload(name)
    namespace = doc["metadata"]["namespace"]
    pod = example_pods(doc)[0]
    agent, trainer = agent_and_trainer(pod)
    meta = {"name": "train-abc12", "namespace": namespace}
    env = {e["name"]: e["value"] if "value" in e else meta[e["valueFrom"]["fieldRef"]["fieldPath"].split(".")[1]]
           for e in agent["env"] if e["name"] in ("TRAINGUARD_AGENT_POD_CONTAINER", "POD_NAME", "POD_NAMESPACE")}
    status = {"initContainerStatuses": [{"name": c["name"], "restartCount": 0, "state": {"running": {}}}
                                        for c in pod.get("initContainers", [])],
              "containerStatuses": [{"name": c["name"], "restartCount": 0, "state": {"running": {}}}
                                    for c in pod["containers"]]}
    for entry in status["containerStatuses"]:
        if entry["name"] == trainer["name"]:
            entry["state"] = {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                             "finishedAt": "2025-01-01T00:00:00Z"}}
    # what the kubelet puts where the agent reads it: the agent's projected volume; the trainer gets nothing
    account_dir = kubelet_service_account_dir(pod, agent, tmp_path / "pod", meta)
    assert sorted(f.name for f in account_dir.iterdir()) == ["ca.crt", "namespace", "token"]
    assert (account_dir / "namespace").read_text() == namespace
    trainer_dir = kubelet_service_account_dir(pod, trainer, tmp_path / "pod", meta)
    assert not any(trainer_dir.iterdir())
    leaky = dict(pod, automountServiceAccountToken=True)  # as before: the automount, into every container
    leaky_dir = kubelet_service_account_dir(leaky, trainer, tmp_path / "automount", meta)
    FakeKubeAPI.pods = {(namespace, meta["name"]): {"kind": "Pod", "metadata": meta, "spec": pod, "status": status}}
    FakeKubeAPI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKubeAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = KubeConfig.from_environment(env, api=f"http://127.0.0.1:{server.server_address[1]}",
                                             service_account=account_dir)
        FakeKubeAPI.docs = docs
        reader = PodStatusReader(config, env["TRAINGUARD_AGENT_POD_CONTAINER"])
        end = reader.read()
        assert reader.error == "" and FakeKubeAPI.requests == [f"/api/v1/namespaces/{namespace}/pods/train-abc12"]
        assert end is not None and (end.container, end.exit_code, end.signal, end.telling_reason) == \
            (trainer["name"], 137, 9, "OOMKilled")
        # the trainer's code, with what it has, cannot (with the automount it could)
        api = f"http://127.0.0.1:{server.server_address[1]}"
        as_trainer = PodStatusReader(KubeConfig.from_environment(env, api=api, service_account=trainer_dir),
                                     env["TRAINGUARD_AGENT_POD_CONTAINER"])
        assert as_trainer.read() is None and "HTTP 401" in as_trainer.error
        with_automount = PodStatusReader(KubeConfig.from_environment(env, api=api, service_account=leaky_dir),
                                         env["TRAINGUARD_AGENT_POD_CONTAINER"])
        assert with_automount.read() == end
        # without the RoleBinding the API refuses, and the reader says what to give
        FakeKubeAPI.docs = [d for d in docs if d["kind"] != "RoleBinding"]
        assert reader.read() is None and "HTTP 403" in reader.error and "'get' on pods" in reader.error
    finally:
        server.shutdown()
        server.server_close()


def fake_bin(tmp_path: Path, name: str, script: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / name).write_text("#!/bin/bash\n" + script)
    (bindir / name).chmod(0o755)
    return bindir


def test_the_pytorchjob_sidecar_gets_the_rank_the_operator_gives_the_trainer(tmp_path: Path) -> None:
    """The training operator: RANK = index for the master, index + 1 for a worker (master present);
    WORLD_SIZE = all replicas. The agent's command computes the same from the pod's labels."""
    doc = workload("pytorchjob.yaml")
    specs = doc["spec"]["pytorchReplicaSpecs"]
    world = sum(r["replicas"] for r in specs.values())
    bindir = fake_bin(tmp_path, "trainguard", 'echo "$1 RANK=$RANK WORLD_SIZE=$WORLD_SIZE"\n')
    for replica_type, spec in specs.items():
        agent, _ = agent_and_trainer(spec["template"]["spec"])
        env = env_of(agent)
        assert env["WORLD_SIZE"] == str(world)
        for index in range(spec["replicas"]):
            expected = index if replica_type == "Master" else index + 1
            out = subprocess.run(agent["command"] + agent["args"], capture_output=True, text=True, timeout=10,
                                 env={"PATH": f"{bindir}:/usr/bin:/bin", "WORLD_SIZE": env["WORLD_SIZE"],
                                      "TG_REPLICA_TYPE": replica_type.lower(), "TG_REPLICA_INDEX": str(index)})
            assert out.stdout.strip() == f"agent RANK={expected} WORLD_SIZE={world}", out.stderr


def trainer_script(name: str) -> List[str]:
    doc = workload(name)
    scripts = {json.dumps(agent_and_trainer(pod)[1]["command"] + agent_and_trainer(pod)[1]["args"])
               for pod in example_pods(doc)}
    (script,) = scripts
    return json.loads(script)


FAKE_PYTHON = """\
if [ "${FAKE_HANG:-}" = 1 ]; then
  trap 'echo "terminated at step 7" >&2; kill "$child" 2>/dev/null; exit 143' TERM
  echo "step 1 loss 2.3"
  echo "hanging at step 7"
  sleep 30 & child=$!
  wait
fi
echo "step 1 loss 2.3"
for i in $(seq 1 3000); do echo "step $i"; done
echo "RuntimeError: CUDA out of memory (last line)" >&2
exit "${FAKE_RC:-3}"
"""


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_the_trainers_command_writes_its_exit_code_once_its_log_is_complete(name: str, tmp_path: Path) -> None:
    command = trainer_script(name)
    assert command[:2] == ["/bin/bash", "-c"]
    logs = tmp_path / "logs"
    logs.mkdir()
    script = command[2].replace("dir=/var/log/train", f"dir={logs}")
    assert script != command[2]
    bindir = fake_bin(tmp_path, "python", FAKE_PYTHON)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "RANK": "1"}
    (logs / "exit-code").write_text("0\n")  # a previous attempt's: removed at start
    proc = subprocess.run(["/bin/bash", "-c", script], env={**env, "FAKE_RC": "3"}, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 3
    assert (logs / "exit-code").read_text() == "3\n"
    log = (logs / "rank-1.log").read_text().splitlines()
    assert log[0] == "step 1 loss 2.3" and log[-1] == "RuntimeError: CUDA out of memory (last line)"
    assert len(log) == 3002 and "step 3000" in proc.stdout  # also in the pod's log
    assert not (logs / "exit-code.tmp").exists()

    # SIGTERM (the pod is deleted, the Job's deadline): passed on to the trainer, its code recorded
    (logs / "exit-code").unlink()
    shell = subprocess.Popen(["/bin/bash", "-c", script], env={**env, "FAKE_HANG": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # the trainer's line of this run (the log keeps the first run's: tee -a); the wrapper set its trap right
    # after starting the trainer, and the trainer set its own before printing it
    deadline = time.monotonic() + 30
    while "hanging at step 7" not in (logs / "rank-1.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hanging at step 7" in (logs / "rank-1.log").read_text()
    time.sleep(0.2)
    shell.send_signal(signal.SIGTERM)
    assert shell.wait(timeout=10) == 143
    assert (logs / "exit-code").read_text() == "143\n"
    assert (logs / "rank-1.log").read_text().splitlines()[-1] == "terminated at step 7"


@pytest.mark.parametrize("name", sorted(EXAMPLE_K8S))
def test_trainguard_agent_reads_the_sidecars_environment(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`trainguard agent` as the sidecar starts it: every TRAINGUARD_AGENT_* variable lands in its option."""
    doc = workload(name)
    for pod in example_pods(doc):
        agent, _ = agent_and_trainer(pod)
        env = {k: v for k, v in env_of(agent).items() if isinstance(v, str)}
        for key in list(os.environ):
            if key.startswith("TRAINGUARD_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("TRAINGUARD_TOKEN", "tg_ingest_0123456789abcdef_" + "0" * 48)  # from the Secret
        args = build_parser().parse_args(["agent"])  # the options' defaults read the environment
        assert resolve_env(args) == ""  # ... the numeric ones when the agent runs
        assert args.command == [] and args.upstream == env["TRAINGUARD_AGENT_UPSTREAM"]
        assert args.token == os.environ["TRAINGUARD_TOKEN"]
        assert (args.listen, args.listen_grpc) == (env["TRAINGUARD_AGENT_LISTEN"], env["TRAINGUARD_AGENT_LISTEN_GRPC"])
        assert args.spool_dir == env["TRAINGUARD_AGENT_SPOOL_DIR"]
        assert args.exit_file == env["TRAINGUARD_AGENT_EXIT_FILE"]
        assert args.pod_container == env["TRAINGUARD_AGENT_POD_CONTAINER"]
        assert (args.kube_api, args.pod_poll_s) == ("", 2.0)  # in-cluster, the default poll
        assert args.watch_process == env.get("TRAINGUARD_AGENT_WATCH_PROCESS", "")
        assert args.hang_floor_s == float(env["TRAINGUARD_AGENT_HANG_FLOOR_S"])
        used = {k for k in env if k.startswith("TRAINGUARD_AGENT_")}
        options = {"TRAINGUARD_AGENT_" + a.upper() for a in vars(args)} | {"TRAINGUARD_AGENT_LOG_FILES"}
        assert used <= options, used - options
        if "TRAINGUARD_AGENT_WATCH_PROCESS" in env:
            trainer_cmd = next(c for c in pod["containers"] if c is not agent)["args"][0]
            assert re.search(env["TRAINGUARD_AGENT_WATCH_PROCESS"], "python train.py --epochs 90")
            assert "python train.py --epochs 90" in trainer_cmd


@pytest.mark.parametrize("case", ["default", "flink"])
def test_the_install_notes_say_where_to_send_and_how_to_get_the_tokens(case: str) -> None:
    # Helm 4's client-side dry run renders NOTES.txt without a cluster (Helm 3's still asks for one)
    args = ["install", "trainguard", str(CHART), "--dry-run=client", "--namespace", "trainguard"]
    notes = helm("helm4", *(args + (["-f", str(CHART / CASES[case])] if CASES[case] else []))).stdout  # type: ignore[operator]
    notes = notes[notes.index("NOTES:"):]
    assert "http://trainguard-gateway.trainguard.svc:4318" in notes
    assert "get secret trainguard-tokens -o jsonpath='{.data.ingest-token}'" in notes
    assert ("FlinkDeployment trainguard-flink" in notes) == (case == "flink")
