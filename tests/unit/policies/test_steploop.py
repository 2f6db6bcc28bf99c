"""The scheduler's step loop on fake ports and a virtual clock: deterministic, no servers."""

from __future__ import annotations

import asyncio
import heapq
import itertools

import pytest

from cosine.common.v1 import common_pb2
from cosine.engine.tree import DraftTree
from cosine.common.batching import BatchLimits
from cosine.scheduler.steploop import Draft, Request, RoundOrder, StepLoop, Verdict, drafts_to_wait_for


class VirtualClock:
    """Time moves only when every task waits on the clock: then it jumps to the earliest timer."""

    def __init__(self):
        self.t = 0.0
        self._timers: list = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.t + max(0.0, seconds), next(self._seq), future))
        await future

    async def settle(self) -> None:
        for _ in range(30):
            await asyncio.sleep(0)

    async def run(self, done, limit_s: float = 1000.0) -> None:
        """Advance time until done() or the limit."""
        await self.settle()
        while not done():
            while self._timers and self._timers[0][2].done():  # cancelled sleeps
                heapq.heappop(self._timers)
            assert self._timers, "nothing left to wait for, and not done"
            at, _, future = heapq.heappop(self._timers)
            assert at <= limit_s, f"not done by t={limit_s}"
            self.t = max(self.t, at)
            future.set_result(None)
            await self.settle()


def target_token(rid: str, position: int) -> int:
    """The target's (greedy) token at each output position of a request: a fixed function."""
    return (sum(map(ord, rid)) * 7 + position * 13) % 97 + 3


class FakePorts:
    """Drafts a chain (right for the first `good` tokens, then wrong), verifies like a greedy target."""

    def __init__(self, clock: VirtualClock, depth: dict[str, int], draft_s: dict[str, float], step_s=lambda n: 0.1,
                 good: int = 2, ahead: bool = False):
        self.clock = clock
        self.depth, self.draft_s, self.step_s, self.good, self.ahead = depth, draft_s, step_s, good, ahead
        self.out: dict[str, list[int]] = {}
        self.finals: dict[str, int] = {}
        self.errors: dict[str, BaseException] = {}
        self.drafts: list[tuple[str, float, float]] = []  # (request, started, ended)
        self.steps: list[tuple[list[str], float, float]] = []  # (requests, started, ended)
        self.opens: list[str] = []
        self.releases: list[str] = []
        self.commits: list[int] = []  # rounds per commit call
        self.fail_verify: set[str] = set()
        self.ahead_used: list[bool] = []
        self.runs: list[list[int]] = []  # Request.steps of each step's rounds

    def plan_round(self, request, room):
        return RoundOrder(min(self.depth[request.request_id], room), ["fake"])

    def plan_ahead(self, request, order, tree, room, live):
        return RoundOrder(min(order.depth, room) + 1, ["fake"]) if self.ahead and live == 1 else None

    async def draft(self, request, order):
        started = self.clock.now()
        await self.clock.sleep(self.draft_s[request.request_id])
        pos = len(request.generated) + len(order.context)
        if order.context:  # drafting ahead: the first level guesses the bonus token
            tokens = [target_token(request.request_id, pos + i) for i in range(order.depth)]
        else:
            tokens = [target_token(request.request_id, pos + i) if i < self.good else 1 for i in range(order.depth)]
        self.drafts.append((request.request_id, started, self.clock.now()))
        return Draft(DraftTree.chain(tokens, [0.9] * len(tokens)), ["fake"])

    async def verify(self, rounds, opens, releases):
        started = self.clock.now()
        self.opens += [r.request_id for r in opens]
        self.releases += list(releases)
        runs = [r.steps if not len(tree) else 1 for r, tree in rounds]
        if rounds:
            await self.clock.sleep(self.step_s(len(rounds)) * max(runs))
        self.steps.append(([r.request_id for r, _ in rounds], started, self.clock.now()))
        self.runs.append(runs)
        out = []
        for request, tree in rounds:
            if request.request_id in self.fail_verify:
                out.append(RuntimeError("verifier lost it"))
                continue
            pos = len(request.generated)
            accepted = 0
            for i, tok in enumerate(tree.tokens):  # a chain
                if tok != target_token(request.request_id, pos + i):
                    break
                accepted += 1
            plain = request.steps if not len(tree) else 1  # a decode run: that many plain steps
            tokens = [target_token(request.request_id, pos + i) for i in range(accepted + plain)]
            out.append(Verdict(tokens, accepted))
        return out

    async def commit(self, rounds):
        self.commits.append(len(rounds))
        await self.clock.sleep(0.001)
        return [None] * len(rounds)

    def emit(self, request, emission):
        if emission.error is not None:
            self.errors[request.request_id] = emission.error
            return
        self.out.setdefault(request.request_id, []).extend(emission.token_ids)
        if emission.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finals[request.request_id] = emission.finish_reason

    def learn(self, request, record):
        pass

    def observe_ahead(self, request, draft, order, used):
        self.ahead_used.append(used)


