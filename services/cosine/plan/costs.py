"""Cost models of a simulated deployment: each component's step and each link (DESIGN: `cosine plan`).

* verifier step: `cosine.common.batching.VerifyTimeModel`'s own form,
  ``c0 + c1·b(d+1) + c2·bL + c3·b(d+1)L`` (b requests, longest context L, largest tree d),
  plus ``verify_tree_s`` when any request of the step brings a draft tree, plus a prefill of
  ``p0 + p1·tokens`` for each request the step opens;
* drafter step (one drafter node, a round of d steps for one request): `DraftTimeModel`'s
  form ``c0 + c1·d + c2·d·b + c3·d·b·L`` (b = 1: a node drafts one request at a time, FIFO),
  and its prefill of a prompt (seconds per prompt token) when a request opens on it;
* fusion, the scheduler's own work per step, the Redis commit, the router: fixed seconds;
* links: one-way latency plus size / bandwidth, with the message sizes the real protos
  encode to (the simulator builds the real messages and asks `ByteSize()`); a link's
  bandwidth is shared FIFO by whatever crosses it.

Sources (`Costs.source` says which): `fit_cluster` (a running local cluster's Prometheus
metrics, what `cosine plan --validate` uses), `from_profile` (the hardware figures of
``profiles.json``, a roofline with stated efficiencies), or a scenario file's explicit numbers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cosine.common.batching import DraftTimeModel, VerifyTimeModel

PROFILES = Path(__file__).with_name("profiles.json")


@dataclass
class Link:
    latency_s: float = 0.0  # one way, per message
    bandwidth_bps: float = 0.0  # bits per second; 0: unlimited

    def transmit_s(self, nbytes: int) -> float:
        return 8.0 * nbytes / self.bandwidth_bps if self.bandwidth_bps > 0 else 0.0

    def transfer_s(self, nbytes: int) -> float:
        """Seconds for one message of nbytes on an idle link."""
        return self.latency_s + self.transmit_s(nbytes)


@dataclass
class Costs:
    verify: list[float] = field(default_factory=lambda: [0.02, 0.0, 0.0, 0.0])  # VerifyTimeModel coefficients
    verify_tree_s: float = 0.0  # extra for a step with any draft tree in it (the engine's tree-attention path)
    prefill: list[float] = field(default_factory=lambda: [0.0, 0.0])  # p0, p1 per prompt token
    drafters: dict[str, list[float]] = field(default_factory=dict)  # drafter name → DraftTimeModel coefficients
    default_drafter: list[float] = field(default_factory=lambda: [0.0, 0.005, 0.0, 0.0])
    drafter_prefill: dict[str, float] = field(default_factory=dict)  # drafter name → seconds per prompt token
    fusion_s: float = 0.0  # fusion's own work per round
    fusion_step_s: float = 0.0  # per step of a confidence-fused round (the candidates' exchange)
    scheduler_step_s: float = 0.0  # the scheduler's own work between steps (choice, streaming)
    commit_s: float = 0.0  # the Redis commit of a step
    router_s: float = 0.0  # the router's work before a request reaches its scheduler
    links: dict[str, Link] = field(default_factory=dict)  # "drafter", "verifier", "internal", "client"
    source: str = "defaults"

    def link(self, name: str) -> Link:
        return self.links.get(name) or self.links.get("internal") or Link()

    def verify_s(self, b: int, context: int, tree: int) -> float:
        m = VerifyTimeModel(self.verify)
        return m.predict(b, context, tree) + (self.verify_tree_s if tree > 0 else 0.0)

    def prefill_s(self, tokens: int) -> float:
        return max(0.0, self.prefill[0] + self.prefill[1] * tokens) if tokens > 0 else 0.0

    def draft_s(self, drafter: str, depth: int, context: int, batch: int = 1) -> float:
        coef = self.drafters.get(drafter, self.default_drafter)
        return DraftTimeModel(coef).predict(batch, context, depth) if depth > 0 else 0.0

    def drafter_prefill_s(self, drafter: str, tokens: int) -> float:
        return self.drafter_prefill.get(drafter, 0.0) * max(0, tokens)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["links"] = {k: asdict(v) for k, v in self.links.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        d = dict(d)
        d["links"] = {k: Link(**v) for k, v in (d.get("links") or {}).items()}
        return cls(**d)


def link_from(spec: dict) -> Link:
    """{"latency_ms": .., "bandwidth_mbps": ..} (a scenario's notation) → Link."""
    return Link(float(spec.get("latency_ms", 0.0)) / 1000, float(spec.get("bandwidth_mbps", 0.0)) * 1e6)


def load_profiles(path: Path = PROFILES) -> dict:
    return json.loads(path.read_text())


def roofline(device: dict, params_b: float, bytes_per_param: float, eff: dict) -> tuple[float, float]:
    """(fixed seconds per forward pass, seconds per token pushed through) of a dense decoder on `device`:
    the weights are read once per pass (memory bound), each token costs 2·params FLOPs (compute bound)."""
    bw = device["memory_bandwidth_gb_s"] * 1e9 * device.get("count", 1) * eff["memory"]
    flops = device["bf16_dense_tflops"] * 1e12 * device.get("count", 1) * eff["compute"]
    return params_b * 1e9 * bytes_per_param / bw, 2 * params_b * 1e9 / flops


def from_profile(scenario: dict, profiles: dict | None = None, drafters_on_verifier: bool = False) -> Costs:
    """Costs of a scenario's hardware (`profiles.json` devices, a roofline at the file's stated efficiencies, plus
    its fixed overhead per forward pass). ``drafters_on_verifier``: the drafters run on the verifier's GPUs
    (vanilla speculative decoding)."""
    profiles = profiles or load_profiles()
    hw = scenario["hardware"]
    eff = profiles["efficiency"]
    launch = eff.get("forward_overhead_ms", 0.0) / 1000
    devices = profiles["devices"]
    verifier = dict(devices[hw["verifier_device"]], count=hw.get("verifier_gpus", 1))
    fixed, per_token = roofline(verifier, hw["target_params_b"], hw.get("bytes_per_param", 2), eff)
    fixed += launch
    drafters = {}
    for name, spec in hw["drafters"].items():
        dev = verifier if drafters_on_verifier else dict(devices[spec["device"]], count=1)
        d_fixed, d_tok = roofline(dev, spec["params_b"], hw.get("bytes_per_param", 2), eff)
        drafters[name] = [spec.get("round_overhead_ms", 0.0) / 1000, d_fixed + d_tok + launch, 0.0, 0.0]
    o = scenario.get("overheads_ms", {})
    links = {k: link_from(v) for k, v in scenario.get("links", {}).items()}
    return Costs(verify=[fixed, per_token, 0.0, 0.0],
                 prefill=[fixed, per_token], drafters=drafters,
                 fusion_s=o.get("fusion", 0.0) / 1000, fusion_step_s=o.get("fusion_step", 0.0) / 1000,
                 scheduler_step_s=o.get("scheduler_step", 0.0) / 1000, commit_s=o.get("commit", 0.0) / 1000,
                 router_s=o.get("router", 0.0) / 1000, links=links,
                 source=("drafters on the verifier's GPUs; " if drafters_on_verifier else "") + f"profiles.json: verifier {hw.get('verifier_gpus', 1)}x{hw['verifier_device']} "
                        f"({hw['target_params_b']}B params), drafters "
                        + ", ".join(f"{n} {s['device']} ({s['params_b']}B)" for n, s in hw["drafters"].items()))
