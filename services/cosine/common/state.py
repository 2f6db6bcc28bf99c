"""Each request's progress in Redis: the source of truth any replica can resume from.

Keys share the hash tag `{<request_id>}` so they live in one cluster slot:

    cosine:{rid}:req      hash: prompt, sampling, params, step, counters, status, policy
    cosine:{rid}:tokens   list: committed output token ids, in order

Every write refreshes the TTL of both keys. `commit` is fenced by `step`: a
commit for a step other than the current one is rejected, so a stale or
repeated commit (a retried round) changes nothing. Ownership is fenced by an
`epoch`: `create` and `take_over` (a scheduler resuming a request whose stream
broke) each raise it and return the new value, and a commit, lease renewal or
finish carrying an older epoch is rejected, so an old owner that still runs
(stopped, partitioned) can no longer write. An owner holds a lease
(`lease_until`, Redis server time) that its commits and `renew_many` extend; a
running request whose lease ran out (its owner died) can be created afresh at
once instead of being refused as already running.
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

# Redis server time in milliseconds (one clock for every scheduler's leases)
_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# KEYS: req, tokens; ARGV: ttl, lease_ms, field, value, ...  → the new epoch, or 0 (running, its lease alive)
_CREATE = _NOW + """
if redis.call('HGET', KEYS[1], 'status') == 'running' and tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0') > now then
  return 0
