"""Render the Helm chart and validate Kubernetes manifests offline, with the tools `make test` installs
(tools/k8s_tools.py, into .venv/k8s-tools): Helm 3 and 4, kubernetes-validate's JSON schemas, a strict
PyTorchJob schema built from the Kubeflow training SDK's generated models, and the FlinkDeployment
validator generated from the Flink Kubernetes Operator's CRD (npm, run with Node.js).

A missing tool is an error that says how to install it, never a skip."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "trainguard"
TOOLS = Path(os.environ.get("TRAINGUARD_K8S_TOOLS", Path(sys.prefix) / "k8s-tools"))
HELMS = ("helm3", "helm4")
KUBEFLOW_WHEEL = "kubeflow_training-1.9.4-py3-none-any.whl"
FLINK_MODELS = TOOLS / "node" / "node_modules" / "@kubernetes-models" / "flink"
Doc = Dict[str, Any]


def require_tools() -> None:
    missing = [p for p in [*(TOOLS / h for h in HELMS), TOOLS / KUBEFLOW_WHEEL, FLINK_MODELS] if not p.exists()]
    if missing:
        raise RuntimeError(f"missing {', '.join(map(str, missing))}: `make test` installs them "
                           f"({sys.executable} tools/k8s_tools.py {TOOLS})")


def helm(which: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    require_tools()
    proc = subprocess.run([str(TOOLS / which), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"{which} {' '.join(args)} failed:\n{proc.stderr}")
    return proc


@functools.cache
def render(values: Optional[str] = None, sets: Sequence[str] = (), which: str = "helm4",
           release: str = "trainguard", namespace: str = "trainguard") -> List[Doc]:
    """`helm template` of the chart with a values file (a path under the chart) and --set pairs."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if values:
        args += ["-f", str(CHART / values)]
    for item in sets:
        args += ["--set", item]
    return [d for d in yaml.safe_load_all(helm(which, *args).stdout) if d]


def load_yaml(path: Path) -> List[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# --- Kubernetes core schemas (kubernetes-validate, strict: unknown fields are errors) ---------------------
def validate_core(doc: Doc, version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{doc['kind']} {doc['metadata'].get('name')} invalid for Kubernetes {version}: "
                             f"{exc.message} at {'/'.join(map(str, exc.absolute_path))}") from None


@functools.cache
def _definitions(version: str) -> Doc:
    path = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}.0-local-strict"
            / "_definitions.json")
    return json.loads(path.read_text())


def validator_with_k8s_refs(schema: Doc, version: str) -> jsonschema.Draft202012Validator:
    """A validator for ``schema`` whose ``/api/_definitions.json#/$defs/...`` refs resolve to the strict
    Kubernetes definitions of ``version``."""
    registry: Registry = Resource.from_contents(_definitions(version)) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def k8s_ref(name: str) -> Doc:
    return {"$ref": f"/api/_definitions.json#/$defs/{name}"}


# --- kubeflow.org/v1 PyTorchJob: a strict schema from the training SDK's generated models ----------------
@functools.cache
def pytorchjob_schema() -> Doc:
    """Every ``KubeflowOrgV1*`` model of kubeflow-training 1.9.4 (generated from the training operator's
    OpenAPI spec) becomes a closed object of its ``attribute_map`` keys typed by its ``openapi_types``; the
    ``V1*`` types (pod templates, metadata) refer to the strict Kubernetes definitions."""
    require_tools()
    models: Dict[str, Dict[str, Dict[str, str]]] = {}
    with zipfile.ZipFile(TOOLS / KUBEFLOW_WHEEL) as whl:
        for name in whl.namelist():
            if not name.startswith("kubeflow/training/models/kubeflow_org_v1_"):
                continue
            for node in ast.walk(ast.parse(whl.read(name))):
                if isinstance(node, ast.ClassDef):
                    maps = {t.id: ast.literal_eval(n.value) for n in node.body if isinstance(n, ast.Assign)
                            for t in n.targets if isinstance(t, ast.Name)
                            and t.id in ("openapi_types", "attribute_map")}
                    models[node.name] = maps
    k8s_names = {"V1ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
                 "V1PodTemplateSpec": "io.k8s.api.core.v1.PodTemplateSpec",
                 "V1Time": "io.k8s.apimachinery.pkg.apis.meta.v1.Time",
                 "Quantity": "io.k8s.apimachinery.pkg.api.resource.Quantity"}

    def typed(t: str) -> Doc:
        if t.startswith("list["):
            return {"type": "array", "items": typed(t[5:-1])}
        if t.startswith("dict(str, "):
            return {"type": "object", "additionalProperties": typed(t[10:-1])}
        simple = {"str": "string", "int": "integer", "bool": "boolean", "float": "number", "datetime": "string"}
        if t in simple:
            return {"type": simple[t]}
        if t == "object":
            return {}
        if t in models:
            return {"$ref": f"#/$defs/{t}"}
        if t in k8s_names:
            return k8s_ref(k8s_names[t])
        if t.startswith("V1"):  # any other core type: resolve by its short name
            return k8s_ref(_k8s_def_name(t[2:]))
        api = re.fullmatch(r"K8sIoApi([A-Z][a-z0-9]*)(V\d+(?:[a-z]+\d+)?)(\w+)", t)  # e.g. autoscaling/v2 types
        if api:
            name = f"io.k8s.api.{api.group(1).lower()}.{api.group(2).lower()}.{api.group(3)}"
            assert name in _definitions("1.37")["$defs"], name
            return k8s_ref(name)
        raise AssertionError(f"unknown type {t} in the Kubeflow models")

    defs: Dict[str, Doc] = {name: {"type": "object", "additionalProperties": False,
                   "properties": {m["attribute_map"][attr]: typed(t) for attr, t in m["openapi_types"].items()}}
            for name, m in models.items()}
    root: Doc = dict(defs["KubeflowOrgV1PyTorchJob"])
    root["properties"] = {**root["properties"], "apiVersion": {"const": "kubeflow.org/v1"},
                          "kind": {"const": "PyTorchJob"}}
    root["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://kubernetes.io/api/pytorchjob/kubeflow/v1", **root, "$defs": defs}


