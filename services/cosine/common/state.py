"""Each request's progress in Redis: the source of truth any replica can resume from.

Keys share the hash tag `{<request_id>}` so they live in one cluster slot:

    cosine:{rid}:req      hash: prompt, sampling, params, step, counters, status, policy
    cosine:{rid}:tokens   list: committed output token ids, in order

Every write refreshes the TTL of both keys. `commit` is fenced by `step`: a
commit for a step other than the current one is rejected, so a stale or
repeated commit (a retried round, a replica that lost ownership) changes nothing.
A commit may carry the request's policy state (expertise routing's scores, the
acceptance estimate adaptive depth works from) as JSON, written in the same
atomic step, so a replica taking over continues from what the request learnt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

_CREATE = """
if redis.call('HGET', KEYS[1], 'status') == 'running' then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""

_COMMIT = """
local step = redis.call('HGET', KEYS[1], 'step')
if step == false then return -1 end
if step ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[5])
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[5 + i]) end
redis.call('HINCRBY', KEYS[1], 'step', 1)
redis.call('HINCRBY', KEYS[1], 'rounds', 1)
redis.call('HINCRBY', KEYS[1], 'drafted', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'accepted', ARGV[4])
if ARGV[6 + n] then redis.call('HSET', KEYS[1], 'policy', ARGV[6 + n]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
if n > 0 or redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return 1
"""


def req_key(request_id: str) -> str:
    return f"cosine:{{{request_id}}}:req"


def tokens_key(request_id: str) -> str:
    return f"cosine:{{{request_id}}}:tokens"


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict
    params: dict
    status: str
    step: int
    rounds: int
    drafted: int
    accepted: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    policy: dict | None = None  # the last commit's policy state, when it carried one


class StaleCommit(Exception):
    """A commit whose step fence no longer matches: another writer moved on."""


class RequestStore:
    """Reads and writes request state; one instance per service, given its Redis client."""

    def __init__(self, client: aioredis.Redis, ttl_s: int = 3600, finished_ttl_s: int = 600):
        self.client = client
        self.ttl_s = ttl_s
        self.finished_ttl_s = finished_ttl_s
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)

    async def create(self, request_id: str, prompt_token_ids: list[int], sampling: dict, params: dict) -> bool:
        """Create a running request; False if one with this id is running already (ended ones are replaced)."""
        key = req_key(request_id)
        mapping = {
            "prompt": json.dumps(prompt_token_ids),
            "sampling": json.dumps(sampling),
            "params": json.dumps(params),
            "status": "running",
            "step": 0,
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "request_id": request_id,
            "created_at": time.time(),
        }
        args = [self.ttl_s]
        for name, value in mapping.items():
            args += [name, value]
        return await self._create(keys=[key, tokens_key(request_id)], args=args) == 1

    async def commit(self, request_id: str, step: int, token_ids: list[int], drafted: int, accepted: int,
                     policy: dict | None = None) -> int:
        """Append the tokens of round `step` (and replace the policy state, when given); returns the next step.
        Raises StaleCommit if fenced off."""
        args = [step, self.ttl_s, drafted, accepted, len(token_ids), *token_ids]
        if policy is not None:
            args.append(json.dumps(policy, separators=(",", ":")))
        result = await self._commit(keys=[req_key(request_id), tokens_key(request_id)], args=args)
        if result != 1:
            raise StaleCommit(f"request {request_id}: commit for step {step} rejected ({'missing' if result == -1 else 'stale'})")
        return step + 1

    async def commit_many(self, rounds: list[tuple[str, int, list[int], int, int, dict | None]]) -> list[BaseException | None]:
        """Commit many requests' rounds, each `(request_id, step, token_ids, drafted, accepted, policy)`, in one
        pipeline (one round trip); each fenced like `commit`. One result per round: None, or the StaleCommit (or
        error) that round met."""
        if not rounds:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for request_id, step, token_ids, drafted, accepted, policy in rounds:
                args = [step, self.ttl_s, drafted, accepted, len(token_ids), *token_ids]
                if policy is not None:
                    args.append(json.dumps(policy, separators=(",", ":")))
                await self._commit(keys=[req_key(request_id), tokens_key(request_id)], args=args, client=pipe)
            replies = await pipe.execute(raise_on_error=False)
        out: list[BaseException | None] = []
        for (request_id, step, *_), reply in zip(rounds, replies):
            if isinstance(reply, BaseException):
                out.append(reply)
            elif reply != 1:
                out.append(StaleCommit(f"request {request_id}: commit for step {step} rejected "
                                       f"({'missing' if reply == -1 else 'stale'})"))
            else:
                out.append(None)
        return out

    async def finish(self, request_id: str, status: str, finish_reason: str = "") -> None:
        """Mark the request ended (finished, cancelled, failed); keeps it for finished_ttl_s."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(req_key(request_id), mapping={"status": status, "finish_reason": finish_reason, "ended_at": time.time()})
            pipe.expire(req_key(request_id), self.finished_ttl_s)
            pipe.expire(tokens_key(request_id), self.finished_ttl_s)
            await pipe.execute()

    async def load(self, request_id: str) -> RequestState | None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(req_key(request_id))
            pipe.lrange(tokens_key(request_id), 0, -1)
            fields, tokens = await pipe.execute()
        if not fields:
            return None
        f = {k.decode(): v.decode() for k, v in fields.items()}
        return RequestState(
            request_id=request_id,
            prompt_token_ids=json.loads(f["prompt"]),
            sampling=json.loads(f["sampling"]),
            params=json.loads(f["params"]),
            status=f["status"],
            step=int(f["step"]),
            rounds=int(f["rounds"]),
            drafted=int(f["drafted"]),
            accepted=int(f["accepted"]),
            token_ids=[int(t) for t in tokens],
            finish_reason=f.get("finish_reason", ""),
            policy=json.loads(f["policy"]) if "policy" in f else None,
        )
