"""cosine.discovery against fake Kubernetes API objects: no API server runs here, so the
EndpointSlices are the kubernetes client's own model classes (V1EndpointSlice, ...) served by a
fake DiscoveryV1Api and a fake Watch; the label and port names are the chart's."""

from __future__ import annotations

import threading

import pytest

from cosine.common.ports import DEFAULT_PORTS
from cosine.discovery import EndpointSliceDiscovery, ready_addresses
from cosine.fusion.__main__ import FusionSettings

client = pytest.importorskip("kubernetes.client", reason="the kubernetes client is not installed")

pytestmark = pytest.mark.unit


def endpoint_slice(name, component, ips, ready=(True,), port=DEFAULT_PORTS["drafter"], rv="1", family="IPv4"):
    ready = list(ready) + [ready[-1]] * (len(ips) - len(ready))
    return client.V1EndpointSlice(
        address_type=family,
        metadata=client.V1ObjectMeta(name=name, resource_version=rv, labels={
            "app.kubernetes.io/instance": "cosine", "app.kubernetes.io/component": component,
            "kubernetes.io/service-name": f"cosine-{component}"}),
        ports=[client.DiscoveryV1EndpointPort(name="metrics", port=9060), client.DiscoveryV1EndpointPort(name="grpc", port=port)],
        endpoints=[client.V1Endpoint(addresses=[ip], conditions=client.V1EndpointConditions(ready=r)) for ip, r in zip(ips, ready)],
    )


class FakeDiscoveryApi:
    def __init__(self, items):
        self.items = items
        self.calls = []

    def list_namespaced_endpoint_slice(self, namespace, **kwargs):
        self.calls.append((namespace, kwargs))
        return client.V1EndpointSliceList(items=self.items, metadata=client.V1ListMeta(resource_version="10"))


class FakeWatch:
    """Replays events, then ends the stream (as a watch timing out does)."""

    def __init__(self, events, stop):
        self.events, self.stop_event = events, stop

    def stream(self, func, namespace, **kwargs):
        assert func.__name__ == "list_namespaced_endpoint_slice" and kwargs["resource_version"] == "10"
        yield from self.events
        self.stop_event.set()

    def stop(self):
        pass


def test_ready_addresses_take_the_grpc_port_and_skip_unready_pods():
    s = endpoint_slice("a", "verifier", ["10.0.0.1", "10.0.0.2"], ready=(True, False), port=DEFAULT_PORTS["verifier"])
    assert ready_addresses(s) == [f"10.0.0.1:{DEFAULT_PORTS['verifier']}"]
    v6 = endpoint_slice("b", "verifier", ["fd00::1"], family="IPv6", port=50054)
    assert ready_addresses(v6) == ["[fd00::1]:50054"]


def test_refresh_groups_slices_by_role_and_builds_fusion_drafters():
    api = FakeDiscoveryApi([
        endpoint_slice("ngram-x1", "drafter-ngram", ["10.0.1.1"]),
        endpoint_slice("lm-x1", "drafter-lm-2layer", ["10.0.2.2", "10.0.2.1"]),
        endpoint_slice("lm-x2", "drafter-lm-2layer", ["10.0.2.3"], ready=(False,)),
        endpoint_slice("v-x1", "verifier", ["10.0.3.1"], port=50054),
    ])
    d = EndpointSliceDiscovery(api, "cosine", "cosine")
    snapshot = d.refresh()
    assert api.calls == [("cosine", {"label_selector": "app.kubernetes.io/instance=cosine"})]
    assert snapshot["verifier"] == ["10.0.3.1:50054"]
    assert d.drafters() == {"ngram": ["10.0.1.1:50060"], "lm-2layer": ["10.0.2.1:50060", "10.0.2.2:50060"]}
    spec = d.fusion_drafters()
    assert FusionSettings(drafters=spec).endpoints == {"lm-2layer": "10.0.2.1:50060", "ngram": "10.0.1.1:50060"}


def test_watch_follows_scale_up_and_down():
    api = FakeDiscoveryApi([endpoint_slice("v-1", "verifier", ["10.0.3.1"], port=50054)])
    stop = threading.Event()
    scaled_up = endpoint_slice("v-1", "verifier", ["10.0.3.1", "10.0.3.2"], port=50054, rv="11")
    events = [
        {"type": "MODIFIED", "object": scaled_up},
        {"type": "MODIFIED", "object": scaled_up},  # no change: no callback
        {"type": "ADDED", "object": endpoint_slice("v-2", "verifier", ["10.0.3.9"], port=50054, rv="12")},
        {"type": "DELETED", "object": endpoint_slice("v-1", "verifier", [], port=50054, rv="13")},
    ]
    seen = []
    d = EndpointSliceDiscovery(api, "cosine", "cosine")
    d.watch(lambda snap: seen.append(snap.get("verifier", [])), stop, watch_factory=lambda: FakeWatch(events, stop))
    assert seen == [["10.0.3.1:50054"], ["10.0.3.1:50054", "10.0.3.2:50054"],
                    ["10.0.3.1:50054", "10.0.3.2:50054", "10.0.3.9:50054"], ["10.0.3.9:50054"]]
    assert d.resource_version == "13"


def test_raw_dict_events_are_understood():
    d = EndpointSliceDiscovery(FakeDiscoveryApi([]), "cosine", "cosine")
    raw = {"metadata": {"name": "s", "labels": {"app.kubernetes.io/component": "fusion", "kubernetes.io/service-name": "cosine-fusion"}},
           "addressType": "IPv4", "ports": [{"name": "grpc", "port": 50053}],
           "endpoints": [{"addresses": ["10.1.1.1"], "conditions": {"ready": True}}]}
    assert d.apply("ADDED", raw) and d.addresses("fusion") == ["10.1.1.1:50053"]
