"""What a `helm install` on a real cluster depends on, checked on Helm's own render (no helm binary
and no cluster here: conftest.render is `helm template` with the cluster's API versions passed as
.Capabilities). Custom resources only where their APIs are served; GPU pods placed by their request;
the verifier's KV slots from its device memory; drafter slots and their autoscaling target from one
value; namespace-scoped autoscaling queries; init containers that wait instead of crash-looping
(their scripts are run here, against a real redis-server and the real `cosine zoo prepare`)."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .conftest import CHART, CRD_APIS, EXAMPLES, NAMESPACE, NO_CRDS, RENDER_NAMES, helm, load_values, manifest, notes, pod_specs, render, render_raw

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor"}


def kinds(docs) -> set[str]:
    return {d["kind"] for d in docs}


def env_of(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def deployment(docs, component):
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)


# ---- custom resources only where the cluster serves them


@pytest.mark.parametrize("name", [n for n in RENDER_NAMES if n.endswith(NO_CRDS)])
def test_without_the_crds_no_custom_resource_renders(renders, name):
    docs = renders[name]
    assert not kinds(docs) & CUSTOM_KINDS
    with_crds = renders[name.removesuffix(NO_CRDS)]
    values = helm.Chart.load(CHART).merge_values(load_values(name))
    skipped = {d["metadata"]["name"] for d in with_crds if d["kind"] == "ScaledObject"}
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        if dep["metadata"]["name"] in skipped:
            # no autoscaler will set it: the role runs at its minimum instead of the Deployment default of 1
            component = dep["metadata"]["labels"]["app.kubernetes.io/component"]
            cfg = values["verifier"] if component == "verifier" else values["drafterDefaults"]
            assert dep["spec"]["replicas"] == cfg["autoscaling"]["minReplicas"], component
    text = notes(load_values(name), api_versions=[])
    if skipped:
        assert "SKIPPED: KEDA ScaledObjects for" in text and "keda.sh/v1alpha1" in text
        for so in skipped:
            assert so.removeprefix("cosine-") in text.split("SKIPPED: KEDA ScaledObjects for")[1].split(":")[0]
    else:
        assert "SKIPPED: KEDA" not in text
    monitors = {d["metadata"]["name"] for d in with_crds if d["kind"] == "ServiceMonitor"}
    assert ("SKIPPED: ServiceMonitors" in text) == bool(monitors)


def test_with_the_crds_custom_resources_render_and_notes_skip_nothing(renders):
    docs = renders["default"]
    assert {"ScaledObject", "ServiceMonitor"} <= kinds(docs)
    assert "SKIPPED" not in notes({}, api_versions=CRD_APIS)
    # KEDA alone: ScaledObjects, and a NOTES line only for the ServiceMonitors
    keda_only = [a for a in CRD_APIS if a.startswith("keda")]
    assert "ScaledObject" in kinds(render({}, keda_only)) and "ServiceMonitor" not in kinds(render({}, keda_only))
    text = notes({}, api_versions=keda_only)
    assert "SKIPPED: ServiceMonitors" in text and "SKIPPED: KEDA" not in text


@pytest.mark.parametrize("name", ["default", "cpu-only", "gpu-pools"])
@pytest.mark.parametrize("apis", ["crds", "none"])
def test_lint_is_clean_for_two_kubernetes_versions(name, apis):
    for version in ("v1.27.0", "v1.33.0"):
        report = helm.lint(CHART, load_values(name), strict=True, kube_version=version)
        assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], (version, report)
        out = render_raw(load_values(name), CRD_APIS if apis == "crds" else [], kube_version=version)
        assert any(t.strip() for t in out.values())


# ---- placement


def test_gpu_pods_are_placed_by_their_request_and_tolerate_the_gpu_taint(renders):
    specs = pod_specs(renders["default"])
    for component in ("verifier", "drafter-lm-2layer"):
        spec = specs[component]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nodeSelector" not in spec, "nvidia.com/gpu.present exists only with NVIDIA's feature discovery"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    opted = pod_specs(render({"verifier": {"gpu": {"nodeSelector": {"nvidia.com/gpu.present": "true"}}}}))
    assert opted["verifier"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nodeSelector" not in opted["drafter-lm-2layer"]


# ---- verifier KV slots


def expected_slots(memory_gib, reserved_gib, context, layers, kv_heads, head_dim, dtype_bytes, cap):
    per_slot = 2 * layers * kv_heads * head_dim * dtype_bytes * context
    return min(cap, math.floor((memory_gib - reserved_gib) * 2**30 / per_slot))


def verifier_env(values) -> dict[str, str]:
    return env_of(pod_specs(render(values, []))["verifier"]["containers"][0])


@pytest.mark.parametrize("memory,reserved,context,dtype,gpu", [
    (16, 4, 4096, "auto", 1),      # T4: the chart's default
    (24, 4, 4096, "bfloat16", 1),  # L4 / A10G
    (80, 8, 8192, "float16", 1),   # A100 80 GB, longer context: capped
    (8, 3, 4096, "auto", 0),       # CPU pod: fp32
    (8, 3, 2048, "float32", 1),
])
def test_verifier_slots_follow_the_documented_formula(memory, reserved, context, dtype, gpu):
    defaults = helm.Chart.load(CHART).values["verifier"]["kvCache"]
    geometry = defaults["model"]
    env = verifier_env({"verifier": {"dtype": dtype, "gpu": {"count": gpu},
                                     "kvCache": {"deviceMemoryGiB": memory, "reservedGiB": reserved, "maxContext": context}}})
    dtype_bytes = 4 if dtype == "float32" or (dtype == "auto" and not gpu) else 2
    want = expected_slots(memory, reserved, context, geometry["layers"], geometry["kvHeads"], geometry["headDim"], dtype_bytes,
                          defaults["maxSlotsCap"])
    assert int(env["COSINE_VERIFIER_MAX_SLOTS"]) == want >= 1
    assert env["COSINE_VERIFIER_MAX_CONTEXT"] == str(context)
    # the slots fit the memory they were sized from (the issue: 256 slots x 4096 preallocated 22.5 GiB on 16 GiB GPUs)
    per_slot = 2 * geometry["layers"] * geometry["kvHeads"] * geometry["headDim"] * dtype_bytes * context
    assert want * per_slot <= (memory - reserved) * 2**30


def test_default_slots_fit_a_16_gib_gpu():
    env = verifier_env({})
    # SmolLM2-135M in bf16: 2 x 30 x 3 x 64 x 2 B = 22.5 KiB per position, 90 MiB per 4096-token slot
    assert int(env["COSINE_VERIFIER_MAX_SLOTS"]) == 136


def test_explicit_slots_win_and_impossible_sizes_are_refused():
    assert verifier_env({"verifier": {"maxSlots": 12}})["COSINE_VERIFIER_MAX_SLOTS"] == "12"
    with pytest.raises(Exception, match="holds no KV slot"):
        render({"verifier": {"kvCache": {"deviceMemoryGiB": 4, "reservedGiB": 4}}})
    with helm.Chart.load(CHART) as chart:
        for bad in ({"deviceMemoryGiB": 0.5}, {"reservedGiB": 0}, {"maxContext": 64}, {"maxSlotsCap": 0},
                    {"model": {"layers": 0, "kvHeads": 3, "headDim": 64}}):
            with pytest.raises(Exception):
                chart.validate_schema({"verifier": {"kvCache": bad}})
        with pytest.raises(Exception):
            chart.validate_schema({"verifier": {"maxSlots": -1}})


# ---- drafter slots and autoscaling


def test_drafter_slots_set_the_kv_slots_and_the_autoscaling_target():
    for slots, want in ((32, 24), (8, 6), (1, 1)):
        docs = render({"drafterDefaults": {"slots": slots}})
        for name in ("ngram", "lm-2layer"):
            env = env_of(deployment(docs, f"drafter-{name}")["spec"]["template"]["spec"]["containers"][0])
            assert env["COSINE_DRAFTER_MAX_REQUESTS"] == str(slots)
            so = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == f"cosine-drafter-{name}")
            assert so["spec"]["triggers"][0]["metadata"]["threshold"] == str(want)
    hpa = next(d for d in render({"drafterDefaults": {"slots": 20}, "autoscaling": {"metricsMode": "external"}})
               if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "cosine-drafter-ngram")
    assert hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"] == "15"


def test_drafter_settings_accept_the_rendered_slots(monkeypatch):
    from cosine.drafter.__main__ import DrafterSettings

    env = env_of(deployment(render({"drafterDefaults": {"slots": 20}}), "drafter-lm-2layer")["spec"]["template"]["spec"]["containers"][0])
    for k, v in env.items():
        if v is not None:
            monkeypatch.setenv(k, v)
    assert DrafterSettings().max_requests == 20


def test_autoscaling_queries_are_scoped_to_the_release_namespace():
    out = render_raw({}, CRD_APIS)
    docs = [d for t, text in out.items() if not t.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    queries = [t["metadata"]["query"] for d in docs if d.get("kind") == "ScaledObject" for t in d["spec"]["triggers"]]
    assert len(queries) == 4
    assert all(f'namespace="{NAMESPACE}"' in q and "NAMESPACE" not in q and "DRAFTER" not in q for q in queries), queries


# ---- waiting instead of crash-looping


def test_scheduler_waits_longer_than_its_dependencies_take_to_start(renders):
    for name in ("default", "gpu-pools", "cpu-only"):
        values = helm.Chart.load(CHART).merge_values(load_values(name))
        spec = pod_specs(renders[name])["scheduler"]
        env = env_of(spec["containers"][0])
        startup = max(values[r]["probes"]["startup"]["periodSeconds"] * values[r]["probes"]["startup"]["failureThreshold"]
                      for r in ("verifier", "drafterDefaults"))
        assert float(env["COSINE_SCHEDULER_STARTUP_TIMEOUT_S"]) > startup
        assert [c["name"] for c in spec["initContainers"]] == ["wait-for-redis"]


def init_script(docs, component, container) -> str:
    spec = pod_specs(docs)[component]
    c = next(c for c in spec["initContainers"] if c["name"] == container)
    assert c["command"][:2] == ["python", "-c"]
    return c["command"][2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_for_redis_script_waits_until_redis_answers(renders):
    script = init_script(renders["default"], "scheduler", "wait-for-redis")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, COSINE_SCHEDULER_REDIS_URL=f"redis://127.0.0.1:{port}/0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    redis = None
    try:
        time.sleep(2.5)
        assert proc.poll() is None, "it must wait while Redis is down"
        redis = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert proc.wait(timeout=15) == 0
        assert f"waiting for Redis at 127.0.0.1:{port}" in proc.stdout.read()
    finally:
        proc.kill()
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=10)


def test_model_preparation_runs_once_at_a_time_per_volume(renders, tmp_path):
    """Three pods' prepare-models scripts on one volume: the lock lets one `cosine zoo prepare` run at a time
    (a stand-in `cosine` on PATH logs when each run starts and ends; the script under test is the rendered one)."""
    script = init_script(renders["external-redis-pvc"], "verifier", "prepare-models")
    bindir, cache = tmp_path / "bin", tmp_path / "volume"
    bindir.mkdir(), cache.mkdir()
    (bindir / "cosine").write_text(f"#!/bin/sh\necho start $$ >> {cache}/log\nsleep 0.4\necho end $$ >> {cache}/log\n")
    (bindir / "cosine").chmod(0o755)
    env = dict(os.environ, COSINE_CACHE=str(cache), PATH=f"{bindir}:{os.environ['PATH']}")
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL) for _ in range(3)]
    assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
    log = [line.split() for line in (cache / "log").read_text().splitlines()]
    assert len(log) == 6
    for i in range(0, 6, 2):  # start A, end A, start B, end B, ...: never two at once
        assert log[i][0] == "start" and log[i + 1] == ["end", log[i][1]], log


def test_model_preparation_script_runs_the_real_prepare(renders):
    """The rendered script with the real CLI on a cache whose models are prepared: it takes the lock, finds the
    cards and leaves the models as they are."""
    from cosine.zoo.registry import cache_root, models_dir

    cards = sorted(models_dir().glob("*/cosine.json"))
    if len(cards) < 2:
        pytest.skip("the zoo's target and drafter are not prepared in this cache")
    before = {c: c.stat().st_mtime_ns for c in cards}
    script = init_script(renders["default"], "verifier", "prepare-models")
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, COSINE_CACHE=str(cache_root())),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {c: c.stat().st_mtime_ns for c in cards} == before


def test_pvc_is_read_write_once_by_default(renders):
    pvc = next(d for d in renders["external-redis-pvc"] if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_host_path_cache_is_handed_to_the_pods_user(renders):
    for component in ("router", "verifier", "drafter-lm-2layer"):
        spec = pod_specs(renders["hostpath-own-keys"])[component]
        names = [c["name"] for c in spec["initContainers"]]
        assert names == ["own-models", "prepare-models"], component
        assert any(v.get("hostPath", {}).get("path") == "/var/lib/cosine/cache" for v in spec["volumes"])
    for component in ("router", "verifier"):
        assert "own-models" not in [c["name"] for c in pod_specs(renders["default"])[component].get("initContainers", [])]


# ---- the API key


def test_api_key_is_on_by_default_and_read_from_a_mounted_secret(renders, monkeypatch, tmp_path):
    from cosine.router.__main__ import RouterSettings

    docs = renders["default"]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["metadata"]["name"] == "cosine-api-keys" and set(secret["data"]) == {"api-keys"}
    spec = pod_specs(docs)["router"]
    volume = next(v for v in spec["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "cosine-api-keys"
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
    env = env_of(spec["containers"][0])
    assert "COSINE_ROUTER_API_KEYS" not in env  # not in the environment
    assert env["COSINE_ROUTER_API_KEYS_FILE"] == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    # what the kubelet writes there is the Secret's decoded value; the router's settings read it
    import base64

    keyfile = tmp_path / "api-keys"
    keyfile.write_bytes(base64.b64decode(secret["data"]["api-keys"]))
    monkeypatch.setenv("COSINE_ROUTER_API_KEYS_FILE", str(keyfile))
    keys = RouterSettings().accepted_keys()
    assert len(keys) == 1 and len(next(iter(keys))) == 40

    own = renders["hostpath-own-keys"]
    assert "Secret" not in kinds(own)
    assert next(v for v in pod_specs(own)["router"]["volumes"] if v["name"] == "api-keys")["secret"]["secretName"] == "cosine-keys"
    off = pod_specs(renders["no-auth"])["router"]
    assert "COSINE_ROUTER_API_KEYS_FILE" not in env_of(off["containers"][0]) and "Secret" not in kinds(renders["no-auth"])


# ---- golden renders


def normalised(docs) -> str:
    """The render as YAML, the generated API key masked (it is random per render)."""
    out = []
    for d in docs:
        m = manifest(d)
        if m["kind"] == "Secret" and m["metadata"]["name"].endswith("-api-keys"):
            m["data"] = {k: "<generated>" for k in m["data"]}
        out.append({"__template__": d["__template__"], **m})
    return yaml.safe_dump_all(out, sort_keys=True)


GOLDEN_NAMES = [n for n in RENDER_NAMES if n.removesuffix(NO_CRDS) in ("default", *EXAMPLES)]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_render_matches_its_golden_file(renders, name):
    """Every change to what the chart renders shows up in review. Regenerate: COSINE_UPDATE_GOLDEN=1 pytest tests/unit/helm."""
    path = GOLDEN / f"{name.replace('@', '.')}.yaml"
    text = normalised(renders[name])
    if os.environ.get("COSINE_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path.name} is missing: run with COSINE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} differs from the render: review, then COSINE_UPDATE_GOLDEN=1"


# ---- TLS


def test_tls_wires_every_role_to_the_mounted_certificate_and_probes_the_plaintext_health_port(renders, monkeypatch):
    from cosine.common.config import ServiceSettings

    docs = renders["tls"]
    for component, spec in pod_specs(docs).items():
        if component == "redis":
            continue
        container = spec["containers"][0]
        env = env_of(container)
        prefix = next(k for k in env if k.endswith("_TLS_CERT_FILE"))[: -len("TLS_CERT_FILE")]
        volume = next(v for v in spec["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "cosine-tls"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")["mountPath"]
        files = {f"{mount}/{item['path']}": item["key"] for item in volume["secret"]["items"]}
        assert files[env[prefix + "TLS_CERT_FILE"]] == "tls.crt" and files[env[prefix + "TLS_KEY_FILE"]] == "tls.key"
        assert files[env[prefix + "TLS_CA_FILE"]] == "ca.crt"
        # internal roles require client certificates; the public router relies on API keys
        assert (prefix + "TLS_CLIENT_CA_FILE" in env) == (component != "router"), component
        health = next(p for p in container["ports"] if p["name"] == "health")["containerPort"]
        assert env[prefix + "HEALTH_PORT"] == str(health)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] == health, (component, probe)
        with monkeypatch.context() as m:
            for k, v in env.items():
                if k.startswith(prefix) and v is not None:
                    m.setenv(k.replace(prefix, "COSINE_TLSCHECK_", 1), v)

            class Settings(ServiceSettings):
                model_config = ServiceSettings.model_config | {"env_prefix": "COSINE_TLSCHECK_"}

            s = Settings()
        assert s.tls_cert_file and s.tls_ca_file and s.health_port == health
    plain = pod_specs(renders["default"])["verifier"]["containers"][0]
    assert not [k for k in env_of(plain) if "TLS" in k] and "health" not in [p["name"] for p in plain["ports"]]
    assert "-cacert ca.crt -servername cosine-router.cosine.svc.cluster.local" in notes(load_values("tls"))
    with pytest.raises(Exception, match="tls.secretName is required"):
        render({"tls": {"enabled": True}})


def test_cert_manager_example_names_what_the_chart_dials():
    from .conftest import K8S

    docs = list(yaml.safe_load_all((K8S / "cert-manager.yaml").read_text()))
    cert = next(d for d in docs if d["kind"] == "Certificate" and not d["spec"].get("isCA"))
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    issuer = next(d for d in docs if d["kind"] == "Issuer" and d["metadata"]["name"] == cert["spec"]["issuerRef"]["name"])
    ca = next(d for d in docs if d["kind"] == "Certificate" and d["spec"].get("isCA"))
    assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    # every dns:/// target the chart renders for namespace cosine matches a dnsName (one wildcard label)
    targets = [e["value"] for d in render({"tls": {"enabled": True, "secretName": cert["spec"]["secretName"]}})
               if d["kind"] == "Deployment" for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
               if str(e.get("value", "")).startswith("dns:///")]
    assert targets
    for t in targets:
        host = t.removeprefix("dns:///").rpartition(":")[0]
        assert any(n.startswith("*.") and host.partition(".")[2] == n[2:] for n in cert["spec"]["dnsNames"]), host
