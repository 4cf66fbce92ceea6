"""Desired-state watching for replicas: pub/sub hints for speed, periodic full reads for truth.

A hint is only a nudge (messages are lost while disconnected, and Redis may
restart), so every wake-up re-reads the whole desired state and the loop also
wakes every interval_s without a hint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from cluster.records import DesiredState
from cluster.registry import AsyncRegistry
from lora_core.aio import raise_if_cancelled
from lora_core.errors import RegistryUnavailable

log = logging.getLogger(__name__)


async def watch_desired_state(
    registry: AsyncRegistry, interval_s: float = 5.0
) -> AsyncIterator[DesiredState]:
    """Yield the desired state now, then each time its version changes.

    Wakes on a hint or every interval_s (the full reconcile). While Redis is
    unreachable it retries every interval_s and yields again once it is back if
    the version differs (a restarted Redis starts again from version 0).
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s={interval_s}; allowed: > 0")
    last: int | None = None
    while True:
        raise_if_cancelled()
        try:
            # subscribe before reading, so a change between the read and the wait is not missed
            async with registry.subscribe_hints() as hints:
                while True:
                    raise_if_cancelled()
                    state = await registry.desired_state()
                    if state.version != last:
                        last = state.version
                        yield state
                    await hints.get(interval_s)
        except RegistryUnavailable as e:
            log.warning("desired-state watch: %s; retrying in %.1f s", e, interval_s)
            await asyncio.sleep(interval_s)