end
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') + 1
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[1], 'epoch', epoch, 'lease_until', now + tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return epoch
"""

# KEYS: req, tokens; ARGV: ttl, lease_ms → the new epoch; -1: no such request; -2: it finished
_TAKE_OVER = _NOW + """
local status = redis.call('HGET', KEYS[1], 'status')
if status == false then return -1 end
if status == 'finished' then return -2 end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'finish_reason', '', 'lease_until', now + tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return epoch
"""

# ARGV: step, ttl, drafted, accepted, n, token × n, policy JSON or '', epoch or '', lease_ms or ''
_COMMIT = _NOW + """
local step = redis.call('HGET', KEYS[1], 'step')
if step == false then return -1 end
if step ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[5])
local policy, epoch, lease = ARGV[6 + n], ARGV[7 + n], ARGV[8 + n]
if epoch and epoch ~= '' and redis.call('HGET', KEYS[1], 'epoch') ~= epoch then return 0 end
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[5 + i]) end
redis.call('HINCRBY', KEYS[1], 'step', 1)
redis.call('HINCRBY', KEYS[1], 'rounds', 1)
redis.call('HINCRBY', KEYS[1], 'drafted', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'accepted', ARGV[4])
if policy and policy ~= '' then redis.call('HSET', KEYS[1], 'policy', policy) end
if lease and lease ~= '' then redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(lease)) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
if n > 0 or redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return 1
"""

# ARGV: epoch, ttl, lease_ms → 1, or 0 when another owner took the request over (or it is gone)
_RENEW = _NOW + """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[3]))
redis.call('EXPIRE', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return 1
"""

# ARGV: status, finish_reason, ended_at, finished_ttl, epoch or '' → 1, or 0 when fenced off
_FINISH = """
if ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finish_reason', ARGV[2], 'ended_at', ARGV[3], 'lease_until', 0)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
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
    epoch: int = 0  # the owner fence: raised by every create and take-over


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

    def __init__(self, client: aioredis.Redis, ttl_s: int = 3600, finished_ttl_s: int = 600, lease_s: float = 5.0):
        self.client = client
        self.ttl_s = ttl_s
        self.finished_ttl_s = finished_ttl_s
        self.lease_ms = max(1, int(lease_s * 1000))  # how long an owner's claim lasts without a commit or renewal
        self._create = client.register_script(_CREATE)
        self._take_over = client.register_script(_TAKE_OVER)
        self._commit = client.register_script(_COMMIT)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)

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
    async def create(self, request_id: str, prompt_token_ids: list[int], sampling: dict, params: dict) -> int:
        """Create a running request and own it: returns its epoch (≥ 1), or 0 if one with this id is running
        already and its owner's lease is alive. Ended requests, and running ones whose owner died (lease run
        out), are replaced; the epoch still rises, so their old owner is fenced off."""
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
        args = [self.ttl_s, self.lease_ms]
        for name, value in mapping.items():
            args += [name, value]
        return int(await self._create(keys=[key, tokens_key(request_id)], args=args))

    @_store_errors
    async def take_over(self, request_id: str) -> RequestState | None:
        """Own a request whose stream broke (its owner died, drains, or lost its caller), whatever the old
        owner's lease: the epoch rises, so the old owner's commits are refused from now on. Returns the state
        (with the new epoch; status 'finished' if it had ended — then nothing was taken over), or None if
        Redis has no such request."""
        keys = [req_key(request_id), tokens_key(request_id)]
        async with self.client.pipeline(transaction=True) as pipe:
            await self._take_over(keys=keys, args=[self.ttl_s, self.lease_ms], client=pipe)
            pipe.hgetall(keys[0])
            pipe.lrange(keys[1], 0, -1)
            epoch, fields, tokens = await pipe.execute()
        if int(epoch) == -1 or not fields:
            return None
        return _state(request_id, fields, tokens)

    @_store_errors
    async def commit(self, request_id: str, step: int, token_ids: list[int], drafted: int, accepted: int,
                     policy: dict | None = None, epoch: int | None = None) -> int:
        """Append the tokens of round `step` (and replace the policy state, when given); returns the next step.
        With `epoch`, only its owner may commit, and the commit extends its lease. Raises StaleCommit if fenced off."""
        args = self._commit_args(step, token_ids, drafted, accepted, policy, epoch)
        result = await self._commit(keys=[req_key(request_id), tokens_key(request_id)], args=args)
        if result != 1:
            raise StaleCommit(request_id, step, missing=result == -1)
        return step + 1

    @_store_errors
    async def commit_many(self, rounds: list[tuple]) -> list[BaseException | None]:
        """Commit many requests' rounds, each `(request_id, step, token_ids, drafted, accepted, policy[, epoch])`,
        in one pipeline (one round trip); each fenced like `commit`. One result per round: None, or the
        StaleCommit (or error) that round met."""
        if not rounds:
            return []
        replies = await self._run_many(self._commit, [
            ([req_key(request_id), tokens_key(request_id)],
             self._commit_args(step, token_ids, drafted, accepted, policy, epoch[0] if epoch else None))
            for request_id, step, token_ids, drafted, accepted, policy, *epoch in rounds])
        out: list[BaseException | None] = []
        for (request_id, step, *_), reply in zip(rounds, replies):
            if isinstance(reply, BaseException):
                out.append(_store_error_of(reply))
            elif reply != 1:
                out.append(StaleCommit(request_id, step, missing=reply == -1))
            else:
                out.append(None)
        return out

    async def _run_many(self, script, calls: list[tuple[list, list]]) -> list:
        """Run `script` once per (keys, args) in one pipeline (one round trip), by its SHA: redis-py's own
        pipelining of a registered script asks Redis whether it is loaded first, a second round trip per
        step. Calls Redis answers NOSCRIPT (restarted, script cache flushed) ran nothing: the script is
        loaded and those run again. One reply per call, errors as values."""
        replies: list = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            async with self.client.pipeline(transaction=False) as pipe:
                for i in todo:
                    keys, args = calls[i]
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                out = await pipe.execute(raise_on_error=False)
            for i, reply in zip(todo, out):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], redis_errors.NoScriptError)]
            if not todo or attempt:
                break
            await self.client.script_load(script.script)
        return replies

    def _commit_args(self, step, token_ids, drafted, accepted, policy, epoch) -> list:
        return [step, self.ttl_s, drafted, accepted, len(token_ids), *token_ids,
                "" if policy is None else json.dumps(policy, separators=(",", ":")),
                "" if epoch is None else str(epoch), "" if epoch is None else self.lease_ms]

    @_store_errors
    async def renew_many(self, owned: list[tuple[str, int]]) -> list[bool]:
        """Extend the leases of `(request_id, epoch)` pairs this owner holds, in one pipeline; False where
        another owner took the request over (or its state is gone)."""
        if not owned:
            return []
        replies = await self._run_many(self._renew, [
            ([req_key(request_id), tokens_key(request_id)], [str(epoch), self.ttl_s, self.lease_ms])
            for request_id, epoch in owned])
        return [r == 1 for r in replies]

    @_store_errors
    async def finish(self, request_id: str, status: str, finish_reason: str = "", epoch: int | None = None) -> bool:
        """Mark the request ended (finished, cancelled, failed); keeps it for finished_ttl_s. With `epoch`, only
        if that owner still holds it (False: another took it over, nothing written)."""
        result = await self._finish(keys=[req_key(request_id), tokens_key(request_id)],
                                    args=[status, finish_reason, time.time(), self.finished_ttl_s, "" if epoch is None else str(epoch)])
        return result == 1

    @_store_errors
    async def load(self, request_id: str) -> RequestState | None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(req_key(request_id))
            pipe.lrange(tokens_key(request_id), 0, -1)
            fields, tokens = await pipe.execute()
        if not fields:
            return None
        return _state(request_id, fields, tokens)


def _state(request_id: str, fields: dict, tokens: list) -> RequestState:
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
        policy=json.loads(f["policy"]) if f.get("policy") else None,
        epoch=int(f.get("epoch", 0)),
    )