def request(rid: str, max_new: int = 12) -> Request:
    return Request(rid, prompt_len=5, max_new_tokens=max_new, max_context=1000)


def expected(rid: str, n: int) -> list[int]:
    return [target_token(rid, i) for i in range(n)]


async def run_loop(ports: FakePorts, clock: VirtualClock, requests, at: dict[str, float] | None = None, limits=None,
                   limit_s: float = 1000.0, **options) -> StepLoop:
    loop = StepLoop(ports, limits or BatchLimits(max_requests=16), clock, **options)
    at = at or {}
    pending = sorted(requests, key=lambda r: at.get(r.request_id, 0.0))

    async def arrivals():
        for r in pending:
            delay = at.get(r.request_id, 0.0) - clock.now()
            if delay > 0:
                await clock.sleep(delay)
            loop.add(r)

    feeder = asyncio.ensure_future(arrivals())
    ids = {r.request_id for r in requests}
    await clock.run(lambda: feeder.done() and ids <= set(ports.finals) | set(ports.errors), limit_s)
    await clock.run(lambda: not any(loop._releases.values()) and not loop._steps)  # the ended requests' releases went out
    await loop.close()
    return loop


async def test_each_verifier_lane_has_its_own_steps_at_the_same_time():
    clock = VirtualClock()
    lanes = {"a": "v0", "b": "v0", "c": "v1", "d": "v1", "e": "v1"}
    ports = FakePorts(clock, depth={i: 2 for i in lanes}, draft_s={i: 0.02 for i in lanes})
    requests = []
    for rid, lane in lanes.items():
        r = request(rid, 10)
        r.lane = lane
        requests.append(r)
    await run_loop(ports, clock, requests)
    steps = [(s, t0, t1) for s, t0, t1 in ports.steps if s]
    assert all(len({lanes[r] for r in s}) == 1 for s, _, _ in steps)  # a step never mixes verifiers
    v0 = [(t0, t1) for s, t0, t1 in steps if lanes[s[0]] == "v0"]
    v1 = [(t0, t1) for s, t0, t1 in steps if lanes[s[0]] == "v1"]
    assert any(a0 < b1 and b0 < a1 for a0, a1 in v0 for b0, b1 in v1)  # the two verifiers verify at once
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(v0, v0[1:]))  # one step in flight per verifier
    assert sorted(ports.releases) == sorted(lanes)
    for rid in lanes:
        assert ports.out[rid] == expected(rid, 10)


async def test_with_speculation_off_four_requests_are_one_batch_every_step():
    clock = VirtualClock()
    ids = ["a", "b", "c", "d"]
    ports = FakePorts(clock, depth={i: 0 for i in ids}, draft_s={i: 0.0 for i in ids})
    await run_loop(ports, clock, [request(i, 10) for i in ids])
    rounds = [s for s, _, _ in ports.steps if s]
    assert len(rounds) == 10
    assert all(sorted(s) == ids for s in rounds)
    assert ports.commits == [4] * 10  # one commit call per step
    for i in ids:
        assert ports.out[i] == expected(i, 10)
        assert ports.finals[i] == common_pb2.FINISH_REASON_LENGTH
    assert sorted(ports.opens) == ids and ports.opens[:4] == sorted(ports.opens)  # opened with their first round


