"""The images workflow (.github/workflows/images.yml) cannot run here (no runner, no Docker engine):
it is checked for what the chart depends on, that a version tag builds both Dockerfile variants under
the tags the chart pulls by default."""

from __future__ import annotations

import re

import pytest
import yaml

from .conftest import CHART, ROOT

pytestmark = pytest.mark.unit

WORKFLOW = ROOT / ".github" / "workflows" / "images.yml"


def test_tags_build_and_push_the_cpu_and_cuda_images_the_chart_pulls():
    flow = yaml.safe_load(WORKFLOW.read_text())
    triggers = flow[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["push"]["tags"] == ["v*.*.*"]
    build = flow["jobs"]["build"]
    assert build["permissions"]["packages"] == "write" and build["needs"] == "version"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    variants = {m["variant"]: m["suffix"] for m in build["strategy"]["matrix"]["include"]}
    assert variants == {"cpu": "", "cuda": values["image"]["gpuTagSuffix"]}
    step = next(s for s in build["steps"] if s.get("uses", "").startswith("docker/build-push-action"))
    assert step["with"]["file"] == "Dockerfile" and "VARIANT=${{ matrix.variant }}" in step["with"]["build-args"]
    assert "ARG VARIANT=cpu" in (ROOT / "Dockerfile").read_text()
    # image name: the chart's repository path under the repository owner's ghcr.io namespace
    assert flow["env"]["IMAGE"] == "ghcr.io/${{ github.repository_owner }}/cosine"
    assert values["image"]["repository"].startswith("ghcr.io/") and values["image"]["repository"].endswith("/cosine")
    # the pushed tag is the version the chart's default image tag follows (appVersion), checked before building
    meta = next(s for s in build["steps"] if s.get("id") == "meta")
    assert "type=raw,value=${{ needs.version.outputs.version }}" in meta["with"]["tags"]
    check = flow["jobs"]["version"]["steps"][-1]["run"]
    assert "helm/cosine/Chart.yaml" in check and "appVersion" in check
    assert values["image"]["tag"] == ""


def test_the_version_check_reads_the_charts_app_version():
    check = yaml.safe_load(WORKFLOW.read_text())["jobs"]["version"]["steps"][-1]["run"]
    sed = re.search(r"sed -n '(.+?)' helm/cosine/Chart.yaml", check).group(1)
    import subprocess

    app = subprocess.run(["sed", "-n", sed, str(CHART / "Chart.yaml")], capture_output=True, text=True, check=True).stdout.strip()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert app == chart["appVersion"] and app
