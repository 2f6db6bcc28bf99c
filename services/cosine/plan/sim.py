"""The discrete-event simulation of a deployment, driving the services' own policy code on a simulated clock.

What runs unchanged: each simulated scheduler *is* the scheduler service's
`SchedulerServicer` (its `plan` — switches, expertise routing's `ExpertiseRouter`, the
depth chooser — and its step-loop ports `plan_round`, `plan_ahead`, `learn`,
`observe_ahead`: the cost model, adaptive speculation, the global controller), and its
`StepLoop` (batch choice `choose_batch`, `drafts_to_wait_for`, pipelining). Only the four
I/O ports are replaced — `draft` (fusion and the drafter nodes), `verify` (the verifier),
`commit` (Redis) and `emit` (the stream to the client) — by coroutines that build the real
protobuf messages (for their sizes), cross simulated links, wait their turn on simulated
devices and sleep the cost model's seconds. Everything runs on `simloop.VirtualTimeLoop`, so
asyncio's timers are the event queue.

What is modelled, not run: token values (each request's target continuation is a fixed
pseudo-random sequence; a drafter's proposal agrees with it for as many tokens as its
recorded acceptance trace says, then diverges), confidence fusion (the fused tree's main
chain is the best participating drafter's chain, plus side nodes up to the round's budget
that never match; each fused step exchanges one message per drafter), the prompt prior of
expertise routing (the prompt fits the drafters report are made from their recorded
acceptance rates on the request's domain, then fed to the service's own `_prior`), the router (a fixed
cost and one internal hop each way), and a verifier shared by several schedulers (FIFO steps,
not merged across schedulers).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from cosine.bench.stats import RequestRecord
from cosine.common.v1 import common_pb2
from cosine.drafter.v1 import drafter_pb2
from cosine.engine.tree import DraftTree
from cosine.fusion.v1 import fusion_pb2
from cosine.plan.costs import Costs, Link
from cosine.plan.simloop import LoopClock
from cosine.plan.traces import AcceptanceTrace
from cosine.scheduler.service import LiveRequest, SchedulerConfig, SchedulerMetrics, SchedulerServicer
from cosine.scheduler.steploop import Draft, Request, Verdict
from cosine.scheduler.switches import Switches
from cosine.scheduler.v1 import scheduler_pb2
from cosine.verifier.v1 import verifier_pb2

WRONG = 7  # a token no target continuation uses (continuations are ≥ 1000)


class SharedCPU:
    """Processor sharing of one machine's cores: every job computing at once progresses at
    ``min(1, cores / Σ threads)`` of its own uncontended speed (a job's seconds are its time alone with its threads).
    Completion times are recomputed whenever a job starts or ends."""

    def __init__(self, cores: int):
        self.cores = max(1, cores)
        self._jobs: dict[int, list] = {}  # id → [remaining seconds, threads, future]
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._ids = 0

    def _rate(self) -> float:
        threads = sum(j[1] for j in self._jobs.values())
        return min(1.0, self.cores / threads) if threads else 1.0

    def _advance(self) -> None:
        now = asyncio.get_running_loop().time()
        rate = self._rate()
        for job in self._jobs.values():
            job[0] -= (now - self._last) * rate
        self._last = now

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for key in [k for k, j in self._jobs.items() if j[0] <= 1e-12]:
            job = self._jobs.pop(key)
            if not job[2].done():
                job[2].set_result(None)
        if self._jobs:
            soonest = min(j[0] for j in self._jobs.values())
            self._timer = asyncio.get_running_loop().call_later(soonest / self._rate(), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._advance()
        self._reschedule()

    async def run(self, seconds: float, threads: int) -> None:
        self._advance()
        self._ids += 1
        key = self._ids
        future = asyncio.get_running_loop().create_future()
        self._jobs[key] = [seconds, max(1, threads), future]
        self._reschedule()
        try:
            await future
        finally:
            if key in self._jobs:  # cancelled: its share goes to the others
                self._advance()
                self._jobs.pop(key, None)
                self._reschedule()


class Device:
    """A FIFO server: one job at a time, in arrival order (asyncio.Lock is fair); on a `SharedCPU` when given one."""

    def __init__(self, name: str, cpu: SharedCPU | None = None, threads: int = 1):
        self.name = name
        self._lock = asyncio.Lock()
        self.busy_s = 0.0
        self.jobs = 0
        self.queued = 0
        self.cpu, self.threads = cpu, threads

    async def run(self, seconds: float) -> None:
        self.queued += 1
        async with self._lock:
            self.queued -= 1
            started = asyncio.get_running_loop().time()
            if seconds > 0:
                if self.cpu is not None:
                    await self.cpu.run(seconds, self.threads)
                else:
                    await asyncio.sleep(seconds)
            self.busy_s += asyncio.get_running_loop().time() - started
            self.jobs += 1


class SimLink:
    """A link: messages are serialised FIFO over its bandwidth, then travel its latency (in parallel)."""

    def __init__(self, name: str, spec: Link):
        self.spec = spec
        self.wire = Device(name)
        self.bytes = 0

    async def send(self, nbytes: int) -> None:
        self.bytes += nbytes
        tx = self.spec.transmit_s(nbytes)
        if tx > 0:
            await self.wire.run(tx)
        if self.spec.latency_s > 0:
            await asyncio.sleep(self.spec.latency_s)


@dataclass
class DrafterNode:
    drafter: str
    index: int
    device: Device
    link: SimLink


@dataclass
class Deployment:
    """What is simulated: counts of each component and the switches requests run with."""

    schedulers: int = 1
    verifiers: int = 1
    drafters: dict[str, int] = field(default_factory=dict)  # drafter name → nodes running it
    candidates: list[str] = field(default_factory=list)  # the router's default candidate drafters
    speculation: dict = field(default_factory=dict)  # SpeculationParams fields, as the benchmark's systems set them
    scheduler: dict = field(default_factory=dict)  # SchedulerConfig overrides
    colocated: bool = False  # the drafters run on the verifier's own device (vanilla speculative decoding)
    # one machine's cores shared by processes (the local cluster): {"cores": 2, "threads": {"verifier": 2, "lm-x": 1}};
    # the verifier and the drafters named there compute on them by processor sharing
    cpu: dict | None = None

    def config(self) -> SchedulerConfig:
        return SchedulerConfig(**{**self.scheduler, "switches": Switches()})


@dataclass
class SimPrompt:
    domain: str
    prompt_len: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class _SimState:
    record: RequestRecord
    domain: str
    offset: int
    target_seed: int
    done: asyncio.Future
    prompt_len: int
    nodes: dict = field(default_factory=dict)  # drafter name → the node the request's stream opened on
    t0: float = 0.0


class Simulation:
    def __init__(self, deployment: Deployment, costs: Costs, trace: AcceptanceTrace, seed: int = 0,
                 scheduler_class: type | None = None, config: SchedulerConfig | None = None):
        self.deployment, self.costs, self.trace, self.seed = deployment, costs, trace, seed
        self.clock = LoopClock()
        self.internal = SimLink("internal", costs.link("internal"))
        cpu = SharedCPU(deployment.cpu["cores"]) if deployment.cpu else None
        threads = (deployment.cpu or {}).get("threads", {})
        self.verifier_devices = [Device(f"verifier-{i}", cpu if "verifier" in threads else None, threads.get("verifier", 1))
                                 for i in range(max(1, deployment.verifiers))]
        self.verifier_links = [SimLink(f"verifier-link-{i}", costs.link("verifier")) for i in range(len(self.verifier_devices))]
        self.nodes: dict[str, list[DrafterNode]] = {}
        for name, count in deployment.drafters.items():
            self.nodes[name] = []
            for i in range(max(1, count)):
                if deployment.colocated:
                    device = self.verifier_devices[i % len(self.verifier_devices)]
                else:
                    device = Device(f"{name}-{i}", cpu if name in threads else None, threads.get(name, 1))
                link = SimLink(f"{name}-{i}-link", Link() if deployment.colocated else costs.link("drafter"))
                self.nodes[name].append(DrafterNode(name, i, device, link))
        config = config or deployment.config()
        cls = scheduler_class or SimScheduler
        self.schedulers = [cls(self, i, i % len(self.verifier_devices), config) for i in range(max(1, deployment.schedulers))]
        self._next_scheduler = 0
        self._requests = 0

    # -- the workload ---------------------------------------------------------------------

    def target(self, state: _SimState, start: int, n: int) -> list[int]:
        """The target's continuation of a request, tokens start..start+n (pseudo-random, fixed per request)."""
        return [1000 + (state.target_seed * 2654435761 + i * 40503) % 30000 for i in range(start, start + n)]

    async def submit(self, prompt: SimPrompt, index: int, t0: float) -> RequestRecord:
        now = self.clock.now()
        rec = RequestRecord(prompt_index=index, domain=prompt.domain, arrival_s=now - t0)
        c = self.costs
        await asyncio.sleep(c.router_s)
        await self.internal.send(64 + 4 * prompt.prompt_len)  # router → scheduler (SubmitRequest)
        scheduler = self.schedulers[self._next_scheduler % len(self.schedulers)]  # the router's round robin
        self._next_scheduler += 1
        rid = f"sim-{self._requests}"
        self._requests += 1
        state = _SimState(rec, prompt.domain, index * 7 + zlib.crc32(rid.encode()) % 97, zlib.crc32(rid.encode()) ^ self.seed,
                          asyncio.get_running_loop().create_future(), prompt.prompt_len)
        await scheduler.submit(rid, prompt, state, t0)
        await state.done
        rec.end_s = self.clock.now() - t0 + c.link("internal").latency_s
        return rec

    async def closed_loop(self, prompts: list[SimPrompt], order: list[int], concurrency: int) -> tuple[list[RequestRecord], float]:
        queue = list(order)
        records: list[RequestRecord] = []
        t0 = self.clock.now()

        async def client():
            while queue:
                p = queue.pop(0)
                records.append(await self.submit(prompts[p], p, t0))

        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
        return records, self.clock.now() - t0

    async def open_loop(self, prompts: list[SimPrompt], order: list[int], arrivals: list[float]) -> tuple[list[RequestRecord], float]:
        t0 = self.clock.now()

        async def one(i, p):
            await asyncio.sleep(arrivals[i])
            return await self.submit(prompts[p], p, t0)

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(order)))
        return list(records), self.clock.now() - t0

    async def close(self) -> None:
        for s in self.schedulers:
            await s.loop.close()

    def node_for(self, drafter: str) -> DrafterNode:
        nodes = self.nodes.get(drafter)
        if not nodes:
            raise KeyError(f"no drafter node runs {drafter}")
        return min(nodes, key=lambda n: (n.device.queued + (1 if n.device._lock.locked() else 0), n.device.jobs, n.index))

    def busy(self) -> dict:
        return {"verifier_busy_s": sum(d.busy_s for d in self.verifier_devices),
                "drafter_busy_s": sum(n.device.busy_s for ns in self.nodes.values() for n in ns if not self.deployment.colocated)}