async def test_requests_arriving_during_a_step_join_the_next():
    clock = VirtualClock()
    ids = ["a", "b", "c"]
    ports = FakePorts(clock, depth={i: 0 for i in ids}, draft_s={i: 0.0 for i in ids})
    await run_loop(ports, clock, [request(i, 6) for i in ids], at={"a": 0.0, "b": 0.05, "c": 0.12})
    rounds = [s for s, _, _ in ports.steps if s]
    assert rounds[0] == ["a"]
    assert sorted(rounds[1]) == ["a", "b"]  # b arrived during step 1
    assert sorted(rounds[2]) == ["a", "b", "c"]  # c arrived during step 2
    for i in ids:
        assert ports.out[i] == expected(i, 6)


async def test_speculation_commits_the_targets_tokens_whatever_the_drafts():
    clock = VirtualClock()
    ids = ["x", "y", "z"]
    for good in (0, 1, 3):
        ports = FakePorts(clock, depth={"x": 3, "y": 4, "z": 0}, draft_s={i: 0.02 for i in ids}, good=good)
        await run_loop(ports, clock, [request(i, 15) for i in ids])
        for i in ids:
            assert ports.out[i] == expected(i, 15), (good, i)
    # with good drafts, fewer rounds than tokens
    assert len([s for s, _, _ in ports.steps if "x" in s]) < 15


async def test_a_step_does_not_wait_for_a_slow_draft_when_waiting_does_not_pay():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"fast": 0, "slow": 2}, draft_s={"fast": 0.0, "slow": 5.0})
    await run_loop(ports, clock, [request("fast", 40), request("slow", 4)])
    slow_steps = [(s, start) for s, start, _ in ports.steps if "slow" in s]
    first_slow = slow_steps[0][1]
    assert first_slow >= 5.0
    fast_before = [s for s, start, _ in ports.steps if start < first_slow and s]
    assert len(fast_before) >= 40  # fast finished its 40 rounds (0.1 s each) while slow drafted
    assert all(s == ["fast"] for s in fast_before)
    assert ports.out["slow"] == expected("slow", 4) and ports.out["fast"] == expected("fast", 40)


async def test_a_step_waits_for_a_draft_that_is_nearly_ready():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"plain": 0, "spec": 2}, draft_s={"plain": 0.0, "spec": 0.01}, good=0)
    await run_loop(ports, clock, [request("plain", 20), request("spec", 20)])
    rounds = [s for s, _, _ in ports.steps if s]
    # after the first steps (no step time known yet), they meet in every step: 0.01 s of waiting saves spec a step
    together = [s for s in rounds[2:] if sorted(s) == ["plain", "spec"]]
    assert len(together) >= len(rounds[2:]) - 1 and len(together) >= 15


async def test_drafting_of_one_group_overlaps_the_verification_of_the_other():
    clock = VirtualClock()
    ids = ["a", "b"]
    ports = FakePorts(clock, depth={i: 2 for i in ids}, draft_s={i: 0.1 for i in ids}, good=1)
    await run_loop(ports, clock, [request(i, 12) for i in ids], at={"a": 0.0, "b": 0.05})
    overlaps = 0
    for members, vs, ve in ports.steps:
        for rid, ds, de in ports.drafts:
            if rid not in members and ds < ve and de > vs:  # drafted while another group was verified
                overlaps += 1
    assert overlaps >= 5
    # a request's next draft starts the moment its step's commit is done: no idle gap
    a_steps = [ve for members, _, ve in ports.steps if "a" in members]
    a_drafts = [ds for rid, ds, _ in ports.drafts if rid == "a"]
    assert all(any(abs(ds - (ve + 0.001)) < 1e-9 for ds in a_drafts) for ve in a_steps[:-1])
    for i in ids:
        assert ports.out[i] == expected(i, 12)


async def test_drafting_ahead_with_one_request_is_used_when_the_round_goes_as_assumed():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"solo": 3}, draft_s={"solo": 0.02}, good=3, ahead=True)
    await run_loop(ports, clock, [request("solo", 30)])
    assert ports.out["solo"] == expected("solo", 30)
    assert any(ports.ahead_used)


async def test_a_failed_round_fails_its_request_only_and_releases_it():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"ok": 0, "bad": 0}, draft_s={"ok": 0.0, "bad": 0.0})
    ports.fail_verify.add("bad")
    await run_loop(ports, clock, [request("ok", 5), request("bad", 5)])
    assert isinstance(ports.errors["bad"], RuntimeError)
    assert ports.out["ok"] == expected("ok", 5)
    assert "bad" in ports.releases


