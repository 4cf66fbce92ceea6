"""ReplicaLease: keeps one replica registered and its lease renewed.

A replica calls `beat()` every `interval_s` (well under ttl_s; `start_thread`
does it for you). Each beat renews the lease; when the lease is gone (it lapsed,
or Redis restarted and lost everything) the beat re-registers, gets a new epoch
and calls `on_register(epoch)` so the replica can re-report what it holds. When
Redis is unreachable a beat returns without raising and the next one retries.
A StaleEpoch (a newer incarnation took the id) is final: the lease stops and the
replica must stop writing. When `on_register` fails (say it re-reports an adapter a
restarted, empty Redis no longer knows) the error is logged and the call is retried on
each later beat until it succeeds; the lease itself is kept either way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cluster.records import REPLICA_POOLS, check_choice
from cluster.registry import Registry
from lora_core.errors import LoraFleetError, RegistryUnavailable, StaleEpoch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    """replica_id: unique per replica. pool: "prefill" | "decode" | "mixed".
    deployment: the Serve deployment name. slot_capacity: GPU adapter slots (>= 0).
    ttl_s: lease lifetime. interval_s: heartbeat period (< ttl_s / 2 so one lost
    beat never lapses the lease)."""

    replica_id: str
    pool: str
    deployment: str
    slot_capacity: int
    ttl_s: float = 10.0
    interval_s: float = 3.0

    def __post_init__(self) -> None:
        check_choice("pool", self.pool, REPLICA_POOLS)
        if not 0 < self.interval_s < self.ttl_s / 2:
            raise ValueError(
                f"interval_s={self.interval_s}, ttl_s={self.ttl_s}; allowed: 0 < interval_s < ttl_s / 2"
            )


class ReplicaLease:
    """Drives register + heartbeat for one replica. `epoch` is None until registered."""

    def __init__(
        self,
        registry: Registry,
        config: LeaseConfig,
        on_register: Callable[[int], None] | None = None,
    ):
        self.registry = registry
        self.config = config
        self.on_register = on_register
        self.epoch: int | None = None
        self.fenced = False
        self._reported = True  # False while on_register has not yet succeeded for epoch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> int | None:
        """One heartbeat (or re-registration). Returns the epoch holding the lease, or
        None when Redis is unreachable. Raises StaleEpoch once fenced off."""
        if self.fenced:
            raise StaleEpoch(f"replica {self.config.replica_id!r} was fenced off")
        c = self.config
        try:
            if self.epoch is not None and self.registry.heartbeat(
                c.replica_id, self.epoch, c.ttl_s
            ):
                if not self._reported:
                    self._report(self.epoch)
                return self.epoch
            return self._register()
        except RegistryUnavailable as e:
            log.warning("heartbeat of %s failed: %s", c.replica_id, e)
            return None
        except StaleEpoch:
            self.fenced = True
            raise

    def _register(self) -> int:
        c = self.config
        self.epoch = self.registry.register_replica(
            c.replica_id, c.pool, c.deployment, c.slot_capacity, c.ttl_s
        )
        self._reported = False
        self._report(self.epoch)
        return self.epoch

    def _report(self, epoch: int) -> None:
        """Run on_register(epoch); a failure is logged and retried on the next beat (a
        registry outage or a fencing error propagates as from any beat)."""
        if self.on_register is not None:
            try:
                self.on_register(epoch)
            except (RegistryUnavailable, StaleEpoch):
                raise
            except LoraFleetError as e:
                log.warning("replica %s: re-reporting after registration failed (%s); "
                            "retrying next beat", self.config.replica_id, e)  # fmt: skip
                return
        self._reported = True

    def start_thread(self) -> None:
        """Beat now, then every interval_s on a daemon thread until stop()."""
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="replica-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.beat()
            except StaleEpoch:
                log.error("replica %s fenced off; lease stopped", self.config.replica_id)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
