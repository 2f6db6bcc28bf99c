"""The same policy code in the service and in `cosine plan`'s simulator: a request sequence recorded through the
real scheduler (real gRPC servers, tiny model, Redis) and replayed through the simulator chooses the same depths,
drafters and batches.

The recording keeps what the policy reads from outside (each round's fusion reply and verdict, each request's
prompt fits); the replay feeds exactly those to the simulator's scheduler in simulated time. The set-up is one whose
decisions do not depend on wall time (requests one after another, fixed depth, expertise routing over two drafters
with fusion single, no pipelining): what is compared is then the policy's choices alone — routing's drafter per
round from the drafters' agreement, the depth, the rounds' cuts, the step loop's batches.
"""

from __future__ import annotations

import asyncio

import grpc

from cosine.common.v1 import common_pb2
from cosine.plan import simloop
from cosine.plan.costs import Costs, Link
from cosine.plan.sim import Deployment, SimPrompt, SimScheduler, Simulation
from cosine.plan.traces import AcceptanceTrace
from cosine.scheduler.steploop import Draft
from cosine.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
SPECULATION = {"fusion": common_pb2.FUSION_MODE_SINGLE, "routing": True, "adaptive_depth": False, "pipelining": False,
               "max_depth": 3}


PREFIX = "plan-same-policy-"


class Recorder:
    """Wraps the real servicer's ports (instance attributes over its methods), keeping what each port answered."""

    def __init__(self, servicer):
        self.servicer = servicer
        self.ids: list[str] = []
        self.stops: dict[str, tuple] = {}
        self.orders: dict[str, list] = {}
        self.drafts: dict[str, list] = {}
        self.verdicts: dict[str, list] = {}
        self.fits: dict[int, dict] = {}
        self.steps_before = len(servicer.loop.steps)
        plan_round, draft, verify, prior = servicer.plan_round, servicer.draft, servicer.verify, servicer._prior

        def rec_plan_round(request, room):
            if not request.request_id.startswith(PREFIX):  # another test's request still in the shared scheduler
                return plan_round(request, room)
            if request.request_id not in self.orders:
                self.ids.append(request.request_id)
                self.stops[request.request_id] = tuple(sorted(request.stop_token_ids))
                self.orders[request.request_id] = []
            order = plan_round(request, room)
            self.orders[request.request_id].append((order.depth, tuple(order.drafters)))
            return order

        async def rec_draft(request, order):
            d = await draft(request, order)
            self.drafts.setdefault(request.request_id, []).append(d)
            return d

        async def rec_verify(rounds, opens, releases):
            out = await verify(rounds, opens, releases)
            for (request, _), v in zip(rounds, out):
                self.verdicts.setdefault(request.request_id, []).append(v)
            return out

        def rec_prior(router, fits):
            self.fits[len(self.fits)] = {f.drafter: f for f in fits}
            return prior(router, fits)

        servicer.plan_round, servicer.draft, servicer.verify, servicer._prior = rec_plan_round, rec_draft, rec_verify, rec_prior
        self._restore = (plan_round, draft, verify, prior)

    def restore(self):
        s = self.servicer
        s.plan_round, s.draft, s.verify, s._prior = self._restore

    def steps(self) -> list[list[int]]:
        steps = ([self.ids.index(rid) for rid in step if rid in self.ids] for step in self.servicer.loop.steps[self.steps_before:])
        return [step for step in steps if step]


def replay_class(rec: Recorder):
    """A simulated scheduler whose drafts, verdicts and prompt fits are the recorded ones, in order."""

    class Replay(SimScheduler):
        def _real(self, request) -> str:
            return rec.ids[int(request.request_id.split("-")[1])]

        def _prompt_fit(self, name, state):
            return rec.fits[int(state.record.prompt_index)][name]

        async def draft(self, request, order):
            await asyncio.sleep(0.002)
            d = rec.drafts[self._real(request)][request.payload.sim_drafts]
            request.payload.sim_drafts += 1
            return Draft(d.tree, list(d.drafters), d.compute_s, d.payload)

        async def verify(self, rounds, opens, releases):
            await asyncio.sleep(0.005)
            out = []
            for request, _ in rounds:
                out.append(rec.verdicts[self._real(request)][request.payload.sim_verdicts])
                request.payload.sim_verdicts += 1
            return out

        async def submit(self, rid, prompt, state, t0):
            await super().submit(rid, prompt, state, t0)
            live = self.loop.requests[rid].payload
            live.sim_drafts = live.sim_verdicts = 0

    return Replay


async def test_a_recorded_request_sequence_gets_the_same_choices_in_the_simulator(services):
    servicer = services["scheduler"].servicer
    for _ in range(300):  # the shared scheduler may still be ending an earlier test's request: start alone
        if not servicer.loop.live:
            break
        await asyncio.sleep(0.1)
    assert not servicer.loop.live, "an earlier test's request is still running in the shared scheduler"
    rec = Recorder(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services['scheduler'].port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            for i, prompt in enumerate(PROMPTS):  # one after another: no choice depends on wall time
                request = scheduler_pb2.SubmitRequest(
                    request_id=f"{PREFIX}{i}", prompt_token_ids=prompt, max_new_tokens=16,
                    speculation=common_pb2.SpeculationParams(**SPECULATION), candidate_drafters=["ngram", "tiny"])
                async for _ in stub.Submit(request, timeout=60):
                    pass
    finally:
        rec.restore()
    real_steps = rec.steps()
    assert len(rec.ids) == len(PROMPTS) and all(rec.verdicts[r] for r in rec.ids)
    assert {d for r in rec.ids for _, ds in rec.orders[r] for d in ds} <= {"ngram", "tiny"}

    prompts = [SimPrompt("code", len(p), 16, rec.stops[rid]) for p, rid in zip(PROMPTS, rec.ids)]
    deployment = Deployment(drafters={"ngram": 1, "tiny": 1}, candidates=["ngram", "tiny"], speculation=SPECULATION)
    costs = Costs(verify=[0.005, 0, 0, 0], links={"internal": Link(0.0)})

    async def main():
        sim = Simulation(deployment, costs, AcceptanceTrace(8, {}), scheduler_class=replay_class(rec), config=servicer.config)
        await sim.closed_loop(prompts, list(range(len(prompts))), 1)
        await sim.close()
        scheduler = sim.schedulers[0]
        return scheduler.decisions, [[int(r.split("-")[1]) for r in step] for step in scheduler.loop.steps]

    decisions, sim_steps = await asyncio.to_thread(lambda: simloop.run(main()))  # its own loop, off this one
    sim_orders: dict[int, list] = {}
    for rid, depth, drafters in decisions:
        sim_orders.setdefault(int(rid.split("-")[1]), []).append((depth, drafters))
    for i, rid in enumerate(rec.ids):
        assert sim_orders[i] == rec.orders[rid], (i, sim_orders[i], rec.orders[rid])
    assert sim_steps == real_steps
    # the set-up exercised routing (both drafters were chosen, by the prior or by the evidence) and the rounds' cuts
    assert {d for r in rec.ids for _, ds in rec.orders[r] for d in ds} == {"ngram", "tiny"}
    assert len({depth for r in rec.ids for depth, _ in rec.orders[r]}) > 1