async def test_a_cancelled_request_leaves_the_loop_and_is_released():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"stay": 0, "go": 2}, draft_s={"stay": 0.0, "go": 0.3})
    loop = StepLoop(ports, BatchLimits(), clock)
    loop.add(request("stay", 30))
    loop.add(request("go", 30))
    await clock.run(lambda: "go" in ports.out)  # go's first round is done
    loop.cancel("go")
    await clock.run(lambda: "stay" in ports.finals)
    await loop.close()
    assert "go" in ports.releases and "go" not in loop.requests
    assert ports.out["stay"] == expected("stay", 30)
    assert len(ports.out["go"]) < 30


def test_waiting_pays_only_when_the_draft_is_soon_compared_to_a_step():
    step = lambda n: 0.1  # noqa: E731 - batching is free in this model
    assert drafts_to_wait_for(2, [0.01, 0.02], step) == 2
    assert drafts_to_wait_for(2, [1.0], step) == 0
    assert drafts_to_wait_for(3, [0.01, 5.0], step) == 1
    assert drafts_to_wait_for(0, [0.3], step) == 1  # nothing ready: the step is the draft's
    assert drafts_to_wait_for(1, [], step) == 0
    # a step whose time grows with the batch makes waiting pay less
    assert drafts_to_wait_for(4, [0.01], lambda n: 0.1 * n) == 0
    assert drafts_to_wait_for(4, [0.01], lambda n: 0.1) == 1
    # waiting delays every ready request: with more of them, it pays less
    assert drafts_to_wait_for(1, [0.04], step) == 1
    assert drafts_to_wait_for(4, [0.04], step) == 0


@pytest.mark.parametrize("limit", [1, 2, 3])
async def test_the_batch_respects_the_request_cap(limit):
    clock = VirtualClock()
    ids = ["a", "b", "c", "d"]
    ports = FakePorts(clock, depth={i: 0 for i in ids}, draft_s={i: 0.0 for i in ids})
    await run_loop(ports, clock, [request(i, 4) for i in ids], limits=BatchLimits(max_requests=limit))
    assert max(len(s) for s, _, _ in ports.steps) == limit
    for i in ids:
        assert ports.out[i] == expected(i, 4)


async def test_a_port_that_raises_fails_the_live_requests_and_the_loop_serves_on():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"a": 0, "b": 0}, draft_s={"a": 0.0, "b": 0.0})
    broken = {"on": True}
    learn = ports.learn

    def learn_once_broken(request, record):
        if broken.pop("on", False):
            raise KeyError("a metrics bug")
        learn(request, record)

    ports.learn = learn_once_broken
    loop = StepLoop(ports, BatchLimits(), clock)
    loop.add(request("a", 5))
    await clock.run(lambda: "a" in ports.errors)
    assert isinstance(ports.errors["a"], KeyError) and not loop.requests
    loop.add(request("b", 5))
    await clock.run(lambda: "b" in ports.finals)
    await loop.close()
    assert ports.out["b"] == expected("b", 5)


async def test_plain_rounds_decode_in_runs_with_the_same_tokens_and_fewer_commits():
    clock = VirtualClock()
    ids = ["a", "b", "c", "d"]
    ports = FakePorts(clock, depth={i: 0 for i in ids}, draft_s={i: 0.0 for i in ids})
    await run_loop(ports, clock, [request(i, 10) for i in ids], decode_steps=4, decode_run_s=1.0)
    # the opening step gives the first token at once; then runs of 4, cut to the 10 tokens asked for
    assert [r for r in ports.runs if r] == [[1] * 4, [4] * 4, [4] * 4, [1] * 4]
    assert ports.commits == [4] * 4
    for i in ids:
        assert ports.out[i] == expected(i, 10)
        assert ports.finals[i] == common_pb2.FINISH_REASON_LENGTH