class SimScheduler(SchedulerServicer):
    """The scheduler service's own class; only its I/O ports (draft, verify, commit, emit) are simulated."""

    def __init__(self, sim: Simulation, index: int, verifier: int, config: SchedulerConfig):
        super().__init__(store=None, verifiers=None, fusions=None, config=config,
                         metrics=SchedulerMetrics(CollectorRegistry()), clock=sim.clock)
        self.sim = sim
        self.index = index
        self.verifier_index = verifier
        self.decisions: list[tuple] = []  # (request id, depth, drafters) of every round planned, for tests

    async def submit(self, rid: str, prompt: SimPrompt, state: _SimState, t0: float) -> None:
        d = self.sim.deployment
        request = scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=[1] * prompt.prompt_len,
                                              max_new_tokens=prompt.max_new_tokens,
                                              speculation=common_pb2.SpeculationParams(**d.speculation),
                                              candidate_drafters=d.candidates)
        plan = self.plan(request)
        live = LiveRequest(plan, object() if plan.speculate else None, request.sampling, list(request.prompt_token_ids),
                           asyncio.Queue(), {})
        live.sim = state
        state.t0 = t0
        if plan.speculate:  # the Speculate stream's open: fusion opens the request on one node of each drafter
            opening = fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
                request_id=rid, prompt_token_ids=live.prompt, drafters=plan.pool, score_prompt=plan.router is not None))
            await self.sim.internal.send(opening.ByteSize())
            opens = [self._open_on(name, state, live.prompt) for name in plan.pool]
            if plan.router is not None:  # routing's prior: the scheduler waits for every drafter's prompt score
                await asyncio.gather(*opens)
                fits = [self._prompt_fit(name, state) for name in plan.pool]
                await self.sim.internal.send(fusion_pb2.SpeculateResponse(prompt_fits=fits).ByteSize())
                self._prior(plan.router, fits)  # the service's own code turns the fits into routing's prior
            else:  # the open is written and not waited for; the node prefills before its first draft (FIFO)
                for coro in opens:
                    asyncio.get_running_loop().create_task(coro)
        entry = Request(rid, prompt.prompt_len, prompt.max_new_tokens, self.config.max_context,
                        frozenset(prompt.stop_token_ids), payload=live)
        self.loop.add(entry)

    def _prompt_fit(self, name: str, state: _SimState) -> common_pb2.PromptFit:
        """A drafter's score on the prompt, as its recorded acceptance rate on the request's domain would make it."""
        alpha = self.sim.trace.alpha(name, state.domain)
        positions = max(1, min(state.prompt_len - 1, 64))
        return common_pb2.PromptFit(drafter=name, positions=positions, hits=round(alpha * positions),
                                    confidence_sum=alpha * positions)

    async def _open_on(self, name: str, state: _SimState, prompt: list[int]) -> None:
        node = state.nodes[name] = self.sim.node_for(name)
        message = drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(request_id="r", prompt_token_ids=prompt))
        await node.link.send(message.ByteSize())
        await node.device.run(self.sim.costs.drafter_prefill_s(name, len(prompt)))
        await node.link.send(16)

    # -- the simulated ports ----------------------------------------------------------------

    def plan_round(self, request, room):
        order = super().plan_round(request, room)
        self.decisions.append((request.request_id, order.depth, tuple(order.drafters)))
        return order

    async def draft(self, request: Request, order) -> Draft:
        sim, c = self.sim, self.sim.costs
        state: _SimState = request.payload.sim
        message = fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(
            committed_token_ids=order.committed, depth=order.depth, drafters=order.drafters, budget=order.budget,
            context_token_ids=order.context))
        await sim.internal.send(message.ByteSize())  # scheduler → fusion
        started = sim.clock.now()
        g0 = len(request.generated)
        g = g0 + len(order.context)
        truth = sim.target(state, g0, len(order.context) + order.depth + 1)
        on_track = list(order.context) == truth[:len(order.context)]  # drafting ahead: was the guess right so far?
        fusion = request.payload.plan.switches.fusion
        index = state.offset + request.rounds + (1 if order.context else 0)
        proposals = await asyncio.gather(*(self._draft_on(name, order, g, state, truth[len(order.context):], on_track,
                                                          index, fusion) for name in order.drafters))
        await asyncio.sleep(c.fusion_s)
        best = max(range(len(proposals)), key=lambda i: (proposals[i][1], -i))
        chain = proposals[best][0]
        tokens, parents = list(chain), list(range(-1, len(chain) - 1))
        probs = [max(0.05, sim.trace.alpha(order.drafters[best], state.domain))] * len(chain)
        size = max(order.budget, len(chain)) if fusion == "confidence" else len(chain)
        if fusion == "merge":
            size = len(chain) + sum(max(0, len(p[0]) - p[1] - 1) for i, p in enumerate(proposals) if i != best)
        while len(tokens) < size:  # side nodes under the root that the target never takes
            tokens.append(WRONG)
            parents.append(-1)
            probs.append(0.05)
        tree = DraftTree(tokens, parents, probs)
        reply = fusion_pb2.SpeculateResponse(
            tree=common_pb2.DraftTree(token_ids=tokens, parents=parents, probs=probs),
            draft_ms=(sim.clock.now() - started) * 1000,
            proposals=[fusion_pb2.DrafterProposal(drafter=name, token_ids=p[0], probs=[probs[0]] * len(p[0]))
                       for name, p in zip(order.drafters, proposals)],
            fused_token_ids=chain)
        await sim.internal.send(reply.ByteSize())  # fusion → scheduler
        return Draft(tree, list(order.drafters), reply.draft_ms / 1000, reply)

    async def _draft_on(self, name: str, order, g: int, state: _SimState, truth: list[int], on_track: bool, index: int,
                        fusion: str) -> tuple[list[int], int]:
        """One drafter's chain for the round: (tokens, how many agree with the target)."""
        sim, c = self.sim, self.sim.costs
        node = state.nodes.get(name) or state.nodes.setdefault(name, sim.node_for(name))
        step = drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep(committed_token_ids=order.committed, depth=order.depth,
                                                                  context_token_ids=order.context))
        await node.link.send(step.ByteSize())
        context = state.prompt_len + g
        await node.device.run(c.draft_s(name, order.depth, context))
        if fusion == "confidence" and len(order.drafters) > 1:  # a candidates exchange per fused step
            cand = drafter_pb2.DraftResponse(token_ids=[1000], probs=[0.5], candidates=[drafter_pb2.Candidates(
                token_ids=[1000] * 4, probs=[0.1] * 4)])
            for _ in range(order.depth):
                await node.link.send(cand.ByteSize())
                await asyncio.sleep(c.fusion_step_s + node.link.spec.latency_s)
        a = sim.trace.accepted(name, state.domain, index, order.depth) if on_track else 0
        tokens = truth[:a] + [WRONG + 1] * (order.depth - a)
        reply = drafter_pb2.DraftResponse(token_ids=tokens, probs=[0.5] * len(tokens))
        await node.link.send(reply.ByteSize())
        return tokens, a

    async def verify(self, rounds, opens, releases) -> list:
        sim, c = self.sim, self.sim.costs
        entries = [verifier_pb2.VerifyEntry(request_id=rid, release=verifier_pb2.VerifyRelease()) for rid in releases]
        for request in opens:
            live = request.payload
            entries.append(verifier_pb2.VerifyEntry(request_id=request.request_id, open=verifier_pb2.VerifyOpen(
                request_id=request.request_id, committed_token_ids=live.prompt, sampling=live.sampling,
                prompt_len=len(live.prompt))))
        runs = [request.steps for request, _ in rounds]  # decode runs (steploop.py: > 1 only without trees)
        for (request, tree), k in zip(rounds, runs):
            entries.append(verifier_pb2.VerifyEntry(request_id=request.request_id, round=verifier_pb2.VerifyRound(
                tree=common_pb2.DraftTree(token_ids=tree.tokens, parents=tree.parents, probs=tree.probs), steps=k)))
        link, device = sim.verifier_links[self.verifier_index], sim.verifier_devices[self.verifier_index]
        now = sim.clock.now()
        for _ in rounds:
            self.load.enter(now)
        try:
            await link.send(verifier_pb2.VerifyStep(entries=entries).ByteSize())
            seconds = sum(c.prefill_s(len(r.payload.prompt)) for r in opens)
            if rounds:
                longest = max(r.context_used for r, _ in rounds)
                seconds += c.verify_s(len(rounds), longest, max(len(t) for _, t in rounds))
                for i in range(1, max(runs)):  # a decode run's further plain steps, of the rounds with steps left
                    seconds += c.verify_s(sum(1 for k in runs if k > i), longest + i, 0)
            await device.run(seconds)
            verdicts, results = [], []
            for (request, tree), k in zip(rounds, runs):
                state: _SimState = request.payload.sim
                g = len(request.generated)
                truth = sim.target(state, g, len(tree) + k)
                accepted = _walk(tree, truth)
                v = Verdict(truth[:accepted + k], accepted, seconds)
                verdicts.append(v)
                results.append(verifier_pb2.VerifyEntryResult(request_id=request.request_id, verdict=verifier_pb2.VerifyResponse(
                    token_ids=v.token_ids, accepted_draft=accepted, verify_ms=seconds * 1000)))
            await link.send(verifier_pb2.VerifyStepResult(results=results).ByteSize())
        finally:
            now = sim.clock.now()
            for _ in rounds:
                self.load.leave(now)
        return verdicts

    async def commit(self, rounds) -> list:
        await asyncio.sleep(self.sim.costs.commit_s + self.sim.costs.scheduler_step_s)
        return [None] * len(rounds)

    def emit(self, request: Request, emission) -> None:
        state: _SimState = request.payload.sim
        if emission.error is not None:
            state.record.error = repr(emission.error)
            if not state.done.done():
                state.done.set_result(None)
            return
        at = self.sim.clock.now() + self.sim.costs.link("internal").latency_s - state.t0  # scheduler → router → client
        state.record.token_ids += emission.token_ids
        state.record.token_times_s += [at] * len(emission.token_ids)
        if emission.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            state.record.rounds, state.record.drafted, state.record.accepted = request.rounds, request.drafted, request.accepted
            state.record.drafters = list(request.drafters_used)
            if not state.done.done():
                state.done.set_result(None)


