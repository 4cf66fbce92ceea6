"""asyncio helpers shared by the long-running loops of the replica, registry and router."""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise CancelledError if the running task has a cancel request outstanding.

    A cancel can be lost on its way down: Python 3.11's `asyncio.wait_for` (which
    redis-py's asyncio client uses for socket writes) returns the awaited result and
    drops the cancellation when both land in the same loop turn. A loop meant to run
    until cancelled, that then sleeps and goes round again, would never end, and
    `asyncio.run` or a shutdown waiting for it would hang. Such loops call this each
    round: the request stays counted on the task (`Task.cancelling`) even when the
    CancelledError itself was swallowed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("a cancel requested earlier was lost on the way down")
