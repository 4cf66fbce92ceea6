"""Bounded waits on observable state, for tests of live processes (Ray Serve, Redis).

A fixed sleep is too short on a loaded CI machine and too long everywhere else; these
polls end as soon as the state shows, and fail naming what they waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
    """The first truthy value `probe` returns, polled every interval_s; a TimeoutError
    naming `what` once timeout_s has passed without one (probed once more at the end).
    Example: wait_for(lambda: running_replicas() == 2, 90, "scaling up to 2 replicas")."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(interval_s)
