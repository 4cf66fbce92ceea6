"""Pub/sub desired-state hints. A hint only says "re-read desired_state()": messages
are lost while a subscriber is disconnected, so replicas also reconcile periodically."""

from __future__ import annotations

import json
import time

import redis
import redis.asyncio

from cluster.client import REDIS_ERRORS, unavailable
from cluster.records import Hint

_ERRORS = REDIS_ERRORS


def parse_hint(message: dict | None) -> Hint | None:
    if message is None or message.get("type") != "message":
        return None
    data = json.loads(message["data"])
    return Hint(version=int(data["version"]), adapter=data["adapter"], change=data["change"])


class HintSubscription:
    """Sync subscription to `{ns}:hints`; use as a context manager.

    get(timeout_s) -> Hint | None waits up to timeout_s for the next hint.
    """

    def __init__(self, client: redis.Redis, channel: str, url: str):
        self._url = url
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            self._pubsub.subscribe(channel)
        except _ERRORS as e:
            raise unavailable(url, e) from e

    def get(self, timeout_s: float) -> Hint | None:
        # get_message returns None for consumed (un)subscribe confirmations too
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                if hint := parse_hint(self._pubsub.get_message(timeout=left)):
                    return hint
        except _ERRORS as e:
            raise unavailable(self._url, e) from e
        return None

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> HintSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHintSubscription:
    """asyncio subscription to `{ns}:hints`: `async with` it, then `await get(t)`."""

    def __init__(self, client: redis.asyncio.Redis, channel: str, url: str):
        self._url, self._channel = url, channel
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)

    async def get(self, timeout_s: float) -> Hint | None:
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                if hint := parse_hint(await self._pubsub.get_message(timeout=left)):
                    return hint
        except _ERRORS as e:
            raise unavailable(self._url, e) from e
        return None

    async def __aenter__(self) -> AsyncHintSubscription:
        try:
            await self._pubsub.subscribe(self._channel)
        except _ERRORS as e:
            raise unavailable(self._url, e) from e
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._pubsub.aclose()
