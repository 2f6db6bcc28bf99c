"""helm/cosine renders and lints with the real Helm engine, its schema rejects bad values, and the
rendered structure is what the services need: GPUs only where models run, probes on the health
names the servers serve, and service wiring on the ports of cosine.common.ports."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from cosine.common.ports import DEFAULT_PORTS, METRICS_PORTS, REDIS_PORT
from cosine.common.server import LIVENESS, READINESS

from .conftest import CHART, EXAMPLES, NAMESPACE, NO_CRDS, RENDER_NAMES, helm, load_values, notes, pod_specs, render

pytestmark = pytest.mark.unit

GPU_ROLES = re.compile(r"^(verifier|drafter-.+)$")


def deployments(docs):
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "Deployment"}


def env_of(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("name", ["default", *EXAMPLES])
def test_lint_is_clean(name):
    report = helm.lint(CHART, load_values(name), strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_every_render_has_each_role(renders):
    for name, docs in renders.items():
        roles = set(deployments(docs))
        drafters = {f"drafter-{d['name']}" for d in (load_values(name).get("drafters") or helm.Chart.load(CHART).values["drafters"])}
        assert roles == {"router", "scheduler", "fusion", "verifier"} | drafters, name
        services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
        assert {f"cosine-{r}" for r in roles} <= services, name


def test_values_ports_are_the_canonical_ports():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ("router", "scheduler", "fusion", "verifier"):
        assert values[role]["port"] == DEFAULT_PORTS[role], role
        assert values[role]["metricsPort"] == METRICS_PORTS[role], role
    assert values["drafterDefaults"]["port"] == DEFAULT_PORTS["drafter"]
    assert values["drafterDefaults"]["metricsPort"] == METRICS_PORTS["drafter"]
    assert values["redis"]["port"] == REDIS_PORT


def test_settings_defaults_agree_with_the_canonical_ports():
    from cosine.router.__main__ import RouterSettings
    from cosine.scheduler.__main__ import SchedulerSettings

    router, scheduler = RouterSettings(), SchedulerSettings()
    assert router.port == DEFAULT_PORTS["router"]
    assert router.scheduler.endswith(f":{DEFAULT_PORTS['scheduler']}") and router.fusion.endswith(f":{DEFAULT_PORTS['fusion']}")
    assert scheduler.verifier.endswith(f":{DEFAULT_PORTS['verifier']}") and scheduler.fusion.endswith(f":{DEFAULT_PORTS['fusion']}")


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_accelerator_requests_and_tolerations_only_on_drafters_and_verifier(renders, name):
    docs = renders[name]
    values = load_values(name)
    for component, spec in pod_specs(docs).items():
        gpu_requests = [c["resources"].get(k, {}).get("nvidia.com/gpu") for c in spec["containers"] for k in ("requests", "limits")]
        tolerations = spec.get("tolerations", [])
        if not GPU_ROLES.match(component):
            assert gpu_requests == [None, None], component
            assert tolerations == [], component
            continue
        if any(gpu_requests):
            assert gpu_requests[0] == gpu_requests[1] >= 1, component
            assert any("gpu" in t.get("key", "") for t in tolerations), component
            if name.removesuffix(NO_CRDS) != "gpu-pools":
                # placed by its GPU request alone: no label that only some GPU nodes carry (node feature discovery)
                assert "nodeSelector" not in spec, component
            env = env_of(spec["containers"][0])
            assert env.get("COSINE_VERIFIER_DEVICE", env.get("COSINE_DRAFTER_DEVICE")).startswith("cuda")
            assert spec["containers"][0]["image"].endswith("-cuda") or "@sha256:" in spec["containers"][0]["image"]
    gpu_pods = {c for c, s in pod_specs(docs).items() if s["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")}
    if name.removesuffix(NO_CRDS) == "cpu-only":
        assert gpu_pods == set()
    elif name.removesuffix(NO_CRDS) == "gpu-pools":
        specs = pod_specs(docs)
        assert gpu_pods == {"verifier", "drafter-lm-2layer"}
        assert specs["verifier"]["nodeSelector"] == {"cosine.io/pool": "verifier-gpu"}
        assert specs["drafter-lm-2layer"]["nodeSelector"] == {"cosine.io/pool": "drafter-gpu"}
    else:
        assert "verifier" in gpu_pods, values


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_probes_ask_for_the_health_names_the_servers_serve(renders, name):
    for component, dep in deployments(renders[name]).items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["ports"][0]["name"] == "grpc"
        # with TLS on the gRPC port, probes ask the plaintext health port (the kubelet's gRPC probes cannot speak TLS)
        port = next((p for p in container["ports"] if p["name"] == "health"), container["ports"][0])["containerPort"]
        for probe, service in (("startupProbe", LIVENESS), ("livenessProbe", LIVENESS), ("readinessProbe", READINESS)):
            assert container[probe]["grpc"] == {"port": port, "service": service}, (component, probe)
        startup = container["startupProbe"]
        if component == "verifier" or component.startswith("drafter-"):
            # loading weights (and, with models.prepare, fetching them) takes minutes
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, component


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_termination_grace_covers_prestop_and_drain(renders, name):
    values = helm.Chart.load(CHART).merge_values(load_values(name))
    for component, dep in deployments(renders[name]).items():
        spec = dep["spec"]["template"]["spec"]
        container = spec["containers"][0]
        env = env_of(container)
        prefix = next(k for k in env if k.endswith("_DRAIN_TIMEOUT_S"))[: -len("DRAIN_TIMEOUT_S")]
        sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        drain = float(env[prefix + "DRAIN_TIMEOUT_S"])
        delay = float(env[prefix + "SHUTDOWN_DELAY_S"])
        assert drain == values["drainTimeoutSeconds"] and sleep == values["shutdownDelaySeconds"]
        assert spec["terminationGracePeriodSeconds"] > sleep + delay + drain, component


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_termination_grace_covers_a_full_generation_and_schedulers_hand_over_within_it(renders, name):
    values = helm.Chart.load(CHART).merge_values(load_values(name))
    generation = values["router"]["defaultTimeoutSeconds"]
    deps = deployments(renders[name])
    assert float(env_of(deps["router"]["spec"]["template"]["spec"]["containers"][0])["COSINE_ROUTER_DEFAULT_TIMEOUT_S"]) == generation
    for component, dep in deps.items():
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > generation, component
    scheduler = env_of(deps["scheduler"]["spec"]["template"]["spec"]["containers"][0])
    assert float(scheduler["COSINE_SCHEDULER_HANDOVER_AFTER_S"]) < float(scheduler["COSINE_SCHEDULER_DRAIN_TIMEOUT_S"])


def test_a_drain_shorter_than_a_generation_is_refused():
    with pytest.raises(Exception, match="shorter than router.defaultTimeoutSeconds"):
        render({"drainTimeoutSeconds": 30})
    with pytest.raises(Exception, match="handoverAfterSeconds"):
        render({"scheduler": {"handoverAfterSeconds": 600}})


def _settings_from_env(monkeypatch, settings_cls, container):
    for key, value in env_of(container).items():
        if value is not None:
            monkeypatch.setenv(key, value)
    return settings_cls()


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_wiring_reaches_the_ports_services_listen_on(renders, name, monkeypatch):
    """Load each container's rendered env into the service's own settings class and follow the addresses."""
    from cosine.drafter.__main__ import DrafterSettings
    from cosine.fusion.__main__ import FusionSettings
    from cosine.router.__main__ import RouterSettings
    from cosine.scheduler.__main__ import SchedulerSettings
    from cosine.verifier.__main__ import VerifierSettings

    classes = {"router": RouterSettings, "scheduler": SchedulerSettings, "fusion": FusionSettings, "verifier": VerifierSettings}
    docs = renders[name]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    listening = {}  # Service name -> the port its pods' settings listen on
    settings = {}
    for component, dep in deployments(docs).items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        cls = classes.get(component, DrafterSettings)
        with monkeypatch.context() as m:
            s = _settings_from_env(m, cls, container)
        settings[component] = s
        role = "drafter" if cls is DrafterSettings else component
        assert s.host == "0.0.0.0"
        assert s.port == DEFAULT_PORTS[role] == container["ports"][0]["containerPort"], component
        assert s.metrics_port == METRICS_PORTS[role] == container["ports"][1]["containerPort"], component
        svc = services[dep["metadata"]["name"]]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["port"] == s.port and grpc_port["targetPort"] == "grpc"
        listening[svc["metadata"]["name"]] = s.port
        if cls is DrafterSettings:
            assert component == f"drafter-{s.name}"

    def reaches(address: str) -> bool:
        """dns:///SERVICE.NAMESPACE.svc.cluster.local:PORT of a headless Service whose pods listen on PORT."""
        assert address.startswith("dns:///"), address
        host, _, port = address.removeprefix("dns:///").rpartition(":")
        service, _, domain = host.partition(".")
        assert domain == f"{NAMESPACE}.svc.cluster.local", address
        assert services[service]["spec"].get("clusterIP") == "None", f"{service}: callers spread over pods only via a headless Service"
        return listening.get(service) == int(port)

    assert reaches(settings["router"].scheduler) and reaches(settings["router"].fusion)
    assert reaches(settings["scheduler"].verifier) and reaches(settings["scheduler"].fusion)
    endpoints = settings["fusion"].endpoints
    assert set(endpoints) == {s.name for c, s in settings.items() if c.startswith("drafter-")}
    assert all(reaches(a) for a in endpoints.values())
    default_drafters = settings["router"].default_drafters
    assert set(default_drafters) <= set(endpoints)
    redis = settings["scheduler"].redis_url
    values = load_values(name)
    if values.get("redis", {}).get("bundled", True):
        assert redis == f"redis://cosine-redis:{REDIS_PORT}/0" and f"cosine-redis" in services
    else:
        assert redis == values["redis"]["externalUrl"] and "cosine-redis" not in services


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_pod_security(renders, name):
    for component, spec in pod_specs(renders[name]).items():
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        writable = {m["mountPath"] for c in spec["containers"] + spec.get("initContainers", []) for m in c.get("volumeMounts", [])}
        assert "/tmp" in writable, component
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            if c["name"] == "own-models":
                # hostPath only: root with CAP_CHOWN alone, chowning the cache directory to the pods' user
                assert load_values(name)["models"]["storage"]["type"] == "hostPath", component
                assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]} and sc["allowPrivilegeEscalation"] is False
                assert c["command"] == ["chown", "10001:10001", "/var/cache/cosine"] and sc["readOnlyRootFilesystem"] is True
                continue
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, component
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True