async def test_a_step_with_a_draft_tree_runs_one_step_for_all():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"plain": 0, "spec": 2}, draft_s={"plain": 0.0, "spec": 0.01}, good=1)
    await run_loop(ports, clock, [request("plain", 12), request("spec", 12)], decode_steps=4, decode_run_s=1.0)
    for members, runs in zip((s for s, _, _ in ports.steps), ports.runs):
        if "spec" in members:
            assert runs == [1] * len(members)  # its verdict would otherwise wait for the plain request's run
    assert any(r == [4] for r in ports.runs)  # alone, the plain request runs
    assert ports.out["plain"] == expected("plain", 12) and ports.out["spec"] == expected("spec", 12)


async def test_a_decode_run_fits_its_time_budget_by_the_recent_step_time():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"a": 0}, draft_s={"a": 0.0}, step_s=lambda n: 0.04)
    await run_loop(ports, clock, [request("a", 20)], decode_steps=8, decode_run_s=0.1)
    assert max(max(r) for r in ports.runs if r) == 2  # 0.1 s holds two steps of 0.04 s
    assert ports.out["a"] == expected("a", 20)


async def test_a_decode_run_ends_where_its_first_request_ends():
    clock = VirtualClock()
    ports = FakePorts(clock, depth={"short": 0, "long": 0}, draft_s={"short": 0.0, "long": 0.0})
    await run_loop(ports, clock, [request("short", 6), request("long", 14)], decode_steps=4, decode_run_s=1.0)
    # after the opening step, short has 5 tokens to go: a run of 4, then one of 1 (where it ends; a request
    # arriving then would start with the next step), then long alone
    assert [r for r in ports.runs if r] == [[1, 1], [4, 4], [1, 1], [4], [4]]
    assert ports.out["short"] == expected("short", 6) and ports.out["long"] == expected("long", 14)


class LookupPorts(FakePorts):
    """A verifier whose lookup finds the target's next `found` tokens before every plain step of a request that
    allows it (Request.lookup), and one wrong token after them."""

    def __init__(self, *args, found: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.found = found
        self.committed: list[tuple[str, int, int]] = []  # (request, drafted, accepted) per commit entry
        self.emitted: dict[str, list[tuple[int, int]]] = {}

    async def verify(self, rounds, opens, releases):
        out = await super().verify(rounds, opens, releases)
        verdicts = []
        for (request, tree), v in zip(rounds, out):
            if len(tree) or not request.lookup or isinstance(v, BaseException):
                verdicts.append(v)
                continue
            pos, tokens, drafted, accepted = len(request.generated), [], 0, 0
            for _ in range(request.steps):  # each step gives the found tokens and its own
                k = min(self.found, request.lookup)
                tokens += [target_token(request.request_id, pos + len(tokens) + i) for i in range(k + 1)]
                drafted, accepted = drafted + min(k + 1, request.lookup), accepted + k
            verdicts.append(Verdict(tokens, 0, v.compute_s, drafted, accepted))
        return verdicts

    async def commit(self, rounds):
        self.committed += [(r.request_id, drafted, accepted) for r, _, drafted, accepted in rounds]
        return await super().commit(rounds)

    def emit(self, request, emission):
        super().emit(request, emission)
        if emission.error is None:
            self.emitted.setdefault(request.request_id, []).append((emission.drafted, emission.accepted))


async def test_the_verifiers_lookup_is_counted_apart_from_the_drafters_and_never_passes_the_length():
    clock = VirtualClock()
    ports = LookupPorts(clock, depth={"look": 0, "plain": 0}, draft_s={"look": 0.0, "plain": 0.0}, found=2)
    look, plain = request("look", 20), request("plain", 20)
    look.lookup = 4
    await run_loop(ports, clock, [look, plain], decode_steps=2, decode_run_s=1.0)
    assert ports.out["look"] == expected("look", 20) and ports.out["plain"] == expected("plain", 20)
    assert 0 < look.lookup_accepted <= look.lookup_drafted and plain.lookup_drafted == 0
    assert look.lookup_accepted <= 20 - look.rounds  # each round commits one token of the target's own
    # the drafters' counts (what commits, emissions and their learning see) hold no lookup
    assert look.drafted == look.accepted == 0 and all(d == a == 0 for _, d, a in ports.committed)
    assert all(e == (0, 0) for e in ports.emitted["look"])
    assert look.rounds < plain.rounds  # three tokens a step
