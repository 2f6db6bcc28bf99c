"""Endpoints of CoSine roles learnt from Kubernetes EndpointSlices, so callers follow scaling.

The chart gives every role a Service (DNS, configured by environment); with
several verifier or drafter pods behind one ClusterIP, a long-lived gRPC channel
still lands on one pod. This module lists and watches the EndpointSlices of the
release's Services and yields the ready pod addresses of each role's `grpc`
port, e.g. to build `FusionSettings.drafters` ("NAME=HOST:PORT,...") or one
channel per verifier pod. It needs the `kubernetes` client and, in the pod, a
service account allowed to list/watch `endpointslices` (discovery.k8s.io).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
COMPONENT_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
PORT_NAME = "grpc"


@dataclass
class RoleEndpoints:
    """The ready addresses of one role, merged over its EndpointSlices."""

    component: str
    service: str
    slices: dict[str, list[str]] = field(default_factory=dict)  # slice name -> "ip:port" entries

    @property
    def addresses(self) -> list[str]:
        return sorted({a for addrs in self.slices.values() for a in addrs})


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Attribute of a kubernetes client model, or key of the dict a raw watch event carries."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        camel = name.split("_")[0] + "".join(p.title() for p in name.split("_")[1:])
        return obj.get(name, obj.get(camel, default))
    return getattr(obj, name, default)


def ready_addresses(endpoint_slice: Any, port_name: str = PORT_NAME) -> list[str]:
    """'ip:port' of every ready (or, when `ready` is unset, serving) endpoint of the named port."""
    port = next((_get(p, "port") for p in _get(endpoint_slice, "ports") or [] if _get(p, "name") == port_name), None)
    if port is None:
        return []
    family = _get(endpoint_slice, "address_type", "IPv4")
    out = []
    for endpoint in _get(endpoint_slice, "endpoints") or []:
        conditions = _get(endpoint, "conditions")
        ready = _get(conditions, "ready")
        if ready is None:  # unknown: Kubernetes says to treat it as ready
            ready = not _get(conditions, "terminating", False)
        if not ready:
            continue
        for ip in _get(endpoint, "addresses") or []:
            out.append(f"[{ip}]:{port}" if family == "IPv6" else f"{ip}:{port}")
    return out


class EndpointSliceDiscovery:
    """Ready gRPC endpoints of one release's roles, kept current from EndpointSlice list + watch."""

    def __init__(self, api: Any, namespace: str, release: str, port_name: str = PORT_NAME):
        self.api = api  # a kubernetes.client.DiscoveryV1Api (or anything with list_namespaced_endpoint_slice)
        self.namespace = namespace
        self.release = release
        self.port_name = port_name
        self.roles: dict[str, RoleEndpoints] = {}
        self.resource_version: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def in_cluster(cls, namespace: str, release: str) -> "EndpointSliceDiscovery":
        from kubernetes import client, config

        config.load_incluster_config()
        return cls(client.DiscoveryV1Api(), namespace, release)

    @property
    def label_selector(self) -> str:
        return f"{INSTANCE_LABEL}={self.release}"

    def apply(self, event_type: str, endpoint_slice: Any) -> bool:
        """Apply one ADDED/MODIFIED/DELETED slice; returns whether any role's addresses changed."""
        meta = _get(endpoint_slice, "metadata")
        labels = _get(meta, "labels") or {}
        component, service = labels.get(COMPONENT_LABEL), labels.get(SERVICE_NAME_LABEL)
        name = _get(meta, "name")
        if not component or not service or not name:
            return False
        with self._lock:
            role = self.roles.setdefault(component, RoleEndpoints(component, service))
            before = role.addresses
            if event_type == "DELETED":
                role.slices.pop(name, None)
            else:
                role.slices[name] = ready_addresses(endpoint_slice, self.port_name)
            return role.addresses != before

    def refresh(self) -> dict[str, list[str]]:
        """List the release's slices anew; returns component -> addresses."""
        result = self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.label_selector)
        with self._lock:
            self.roles.clear()
        for item in _get(result, "items") or []:
            self.apply("ADDED", item)
        self.resource_version = _get(_get(result, "metadata"), "resource_version")
        return self.snapshot()

    def snapshot(self) -> dict[str, list[str]]:
        with self._lock:
            return {c: r.addresses for c, r in sorted(self.roles.items())}

    def addresses(self, component: str) -> list[str]:
        with self._lock:
            role = self.roles.get(component)
            return role.addresses if role else []

    def drafters(self) -> dict[str, list[str]]:
        """drafter name -> ready addresses (components are named drafter-NAME by the chart)."""
        return {c.removeprefix("drafter-"): a for c, a in self.snapshot().items() if c.startswith("drafter-")}

    def fusion_drafters(self) -> str:
        """FusionSettings.drafters for the current pods: one NAME=HOST:PORT per drafter (its first ready pod)."""
        return ",".join(f"{name}={addrs[0]}" for name, addrs in sorted(self.drafters().items()) if addrs)

    def watch(self, on_change: Callable[[dict[str, list[str]]], None], stop: threading.Event,
              watch_factory: Callable[[], Any] | None = None, timeout_s: int = 300) -> None:
        """List, then follow changes until `stop` is set; calls on_change(snapshot) after each change.

        A watch that expires (410 Gone) or drops is resumed with a fresh list.
        """
        if watch_factory is None:
            from kubernetes import watch

            watch_factory = watch.Watch
        on_change(self.refresh())
        while not stop.is_set():
            w = watch_factory()
            try:
                for event in w.stream(self.api.list_namespaced_endpoint_slice, self.namespace,
                                      label_selector=self.label_selector, resource_version=self.resource_version,
                                      timeout_seconds=timeout_s):
                    if stop.is_set():
                        break
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        raise RuntimeError(f"watch error: {obj}")
                    self.resource_version = _get(_get(obj, "metadata"), "resource_version") or self.resource_version
                    if self.apply(kind, obj):
                        on_change(self.snapshot())
            except Exception as exc:  # noqa: BLE001 - re-list and resume, whatever the API said
                log.warning("EndpointSlice watch interrupted (%s); listing again", exc)
                if stop.is_set():
                    break
                on_change(self.refresh())
            finally:
                w.stop()


def addresses_of(discovery: EndpointSliceDiscovery, components: Iterable[str]) -> dict[str, list[str]]:
    snapshot = discovery.snapshot()
    return {c: snapshot.get(c, []) for c in components}
