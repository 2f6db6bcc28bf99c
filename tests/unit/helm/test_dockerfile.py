"""What can be checked of the Dockerfile without a Docker engine (none runs here): multi-stage,
the final stage holds no build tools and runs as a numeric non-root user, the CUDA variant is a
build argument installing the same torch version, and the entrypoint serves any of the five
services by argument."""

from __future__ import annotations

import re
import tomllib

import pytest

from cosine.cli import SERVICES

from .conftest import ROOT

pytestmark = pytest.mark.unit

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def stages() -> dict[str, list[str]]:
    """stage name -> its instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            current = line.split()[-1]
            out[current] = []
        if current:
            out[current].append(line)
    return out


def test_multi_stage_with_a_lean_non_root_runtime():
    s = stages()
    assert list(s) == ["build", "runtime"]
    runtime = "\n".join(s["runtime"])
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    for tool in ("gcc", "build-essential", "apt-get install", "pip install", "git "):
        assert tool not in runtime, tool
    user = [i for i in s["runtime"] if i.startswith("USER ")][-1].split()[1]
    assert re.fullmatch(r"[1-9][0-9]{3,}(:[0-9]+)?", user), "numeric non-root user (runAsNonRoot needs a number)"
    assert s["runtime"][-1] == 'CMD ["serve", "router"]' and 'ENTRYPOINT ["cosine"]' in s["runtime"]


def test_torch_pin_and_cuda_variant():
    pinned = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"] if d.startswith("torch"))
    version = pinned.split("==")[1]
    build = "\n".join(stages()["build"])
    assert f"ARG TORCH_VERSION={version}" in build and '"torch==${TORCH_VERSION}"' in build
    assert 'if [ "$VARIANT" = "cuda" ]' in build and "ARG VARIANT=cpu" in build
    # torch first, then the project, whose pin the installed build satisfies
    assert build.index("torch==${TORCH_VERSION}") < build.index("pip install . ")


def test_entrypoint_serves_every_service():
    assert set(SERVICES) == {"router", "scheduler", "fusion", "drafter", "verifier"}
    from cosine.cli import build_parser

    for service in SERVICES:
        args = build_parser().parse_args(["serve", service, "--port", "1"])
        assert args.service == service and args.args == ["--port", "1"]


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "tests", "helm", "k8s"} <= set(ignored)
    assert "services" not in ignored and "protos" not in ignored
