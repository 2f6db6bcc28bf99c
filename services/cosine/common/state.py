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

Redis faults are statuses, never crashes: an unreachable or timed-out Redis is
StoreUnavailable (UNAVAILABLE), a full one (maxmemory reached under the
`noeviction` policy) is StoreFull (RESOURCE_EXHAUSTED). The client's socket
timeouts (see `connect`) bound how long a call may take.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from cosine.common.errors import ServiceError

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


class StoreUnavailable(ServiceError):
    """Redis is unreachable, timed out, or not ready (loading, read-only)."""

    def __init__(self, what: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"the request state store (Redis) is unavailable ({what}); retry shortly")


class StoreFull(ServiceError):
    """Redis refused a write: it reached its memory limit (policy noeviction)."""

    def __init__(self):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         "the request state store (Redis) is full; retry later (operators: raise its maxmemory or lower state TTLs)")


class StaleCommit(ServiceError):
    """A commit whose step fence no longer matches: another writer moved on (ABORTED), or the request's
    state is gone, say after Redis restarted without persistence (UNAVAILABLE: retry the request)."""

    def __init__(self, request_id: str, step: int, missing: bool):
        if missing:
            super().__init__(grpc.StatusCode.UNAVAILABLE,
                             f"request {request_id}: its state is gone from the request state store (Redis restarted?); retry the request")
        else:
            super().__init__(grpc.StatusCode.ABORTED, f"request {request_id}: commit for step {step} rejected: another writer moved on")
        self.missing = missing


def _store_errors(method):
    """Redis faults → StoreUnavailable / StoreFull; other errors (bugs) pass as they are."""
    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, asyncio.TimeoutError, ConnectionError) as exc:
            raise StoreUnavailable("timed out" if isinstance(exc, (redis_errors.TimeoutError, asyncio.TimeoutError, TimeoutError))
                                   else "unreachable") from exc
        except redis_errors.ResponseError as exc:
            text = str(exc)
            if isinstance(exc, redis_errors.OutOfMemoryError) or text.startswith("OOM") or "OOM command not allowed" in text:
                raise StoreFull() from exc
            if isinstance(exc, redis_errors.ReadOnlyError) or text.startswith(("READONLY", "MASTERDOWN", "LOADING", "BUSY")):
                raise StoreUnavailable("not accepting writes now") from exc
            raise
    return wrapper


def _store_error_of(exc: BaseException) -> BaseException:
    """One reply's error in a pipeline (read with raise_on_error=False) as `_store_errors` maps it."""
    if isinstance(exc, redis_errors.ResponseError):
        text = str(exc)
        if isinstance(exc, redis_errors.OutOfMemoryError) or text.startswith("OOM") or "OOM command not allowed" in text:
            return StoreFull()
        if isinstance(exc, redis_errors.ReadOnlyError) or text.startswith(("READONLY", "MASTERDOWN", "LOADING", "BUSY")):
            return StoreUnavailable("not accepting writes now")
    return exc


def connect(url: str, timeout_s: float = 2.0) -> aioredis.Redis:
    """A Redis client whose every call fails within about twice ``timeout_s`` (one quick retry for a blip)."""
    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                             retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1))


class RequestStore:
    """Reads and writes request state; one instance per service, given its Redis client."""

    def __init__(self, client: aioredis.Redis, ttl_s: int = 3600, finished_ttl_s: int = 600):
        self.client = client
        self.ttl_s = ttl_s
        self.finished_ttl_s = finished_ttl_s
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)

    @_store_errors
    async def ping(self) -> bool:
        """True when Redis answers (StoreUnavailable otherwise)."""
        return bool(await self.client.ping())

    async def reachable(self) -> bool:
        try:
            return await self.ping()
        except ServiceError:
            return False

    @_store_errors
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

    @_store_errors
    async def commit(self, request_id: str, step: int, token_ids: list[int], drafted: int, accepted: int,
                     policy: dict | None = None) -> int:
        """Append the tokens of round `step` (and replace the policy state, when given); returns the next step.
        Raises StaleCommit if fenced off."""
        args = [step, self.ttl_s, drafted, accepted, len(token_ids), *token_ids]
        if policy is not None:
            args.append(json.dumps(policy, separators=(",", ":")))
        result = await self._commit(keys=[req_key(request_id), tokens_key(request_id)], args=args)
        if result != 1:
            raise StaleCommit(request_id, step, missing=result == -1)
        return step + 1

    @_store_errors
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
                out.append(_store_error_of(reply))
            elif reply != 1:
                out.append(StaleCommit(request_id, step, missing=reply == -1))
            else:
                out.append(None)
        return out

    @_store_errors
    async def finish(self, request_id: str, status: str, finish_reason: str = "") -> None:
        """Mark the request ended (finished, cancelled, failed); keeps it for finished_ttl_s."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(req_key(request_id), mapping={"status": status, "finish_reason": finish_reason, "ended_at": time.time()})
            pipe.expire(req_key(request_id), self.finished_ttl_s)
            pipe.expire(tokens_key(request_id), self.finished_ttl_s)
            await pipe.execute()

    @_store_errors
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
