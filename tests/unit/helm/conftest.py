"""Rendering helm/cosine with the real Helm engine (helm-python-sdk) for the chart tests."""

from __future__ import annotations

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
}

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')")


def load_values(name: str) -> dict:
    if name == "default":
        return {}
    if name in EXAMPLES:
        return yaml.safe_load(EXAMPLES[name].read_text()) or {}
    return VARIANTS[name]


def render(values: dict | None = None) -> list[dict]:
    """Every manifest the chart renders, each with `__template__` (the template it came from)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for template, text in sorted(out.items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template__"] = template
                docs.append(doc)
    return docs


def notes(values: dict | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for name, text in out.items() if name.endswith("NOTES.txt"))


RENDER_NAMES = ["default", *EXAMPLES, *VARIANTS]


@pytest.fixture(scope="session")
def renders() -> dict[str, list[dict]]:
    """name -> rendered manifests, for the default values, each example values file and the variants."""
    return {name: render(load_values(name)) for name in RENDER_NAMES}


def manifest(doc: dict) -> dict:
    """The manifest without the test's bookkeeping key."""
    return {k: v for k, v in doc.items() if k != "__template__"}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """component label -> pod spec of every Deployment and StatefulSet."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
