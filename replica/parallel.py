"""The tensor-parallel group of one replica (Megatron-style TP across its GPUs).

Every rank of a replica holds one shard of the base model; the ranks meet in one
process group (gloo on CPU, nccl on CUDA) that carries the row-parallel all-reduces
and the driver's per-step broadcasts. The group is built from its own TCP store and
process-group object, not `torch.distributed.init_process_group`, so no process-global
state is touched: one process may hold several engines (tests do), one after another.
Every collective of the model (the all-reduces of row-parallel layers and of the
vocab-parallel embedding, the lm_head's gather) goes through this class, on either backend.

Example (tp 2, hidden 8, num_heads 4, head_dim 2): qkv_proj of rank 1 holds q heads
2-3 (rows 4..7 of q_proj) and its kv heads; o_proj of rank 1 holds input columns 4..7
of the checkpoint's o_proj and all-reduces its [T, 8] partial output with rank 0's.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from lora_core.errors import InvalidRequest

# A collective's timeout is how long a worker may wait for the driver's next command;
# an idle replica must not time its workers out.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


class TPGroup:
    """rank in [0, size) of a TP group of `size` ranks. size 1 needs no process group."""

    def __init__(self, rank: int = 0, size: int = 1, pg: dist.ProcessGroup | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank}, size={size}; allowed: 0 <= rank < size")
        if size > 1 and pg is None:
            raise ValueError(f"a TP group of size {size} needs a process group")
        self.rank = rank
        self.size = size
        self._pg = pg
        self._store: dist.Store | None = None  # kept alive as long as the group
        self.op_timeout: datetime.timedelta | None = None
        """How long each operation may wait for the other ranks; None: COLLECTIVE_TIMEOUT.
        The driver sets it once the shards are built (its collectives then fail instead of
        waiting for a worker that stopped answering); workers keep None."""

    @classmethod
    def connect(
        cls, rank: int, size: int, port: int, backend: str, timeout_s: float = 120.0
    ) -> TPGroup:
        """Join the group whose rank 0 hosts the TCP store on 127.0.0.1:port.

        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors). timeout_s bounds the
        rendezvous (a rank that never comes up fails the others' start). Collectives get
        COLLECTIVE_TIMEOUT instead: workers wait in a broadcast for the driver's next
        command, however long the replica stays idle; a rank that dies breaks its
        connections, which fails the others' next collective at once.
        """
        store = dist.TCPStore(
            "127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
        )
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            raise InvalidRequest(f"backend={backend!r}; allowed: 'gloo' or 'nccl'")
        group = cls(rank, size, pg)
        group._store = store
        return group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place; returns t."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            self._live().allreduce([t], self._timed(opts)).wait()
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite t on every rank with rank src's t, in place; returns t."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            self._live().broadcast([t], self._timed(opts)).wait()
        return t

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's t (same shape and dtype on each), in rank order, on rank dst;
        None on the other ranks. Size 1: [t]."""
        if self.size == 1:
            return [t]
        opts = dist.GatherOptions()
        opts.rootRank = dst
        out = [torch.empty_like(t) for _ in range(self.size)] if self.rank == dst else []
        self._live().gather([out] if out else [], [t], self._timed(opts)).wait()
        return out or None

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send t to rank dst (which calls recv with a tensor of t's shape and dtype)."""
        self._wait(self._live().send([t], dst, 0))

    def recv(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Fill t with what rank src sends, in place; returns t."""
        self._wait(self._live().recv([t], src, 0))
        return t

    def close(self) -> None:
        """Shut this rank's process group down, then drop its store; idempotent.

        Every rank calls it once it is done with the group: a worker after STOP, the
        driver once its workers exited (so the store it hosts outlives their use of it).
        Left to interpreter exit, the group's threads and sockets were torn down in
        whatever order finalization took, and a rank was now and then aborted on its
        way out ("terminate called without an active exception")."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            pg.shutdown()

    def _timed(self, opts):
        if self.op_timeout is not None:
            opts.timeout = self.op_timeout
        return opts

    def _wait(self, work: dist.Work) -> None:
        if self.op_timeout is None:
            work.wait()
        elif not work.wait(self.op_timeout):
            raise RuntimeError(f"timed out after {self.op_timeout} waiting for a peer rank")

    def _live(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise RuntimeError(
                f"rank {self.rank} of this tensor-parallel group has no process group "
                f"(size {self.size}, or closed)"
            )
        return self._pg

    def shard(self, n: int, what: str) -> int:
        """n // size, refusing an n the group cannot split evenly."""
        if n % self.size:
            raise InvalidRequest(
                f"{what}={n} is not divisible by tensor_parallel_size={self.size}; allowed: "
                f"a tensor_parallel_size that divides {what}"
            )
        return n // self.size


SINGLE = TPGroup()
"""The group of a model that is not sharded (tp_size 1)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the store binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
