"""checkov scans the rendered manifests (every values set) and the Dockerfile: no failed check;
every skip is an annotation (chart) or comment (Dockerfile) with a written reason.

checkov pins packaging, networkx, importlib-metadata... below what the project's environment has,
so it runs from its own virtualenv: $COSINE_CHECKOV (a checkov executable), else `checkov` on PATH,
else one this fixture creates under ~/.cache/cosine-tests (first run: about a minute of pip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, RENDER_NAMES, manifest

pytestmark = pytest.mark.unit

CHECKOV_VERSION = "3.3.30"
VENV = Path.home() / ".cache" / "cosine-tests" / f"checkov-{CHECKOV_VERSION}"


@pytest.fixture(scope="session")
def checkov() -> str:
    explicit = os.environ.get("COSINE_CHECKOV") or shutil.which("checkov")
    if explicit:
        return explicit
    binary = VENV / "bin" / "checkov"
    if not binary.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=120)
            subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"checkov=={CHECKOV_VERSION}"],
                           check=True, capture_output=True, text=True, timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(VENV, ignore_errors=True)
            pytest.skip(f"could not install checkov into its own virtualenv: {getattr(exc, 'stderr', exc)!s:.300}")
    return str(binary)


def run_checkov(checkov: str, *args: str) -> list[dict]:
    # --skip-download: no network to the vendor's API; the checks themselves ship with checkov
    proc = subprocess.run([checkov, *args, "--skip-download", "-o", "json"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, BC_SKIP_MAPPING="TRUE", LOG_LEVEL="ERROR"))
    assert proc.stdout.strip(), proc.stderr[-2000:]
    reports = json.loads(proc.stdout)
    return reports if isinstance(reports, list) else [reports]


def failures(reports: list[dict]) -> list[str]:
    return [f"{f['check_id']} {f['resource']} ({f['file_path']}): {f['check_name']}"
            for r in reports for f in r["results"]["failed_checks"]]


def test_rendered_manifests_pass_checkov(checkov, renders, tmp_path):
    for name in RENDER_NAMES:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all([manifest(d) for d in renders[name]]))
    reports = run_checkov(checkov, "-d", str(tmp_path), "--framework", "kubernetes")
    assert reports[0]["summary"]["resource_count"] > 100
    assert reports[0]["summary"]["parsing_errors"] == 0
    assert not failures(reports), "\n".join(failures(reports))
    for skipped in (s for r in reports for s in r["results"].get("skipped_checks", [])):
        assert len(skipped["check_result"].get("suppress_comment", "")) > 20, skipped["check_id"]


def test_dockerfile_passes_checkov(checkov):
    reports = run_checkov(checkov, "-f", str(ROOT / "Dockerfile"), "--framework", "dockerfile")
    assert not failures(reports), "\n".join(failures(reports))
    assert reports[0]["summary"]["passed"] > 10
