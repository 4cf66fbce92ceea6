"""asyncio front of the engine: a background thread steps the engine while callers
stream their tokens (the Serve replica uses this).

The engine is not thread-safe; every call into it holds `_lock` (through `_engine_locked`,
which also refreshes a stats snapshot, so `stats()` — called from Serve's health checks and
routing-stats polls on the event loop — never waits for a running step). The step loop
sleeps when there is no work and wakes on new requests.

The `n` choices of one request share a `group` and a prompt. When they ask for prompt
logprobs (completions' echo with logprobs), only the group's first arrival here computes
them: scoring needs the logits of every prompt position, which prefix-cache blocks do not
hold, so each scoring choice computed the whole prompt. The later arrivals wait until the
first is queued, then are queued without prompt logprobs: they take its prompt blocks
from the cache (parked while it computes them: `replica.scheduler`) and compute only the
last block, and the ingress echoes the first one's scores in every choice (`router.rest`).
They wait because requests reach the engine through worker threads, which take the lock
in any order: one queued before the first would compute the prompt once more. When the
first is refused, or has ended, later arrivals score the prompt for themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator

from lora_core.errors import CapacityExceeded, InvalidRequest
from lora_core.identity import AdapterRef
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.outputs import EngineStats, RequestOutput
from replica.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self._lock = threading.Lock()
        self._stats = self.engine.stats()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # group -> its first arrival that scores the prompt, while it runs: a future done
        # once it is queued (True) or refused (False)
        self._scorers: dict[str, asyncio.Future] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="lorafleet-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def _loop(self) -> None:
        while not self._stop:
            with self._engine_locked():
                busy = self.engine.has_unfinished()
                outputs: list[RequestOutput] | BaseException = []
                if busy:
                    try:
                        outputs = self.engine.step()
                    except Exception as e:  # noqa: BLE001 - fail in-flight requests, keep serving
                        log.exception("engine step failed")
                        outputs = e
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            if isinstance(outputs, BaseException):
                self._fail_all(outputs)
                continue
            for out in outputs:
                self._deliver(out.request_id, out if out.error is None else out.error, out.finished)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        entry = self._queues.pop(request_id, None) if last else self._queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        with self._engine_locked():
            for rid in list(self._queues):
                self.engine.abort(rid)
        for rid in list(self._queues):
            self._deliver(rid, error, True)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None = None,
        cache_salt: str = "",
        group: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream incremental outputs; refusals raise before the first output.
        cache_salt: see `LLMEngine.add_request`. group: shared by the `n` choices of one
        request (same prompt and params but the seed), whose prompt logprobs are then
        computed once (see the module docstring; this request's first output may then
        carry none); None: a request of its own.

        Leaving the iteration early (break, cancel, client gone) aborts the request.
        """
        if request_id in self._queues:
            # Checked before the queue is set: replacing (and on refusal dropping) the
            # first request's queue would leave its stream waiting forever.
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, queue)
        scorer, scores = self._scorer(group, params, loop)
        if scorer is not None and not scores:
            try:
                await asyncio.wait([scorer])  # the group's scorer is queued first
            except BaseException:
                self._queues.pop(request_id, None)
                raise
            if scorer.result():  # and computes the prompt logprobs: this one takes its blocks
                params = dataclasses.replace(params, prompt_logprobs=None)
        add = loop.run_in_executor(
            None, self._add, request_id, prompt_token_ids, params, adapter, cache_salt
        )
        if scores:
            add.add_done_callback(functools.partial(self._scorer_queued, group, scorer))
        try:
            # Shielded: a caller who leaves (client gone) while a cold adapter loads cannot
            # stop the thread, which then queues the request anyway; the callback aborts it
            # once it lands instead of letting it run to max_tokens with no reader.
            await asyncio.shield(add)
        except BaseException:
            self._queues.pop(request_id, None)
            add.add_done_callback(functools.partial(self._abort_abandoned, request_id))
            if scores:
                self._scorer_ended(group, scorer)
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if scores:
                self._scorer_ended(group, scorer)
            if not finished:
                self._queues.pop(request_id, None)
                with self._engine_locked():
                    self.engine.abort(request_id)

    def _scorer(
        self, group: str | None, params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> tuple[asyncio.Future | None, bool]:
        """(the future of the group's scorer, done once it is queued (True) or refused
        (False), or None; whether this request is that scorer). No scorer for a request
        without a group or without prompt logprobs."""
        if group is None or params.prompt_logprobs is None:
            return None, False
        scorer = self._scorers.get(group)
        if scorer is not None:
            return scorer, False
        scorer = self._scorers[group] = loop.create_future()
        return scorer, True

    def _scorer_queued(self, group: str, scorer: asyncio.Future, add: asyncio.Future) -> None:
        queued = not add.cancelled() and add.exception() is None
        scorer.set_result(queued)
        if not queued:
            self._scorer_ended(group, scorer)

    def _scorer_ended(self, group: str, scorer: asyncio.Future) -> None:
        """The group's scorer was refused or has ended: later arrivals score for themselves."""
        if self._scorers.get(group) is scorer:
            del self._scorers[group]

    def _abort_abandoned(self, request_id: str, add: asyncio.Future) -> None:
        """`add` (the thread running _add) finished after its caller left: undo it."""
        if not add.cancelled() and add.exception() is None:
            with self._engine_locked():
                self.engine.abort(request_id)

    def _add(self, request_id, prompt_token_ids, params, adapter, cache_salt="") -> None:
        if params.structured_outputs is not None:  # compiled once, outside the engine lock
            self.engine.grammars.compile(params.structured_outputs)
        if adapter is None:
            with self._engine_locked():
                self.engine.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt)
            return
        # The request wants its adapter from before the load until the scheduler takes
        # the count over at queueing: a registration in between (another request's, a
        # warm-up) must not drop the copy just loaded, for a reload under the engine lock.
        self.engine.adapters.want(adapter)
        queued = False
        try:
            # Disk -> CPU (validate, hash, unpack) without the engine lock, so a cold
            # adapter's load overlaps with running steps; the manager is thread-safe.
            self.engine.adapters.fetch(adapter)
            with self._engine_locked():
                self.engine.add_request(
                    request_id, prompt_token_ids, params, adapter, True, cache_salt
                )
                queued = True
        finally:
            if not queued:  # refused or failed before queueing: the want is still ours
                self.engine.adapters.unwant(adapter)

    async def abort(self, request_id: str) -> bool:
        with self._engine_locked():
            return self.engine.abort(request_id)

    async def load_adapter(self, ref: AdapterRef, to_gpu: bool = False) -> None:
        """Validate and load into the CPU cache (and a GPU slot if to_gpu)."""
        await asyncio.to_thread(self.engine.adapters.register, ref)  # disk -> CPU, unlocked
        if not to_gpu:
            await asyncio.to_thread(self._locked, lambda: None)  # refresh the stats snapshot
            return
        slot = await asyncio.to_thread(self._locked, self.engine.adapters.prefetch_to_gpu, ref)
        if slot is None:
            raise CapacityExceeded(f"{ref.name}: every GPU slot is busy with running requests")

    async def unload_adapter(self, name: str) -> None:
        """Refuse new requests for `name` now; memory is freed once in-flight ones finish."""
        await asyncio.to_thread(self._locked, self.engine.adapters.unload, name)

    def pin(self, ref: AdapterRef) -> None:
        self._locked(self.engine.adapters.pin, ref)

    def unpin(self, ref: AdapterRef) -> None:
        self._locked(self.engine.adapters.unpin, ref)

    def stats(self) -> EngineStats:
        """The snapshot taken when the engine lock was last released (no waiting)."""
        return self._stats

    def _locked(self, fn, *args):
        with self._engine_locked():
            return fn(*args)

    @contextlib.contextmanager
    def _engine_locked(self):
        with self._lock:
            try:
                yield
            finally:
                self._stats = self.engine.stats()

    def shutdown(self) -> None:
        """Stop the step thread, then the engine (its adapter loader and, with tensor
        parallelism, its worker processes)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # a step still running keeps what it uses
            self.engine.close()
