"""Rendering helm/cosine with the real Helm engine (helm-python-sdk) for the chart tests.

No helm binary and no cluster run here: a render is `helm template` (install mode) done by Helm's own
engine, with the API versions a cluster would report passed in as Helm's .Capabilities. Where a test
stands in for `helm install`, it is this render, then validation against the Kubernetes schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "cosine"
K8S = ROOT / "k8s"
# The example values files of k8s/ (the other files there configure other charts).
# (keyed "gpu-pools", not "gpu": tests/conftest.py skips tests whose id holds the keyword gpu without a GPU)
EXAMPLES = {"cpu-only": K8S / "cpu-only.yaml", "gpu-pools": K8S / "gpu.yaml"}
RELEASE = "cosine"
NAMESPACE = "cosine"
# Values beyond the examples that switch on the chart's other branches.
VARIANTS = {
    "external-redis-pvc": {"redis": {"bundled": False, "externalUrl": "redis://redis.shared:6379/2"},
                           "models": {"storage": {"type": "pvc"}}, "autoscaling": {"metricsMode": "external"}},
    "image-models-no-extras": {"models": {"storage": {"type": "image"}}, "networkPolicy": {"enabled": False},
                               "router": {"autoscaling": {"enabled": False}, "monitoring": {"serviceMonitor": False}},
                               "redis": {"bundled": True, "persistence": {"enabled": True}},
                               "image": {"digest": "sha256:" + "0" * 64}},
    "hostpath-own-keys": {"models": {"storage": {"type": "hostPath"}}, "router": {"apiKeys": {"existingSecret": "cosine-keys"}},
                          "verifier": {"maxSlots": 64}, "drafterDefaults": {"slots": 8}},
    "no-auth": {"router": {"apiKeys": {"enabled": False}}},
    "tls": {"tls": {"enabled": True, "secretName": "cosine-tls"}},
}

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')")

# The custom resources' APIs a cluster with KEDA and the Prometheus Operator serves (.Capabilities.APIVersions);
# a render name ending in NO_CRDS gets none of them, as on a bare cluster.
CRD_APIS = ["keda.sh/v1alpha1", "keda.sh/v1alpha1/ScaledObject",
            "monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor"]
NO_CRDS = "@no-crds"


def load_values(name: str) -> dict:
    name = name.removesuffix(NO_CRDS)
    if name == "default":
        return {}
    if name in EXAMPLES:
        return yaml.safe_load(EXAMPLES[name].read_text()) or {}
    return VARIANTS[name]


def render_raw(values: dict | None = None, api_versions: list[str] | None = None, kube_version: str | None = None) -> dict[str, str]:
    """template path -> rendered text; `api_versions` beyond Kubernetes' own as a cluster reports them (default: CRD_APIS)."""
    from helm_python import _native  # Chart.render does not pass api_versions on; the engine takes them

    options = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True,
               "api_versions": CRD_APIS if api_versions is None else api_versions}
    if kube_version:
        options["kube_version"] = kube_version
    with helm.Chart.load(CHART) as chart:
        return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(options)))


def render(values: dict | None = None, api_versions: list[str] | None = None) -> list[dict]:
    """Every manifest the chart renders, each with `__template__` (the template it came from)."""
    out = render_raw(values, api_versions)
    docs = []
    for template, text in sorted(out.items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template__"] = template
                docs.append(doc)
    return docs


def notes(values: dict | None = None, api_versions: list[str] | None = None) -> str:
    out = render_raw(values, api_versions)
    return next(text for name, text in out.items() if name.endswith("NOTES.txt"))


def apis_of(name: str) -> list[str]:
    return [] if name.endswith(NO_CRDS) else CRD_APIS


VALUES_NAMES = ["default", *EXAMPLES, *VARIANTS]
# every values file on a cluster with KEDA and the Prometheus Operator, and on one without either
RENDER_NAMES = [*VALUES_NAMES, *(n + NO_CRDS for n in VALUES_NAMES)]


@pytest.fixture(scope="session")
def renders() -> dict[str, list[dict]]:
    """name -> rendered manifests, for the default values, each example values file and the variants."""
    return {name: render(load_values(name), apis_of(name)) for name in RENDER_NAMES}


def manifest(doc: dict) -> dict:
    """The manifest without the test's bookkeeping key."""
    return {k: v for k, v in doc.items() if k != "__template__"}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """component label -> pod spec of every Deployment and StatefulSet."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