def _k8s_def_name(short: str) -> str:
    hits = [k for k in _definitions("1.37")["$defs"] if k.endswith(f".v1.{short}")]
    assert len(hits) == 1, (short, hits)
    return hits[0]


def validate_pytorchjob(doc: Doc, version: str) -> None:
    errors = sorted(validator_with_k8s_refs(pytorchjob_schema(), version).iter_errors(doc), key=str)
    if errors:
        raise AssertionError(f"PyTorchJob {doc['metadata'].get('name')} invalid (Kubernetes {version}): "
                             + "; ".join(f"{e.message} at {'/'.join(map(str, e.absolute_path))}" for e in errors))


# --- flink.apache.org/v1beta1 FlinkDeployment -----------------------------------------------------------
# The fields of the operator's FlinkDeploymentSpec (release 1.14) that may be set, per level: the generated
# validator checks types and enums but, like the API server's pruning, not unknown fields; these lists are
# checked against the package's type declarations by the tests.
FLINK_FIELDS = {
    "spec": {"flinkConfiguration", "flinkVersion", "image", "imagePullPolicy", "ingress", "job", "jobManager",
             "logConfiguration", "mode", "podTemplate", "restartNonce", "serviceAccount", "taskManager"},
    "job": {"allowNonRestoredState", "args", "autoscalerResetNonce", "checkpointTriggerNonce", "entryClass",
            "initialSavepointPath", "jarURI", "parallelism", "savepointRedeployNonce", "savepointTriggerNonce",
            "state", "upgradeMode"},
    "jobManager": {"podTemplate", "replicas", "resource"},
    "taskManager": {"podTemplate", "replicas", "resource"},
    "resource": {"cpu", "ephemeralStorage", "memory"},
}

_NODE_VALIDATE = """
import { pathToFileURL } from "node:url";
const mod = await import(pathToFileURL(process.argv[1] + "/flink.apache.org/v1beta1/FlinkDeployment.js").href);
let input = "";
for await (const chunk of process.stdin) input += chunk;
const out = JSON.parse(input).map((doc) => {
  try { new mod.FlinkDeployment(doc).validate(); return null; } catch (e) { return String(e.message); }
});
console.log(JSON.stringify(out));
"""


def validate_flinkdeployments(docs: Iterable[Doc], version: str) -> None:
    """The CRD's generated validator (types, enums, required), closed field lists for the levels above, and
    the pod templates against the strict core Pod schema."""
    docs = list(docs)
    require_tools()
    proc = subprocess.run(["node", "--input-type=module", "-e", _NODE_VALIDATE, str(FLINK_MODELS)],
                          input=json.dumps(docs), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for doc, error in zip(docs, json.loads(proc.stdout)):
        assert error is None, f"FlinkDeployment {doc['metadata']['name']}: {error}"
        spec = doc["spec"]
        levels = [("spec", spec), ("job", spec.get("job", {}))]
        for manager in ("jobManager", "taskManager"):
            levels += [(manager, spec.get(manager, {})), ("resource", spec.get(manager, {}).get("resource", {}))]
        for level, obj in levels:
            unknown = set(obj) - FLINK_FIELDS[level]
            assert not unknown, f"FlinkDeployment {level}: unknown fields {sorted(unknown)}"
        templates = [spec.get("podTemplate")] + [spec.get(m, {}).get("podTemplate") for m in ("jobManager", "taskManager")]
        for template in filter(None, templates):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {}, **template}
            validate_core(pod, version)


def validate(docs: Iterable[Doc], versions: Sequence[str]) -> None:
    docs = list(docs)
    for version in versions:
        for doc in docs:
            if doc["kind"] == "PyTorchJob":
                validate_pytorchjob(doc, version)
            elif doc["kind"] != "FlinkDeployment":
                validate_core(doc, version)
        flink = [d for d in docs if d["kind"] == "FlinkDeployment"]
        if flink:
            validate_flinkdeployments(flink, version)
