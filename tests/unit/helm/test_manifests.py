"""Every rendered manifest validates against the Kubernetes OpenAPI schemas in strict mode
(kubernetes-validate) for the oldest Kubernetes the chart supports and the newest bundled one;
the custom resources (ServiceMonitor, ScaledObject), which those schemas do not cover, are
checked against the fields their operators require."""

from __future__ import annotations

import json

import pytest

from .conftest import RENDER_NAMES, manifest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

pytestmark = pytest.mark.unit

# Chart.yaml: kubeVersion >=1.27 (native gRPC probes are GA there); 1.37 is the newest schema bundled.
KUBE_VERSIONS = ["1.27", "1.37"]
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"selector", "endpoints"},
    ("keda.sh/v1alpha1", "ScaledObject"): {"scaleTargetRef", "triggers"},
}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", RENDER_NAMES)
def test_manifests_validate_strictly(renders, name, version):
    seen = set()
    failures = []
    for doc in renders[name]:
        m = manifest(doc)
        key = json.dumps(m, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        if (m["apiVersion"], m["kind"]) in CUSTOM:
            assert CUSTOM[(m["apiVersion"], m["kind"])] <= set(m["spec"]), m["metadata"]["name"]
            assert m["metadata"]["namespace"] and m["metadata"]["name"]
            continue
        try:
            kubernetes_validate.validate(m, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{m['kind']}/{m['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_strict_mode_catches_unknown_fields(renders):
    dep = next(manifest(d) for d in renders["default"] if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[0], strict=True)
