"""k8s/ monitoring files refer only to metrics the services export (names grepped from services/)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from .conftest import K8S, ROOT

pytestmark = pytest.mark.unit

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def exported_metrics() -> set[str]:
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r'(?:Counter|Histogram|Gauge)\(\s*"(cosine_[a-z_]+)"', path.read_text()))
    return names


def referenced(text: str) -> set[str]:
    return set(re.findall(r"\b(cosine_[a-z_]+)\b", text))


def known(name: str, exported: set[str]) -> bool:
    base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
    return name in exported or base in exported


def test_dashboard_queries_exported_metrics():
    dashboard = json.loads((K8S / "grafana" / "cosine-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exported = exported_metrics()
    assert {"cosine_rpc_total", "cosine_router_time_to_first_token_seconds", "cosine_scheduler_rounds_total"} <= exported
    names = set().union(*map(referenced, exprs))
    assert names and all(known(n, exported) for n in names), sorted(n for n in names if not known(n, exported))
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_rules_and_adapter_query_exported_metrics():
    exported = exported_metrics()
    rules = yaml.safe_load((K8S / "keda" / "prometheus-rules.yaml").read_text())
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    exprs += [r["seriesQuery"] for r in adapter["rules"]["external"]]
    for name in set().union(*map(referenced, exprs)):
        assert known(name, exported), name
    chart_values = yaml.safe_load((ROOT / "helm" / "cosine" / "values.yaml").read_text())
    external = {m["external"]["name"] for m in chart_values["verifier"]["autoscaling"]["metrics"] + chart_values["drafterDefaults"]["autoscaling"]["metrics"]}
    assert external <= {r["name"]["as"] for r in adapter["rules"]["external"]}