def _walk(tree: DraftTree, truth: list[int]) -> int:
    """Greedy verification of a tree against the target's tokens: how many draft tokens it accepts."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    node, accepted = -1, 0
    while accepted < len(truth) - 1:
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] == truth[accepted]), None)
        if nxt is None:
            break
        node, accepted = nxt, accepted + 1
    return accepted


def simulate(deployment: Deployment, costs: Costs, trace: AcceptanceTrace, prompts: list[SimPrompt], *,
             concurrency: int | None = None, order: list[int] | None = None, arrivals: list[float] | None = None,
             seed: int = 0) -> dict:
    """Run one load point (closed loop at `concurrency`, or open loop at `arrivals`) on a fresh simulated clock."""
    from cosine.bench import stats as S
    from cosine.plan import simloop

    order = order if order is not None else list(range(len(prompts)))

    async def main():
        sim = Simulation(deployment, costs, trace, seed)
        if arrivals is not None:
            records, wall = await sim.open_loop(prompts, order, arrivals)
        else:
            records, wall = await sim.closed_loop(prompts, order, concurrency or 1)
        await sim.close()
        return sim, records, wall

    sim, records, wall = simloop.run(main())
    row = S.summarise("simulated", records, None, mode="closed" if arrivals is None else "poisson",
                      concurrency=concurrency if arrivals is None else None, wall_s=wall,
                      verifier_busy_s=sim.busy()["verifier_busy_s"], drafter_busy_s=sim.busy()["drafter_busy_s"])
    row["steps"] = [len(s) for sch in sim.schedulers for s in sch.loop.steps]
    row["decisions"] = [d for sch in sim.schedulers for d in sch.decisions]
    row["simulated_s"] = wall
    return row
