"""Redis connection settings and the sync / asyncio plan executors.

Both executors run a `cluster.ops.Plan` in exactly one round trip (EVALSHA, with
redis-py's transparent reload when the script cache is empty, e.g. after a Redis
restart) and turn every Redis failure into `RegistryUnavailable` naming the URL
(connection failures after the retry policy is spent; a refused password, a missing
database, a non-Redis server or an ACL denial at once; when a command passes its
deadline), so no caller ever sees a redis-py exception.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.retry

from cluster.ops import Plan
from cluster.scripts import SCRIPTS
from lora_core.errors import RegistryUnavailable

T = TypeVar("T")
DEFAULT_URL = "redis://127.0.0.1:6379/0"
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
# What the sync executor retries: the connection failures a reconnect may cure. Refused
# credentials are ConnectionErrors too, but asking again cannot help.
_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)
_FINAL = (redis.AuthenticationError, redis.exceptions.AuthorizationError)
# Everything a command can raise from Redis or the socket (redis.RedisError covers the
# protocol, response and authentication errors too).
REDIS_ERRORS = (redis.RedisError, OSError)
_URL_FORM = "redis://[USER]:PASSWORD@HOST:PORT/DB"


@dataclass(frozen=True)
class RetryPolicy:
    """How a client rides out Redis outages before raising RegistryUnavailable.

    retries: reconnect attempts per command after the first failure (>= 0).
    backoff_base_s / backoff_cap_s: exponential backoff with jitter between attempts.
    connect_timeout_s: TCP connect timeout per attempt.
    socket_timeout_s: read timeout per command.
    deadline_s: the most one command may take, retries included: a Redis that accepts
        connections but does not answer (stopped, partitioned, overloaded) would
        otherwise hold a caller for (retries + 1) x socket_timeout_s. It also bounds the
        longest legitimate command (the registry's slowest script, a whole-catalog
        listing, takes ~45 ms per 1k adapters). The asyncio client cancels at the
        deadline; the sync one waits at most min(socket_timeout_s, deadline_s) per
        attempt and retries only while the deadline has time left, so a Redis that
        answers nothing fails at the deadline, a flapping one within 2 x deadline_s.
    deadline_advice: what the deadline's RegistryUnavailable offers besides a Redis that
        answers (the CLI names its --redis-timeout).
    """

    retries: int = 5
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 0.5
    connect_timeout_s: float = 1.0
    socket_timeout_s: float = 5.0
    deadline_s: float = 3.0
    deadline_advice: str = "retry later"

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries={self.retries}; allowed: >= 0")
        timeouts = ("connect_timeout_s", "socket_timeout_s", "deadline_s")
        for field in ("backoff_base_s", "backoff_cap_s", *timeouts):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}={getattr(self, field)}; allowed: > 0")

    def _backoff(self) -> redis.backoff.AbstractBackoff:
        return redis.backoff.ExponentialWithJitterBackoff(
            cap=self.backoff_cap_s, base=self.backoff_base_s
        )

    def sync_retry(self) -> redis.retry.Retry:
        return redis.retry.Retry(self._backoff(), self.retries)

    def async_retry(self) -> redis.asyncio.retry.Retry:
        return redis.asyncio.retry.Retry(self._backoff(), self.retries)


def redact(url: str) -> str:
    """The URL with any password replaced by '***' (safe for error messages): the one in
    the user info, and every `password=` query argument (redis-py passes query arguments
    to the connection, so `?password=` works, and is the only place for one in unix://)."""
    base, sep, query = url.partition("?")
    return _redact_userinfo(base) + sep + re.sub(r"(^|&)password=[^&#]*", r"\1password=***", query)


def _redact_userinfo(url: str) -> str:
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # unparseable (a broken IPv6 host, a bad port): mask all userinfo
        return re.sub(r"//[^/@]*@", "//***@", url)
    if password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def unavailable(url: str, err: BaseException) -> RegistryUnavailable:
    """The RegistryUnavailable for err, saying what went wrong and what would work."""
    where, text = redact(url), str(err).strip() or type(err).__name__
    if isinstance(err, redis.AuthenticationError) or "NOAUTH" in text:
        if where == url:  # no password in the URL
            return RegistryUnavailable(
                f"Redis at {where} requires a password ({text}); allowed: a URL "
                f"carrying it, {_URL_FORM}"
            )
        return RegistryUnavailable(
            f"Redis at {where} refused the user / password of the URL ({text}); "
            f"allowed: the credentials it expects, {_URL_FORM}"
        )
    if isinstance(err, redis.exceptions.NoPermissionError):
        return RegistryUnavailable(
            f"Redis at {where} denied a command to the URL's user ({text}); allowed: a user "
            "whose ACL permits the registry's commands (EVALSHA, SCRIPT LOAD, and the "
            "GET / SET / HGETALL / SMEMBERS / PUBLISH / SUBSCRIBE family)"
        )
    if isinstance(err, _CONNECTION_ERRORS):
        return RegistryUnavailable(f"cannot reach Redis at {where}: {text}")
    if isinstance(err, redis.InvalidResponse):
        return RegistryUnavailable(
            f"the server at {where} does not speak the Redis protocol ({text}); "
            "allowed: the URL of a Redis server"
        )
    return RegistryUnavailable(f"Redis at {where} refused the request: {text}")


def no_answer(url: str, policy: RetryPolicy) -> RegistryUnavailable:
    """The RegistryUnavailable of a command that passed policy.deadline_s."""
    return RegistryUnavailable(
        f"Redis at {redact(url)} did not answer within {policy.deadline_s:g} s (retries "
        f"included); allowed: a Redis that answers, {policy.deadline_advice}"
    )


def check_url(url: str) -> str:
    """url if redis-py can connect with it, else the ValueError `_from_url` raises."""
    _from_url(redis.connection.parse_url, url)
    return url


def _from_url(make: Any, url: str, **options: Any) -> Any:
    """make(url, **options), with a malformed URL refused as a ValueError naming it."""
    try:
        _check_db(url)
        return make(url, **options)
    except ValueError as e:
        raise ValueError(
            f"redis url {redact(url)!r} is invalid ({e}); allowed: "
            "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS) or unix:///PATH"
        ) from e


def _check_db(url: str) -> None:
    """redis-py reads a path that is not a number (`redis://host/l`, a typo of /1) as no
    path at all, database 0: a command would then read and write another database."""
    parts = urlsplit(url)
    db = unquote(parts.path).strip("/")
    if parts.scheme.lower() in ("redis", "rediss") and db and not re.fullmatch("[0-9]+", db):
        raise ValueError(f"database {db!r} is not a number")


class SyncExecutor:
    """Runs plans on a thread-safe sync client (a pooled `redis.Redis`).

    It retries by itself rather than through redis-py (whose retries know no deadline):
    a failed attempt is retried after a backoff while attempts and the deadline are left.
    `client` (for pub/sub and callers of `Registry.client`) keeps redis-py's retries.
    """

    def __init__(self, url: str, ns: str, policy: RetryPolicy):
        self.url, self.ns, self.policy = url, ns, policy
        self.client = _from_url(
            redis.Redis.from_url,
            url,
            decode_responses=True,
            retry=policy.sync_retry(),
            socket_connect_timeout=policy.connect_timeout_s,
            socket_timeout=policy.socket_timeout_s,
        )
        self._commands = _from_url(
            redis.Redis.from_url,
            url,
            decode_responses=True,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            socket_connect_timeout=min(policy.connect_timeout_s, policy.deadline_s),
            socket_timeout=min(policy.socket_timeout_s, policy.deadline_s),
        )
        self._backoff = policy._backoff()
        self._scripts = {name: self._commands.register_script(src) for name, src in SCRIPTS.items()}

    def run(self, plan: Plan[T]) -> T:
        return plan.parse(self._send_retrying(plan))

    def _send_retrying(self, plan: Plan[Any]) -> Any:
        end, failures = time.monotonic() + self.policy.deadline_s, 0
        while True:
            try:
                return self._send(plan)
            except _FINAL as e:
                raise unavailable(self.url, e) from e
            except _RETRYABLE as e:
                failures += 1
                wait = self._backoff.compute(failures)
                late = time.monotonic() + wait >= end
                if late and isinstance(e, redis.TimeoutError):
                    raise no_answer(self.url, self.policy) from e
                if late or failures > self.policy.retries:
                    raise unavailable(self.url, e) from e
                time.sleep(wait)
            except REDIS_ERRORS as e:
                raise unavailable(self.url, e) from e

    def _send(self, plan: Plan[Any]) -> Any:
        if plan.script is None:
            return self._commands.execute_command(*plan.args)
        return self._scripts[plan.script](args=(self.ns, *plan.args))

    def close(self) -> None:
        self._commands.close()
        self.client.close()


ASYNC_MAX_CONNECTIONS = 64
"""Connections one asyncio client opens to Redis at most; more concurrent commands wait
for a free one (within the command's deadline)."""


class AsyncExecutor:
    """Runs plans on an asyncio client (bound to the event loop that first uses it).

    Its pool waits for a free connection: redis-py's default pool refuses a command
    beyond its 100th concurrent connection ("Too many connections"), so an ingress
    serving a few hundred requests at once answered some with 503 registry_unavailable
    while Redis was healthy."""

    def __init__(self, url: str, ns: str, policy: RetryPolicy):
        self.url, self.ns, self.policy = url, ns, policy
        pool = _from_url(
            redis.asyncio.BlockingConnectionPool.from_url,
            url,
            max_connections=ASYNC_MAX_CONNECTIONS,
            timeout=policy.deadline_s,
            decode_responses=True,
            retry=policy.async_retry(),
            socket_connect_timeout=policy.connect_timeout_s,
            socket_timeout=policy.socket_timeout_s,
        )
        self.client = redis.asyncio.Redis.from_pool(pool)  # closing it closes the pool
        self._scripts = {name: self.client.register_script(src) for name, src in SCRIPTS.items()}

    async def run(self, plan: Plan[T]) -> T:
        try:
            async with asyncio.timeout(self.policy.deadline_s):
                raw = await self._send(plan)
        except TimeoutError as e:  # the deadline (redis-py's own timeouts are RedisErrors)
            raise no_answer(self.url, self.policy) from e
        except REDIS_ERRORS as e:
            raise unavailable(self.url, e) from e
        return plan.parse(raw)

    async def _send(self, plan: Plan[Any]) -> Any:
        if plan.script is None:
            return await self.client.execute_command(*plan.args)
        return await self._scripts[plan.script](args=(self.ns, *plan.args))

    async def close(self) -> None:
        await self.client.aclose()
