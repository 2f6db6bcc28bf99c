"""Canonical ports of every role: the Helm chart's values and the services' defaults agree with these.

Locally (`cosine up`) services take free ports; in a cluster each role listens on
its own fixed port so Services, probes, NetworkPolicies and ServiceMonitors can
name it. tests/unit/helm checks that helm/cosine/values.yaml and the rendered
environment use exactly these numbers.
"""

from __future__ import annotations

ROLES = ("router", "scheduler", "fusion", "verifier", "drafter")

# gRPC ports (drafter: every drafter Deployment, each in its own pod).
DEFAULT_PORTS: dict[str, int] = {"router": 50051, "scheduler": 50052, "fusion": 50053, "verifier": 50054, "drafter": 50060}

# Prometheus /metrics ports (--metrics-port / COSINE_<ROLE>_METRICS_PORT).
METRICS_PORTS: dict[str, int] = {"router": 9051, "scheduler": 9052, "fusion": 9053, "verifier": 9054, "drafter": 9060}

REDIS_PORT = 6379