def test_autoscaling_modes(renders):
    def kinds(docs, component):
        return {d["kind"] for d in docs if d["metadata"]["name"] == f"cosine-{component}"
                and d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")}

    default, gpu = renders["default"], renders["gpu-pools"]
    for component in ("router", "scheduler", "fusion"):
        assert kinds(default, component) == {"HorizontalPodAutoscaler"}
        hpa = next(d for d in default if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == f"cosine-{component}")
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    for component in ("verifier", "drafter-lm-2layer", "drafter-ngram"):
        assert kinds(default, component) == {"ScaledObject"}
        assert kinds(gpu, component) == {"HorizontalPodAutoscaler"}
    scaled = next(d for d in default if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "cosine-drafter-ngram")
    assert 'service="drafter-ngram"' in scaled["spec"]["triggers"][0]["metadata"]["query"]
    hpa = next(d for d in gpu if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "cosine-verifier")
    assert {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == {"cosine_verifier_kv_slots_used", "cosine_worker_busy_fraction"}
    # an autoscaled Deployment leaves replicas to its autoscaler
    assert all("replicas" not in d["spec"] for d in default if d["kind"] == "Deployment")


def test_network_policy_is_default_deny_with_the_service_flows(renders):
    policies = {d["metadata"]["name"]: d["spec"] for d in renders["default"] if d["kind"] == "NetworkPolicy"}
    deny = policies["cosine-default-deny"]
    assert deny["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in deny and "egress" not in deny

    def callers(component):
        rule = policies[f"cosine-{component}"]["ingress"][0]
        return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule.get("from", [])}, rule["ports"][0]["port"]

    assert callers("scheduler") == ({"router"}, DEFAULT_PORTS["scheduler"])
    assert callers("fusion") == ({"router", "scheduler"}, DEFAULT_PORTS["fusion"])
    assert callers("verifier") == ({"scheduler"}, DEFAULT_PORTS["verifier"])
    assert callers("drafter-ngram") == ({"fusion"}, DEFAULT_PORTS["drafter"])
    assert callers("router") == (set(), DEFAULT_PORTS["router"])  # public entry
    assert policies["cosine-redis"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    assert "cosine-default-deny" not in {d["metadata"]["name"] for d in renders["image-models-no-extras"] if d["kind"] == "NetworkPolicy"}


def test_service_monitors_scrape_the_metrics_port_and_keep_service_labels(renders):
    monitors = [d for d in renders["default"] if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 7  # router, scheduler, fusion, verifier, three drafters
    for m in monitors:
        assert m["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": True}]
    gpu = [d for d in renders["gpu-pools"] if d["kind"] == "ServiceMonitor"]
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in gpu)


def test_notes_tell_how_to_call_generate():
    text = notes()
    assert "cosine.router.v1.Router/Generate" in text and "port-forward svc/cosine-router 50051:50051" in text


BAD_VALUES = [
    ("port out of range", {"router": {"port": 70000}}),
    ("unknown role key", {"scheduler": {"replica": 3}}),
    ("drafter name not a DNS label", {"drafters": [{"name": "Code_Drafter", "kind": "ngram"}]}),
    ("unknown drafter kind", {"drafters": [{"name": "x", "kind": "transformer"}]}),
    ("lm drafter without model", {"drafters": [{"name": "x", "kind": "lm"}]}),
    ("no drafters", {"drafters": []}),
    ("negative GPU count", {"verifier": {"gpu": {"count": -1}}}),
    ("bad dtype", {"verifier": {"dtype": "int8"}}),
    ("external redis without URL", {"redis": {"bundled": False}}),
    ("redis URL not redis://", {"redis": {"bundled": False, "externalUrl": "http://redis:6379"}}),
    ("unknown storage type", {"models": {"storage": {"type": "nfs"}}}),
    ("unknown autoscaling mode", {"autoscaling": {"metricsMode": "vpa"}}),
    ("root allowed", {"securityContext": {"runAsNonRoot": False}}),
    ("metric without target", {"verifier": {"autoscaling": {"metrics": [{"name": "q", "query": "up"}]}}}),
    ("bad digest", {"image": {"digest": "latest"}}),
    ("redis maxMemory not a Redis size", {"redis": {"maxMemory": "lots"}}),
    ("negative suffix memory", {"drafters": [{"name": "suffix", "kind": "suffix", "memoryTokens": -1}]}),
    ("maxStreams neither auto nor a count", {"router": {"maxStreams": "many"}}),
    ("negative maxStreams", {"router": {"maxStreams": -1}}),
    ("zero Redis timeout", {"scheduler": {"redisTimeoutSeconds": 0}}),
]


@pytest.mark.parametrize("values", [v for _, v in BAD_VALUES], ids=[n for n, _ in BAD_VALUES])
def test_schema_rejects_bad_values(values):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError):
            chart.render(values=values, name="cosine", namespace="cosine")


@pytest.mark.parametrize("name", RENDER_NAMES)
def test_schema_accepts_the_examples(name):
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(load_values(name))
    json.loads((CHART / "values.schema.json").read_text())  # stays valid JSON


def test_values_are_documented():
    """Every leaf key of values.yaml's top two levels has a `# --` comment on it or a parent."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented = sum(1 for line in lines if line.strip().startswith("# --"))
    assert documented >= 60
