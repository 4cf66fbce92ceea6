"""The synchronous engine core: add_request, step, abort.

One engine = one base model + KV cache + adapter slots on one device. Every step
runs one mixed batch (prefill chunks and decode tokens of base and adapter requests
together) and returns incremental outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from lora_core.errors import InvalidRequest, LoraFleetError, NonFiniteLogits
from lora_core.identity import AdapterRef
from replica.block_manager import BlockManager
from replica.config import EngineConfig
from replica.detokenizer import Detokenizer
from replica.engine_setup import EngineParts, build_engine_parts
from replica.outputs import EngineStats, RequestOutput
from replica.sampler import SeedStream, sample
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import Sequence, Status
from replica.structured import Grammars, restrict

log = logging.getLogger("lorafleet.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None):
        self.config = config
        p = parts or build_engine_parts(config)
        self.parts = p
        self.tokenizer = p.tokenizer
        self.model_dir: Path = p.model_dir
        self.adapters = p.adapters
        self.max_model_len = p.max_model_len
        self.blocks = BlockManager(p.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            self.adapters,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            demand=self.adapters,
        )
        self.runner = p.runner
        self.detok = Detokenizer(self.tokenizer)
        self.eos_ids = p.eos_token_ids
        self._eos_tuple = tuple(sorted(self.eos_ids))
        self.vocab_size = p.vocab_size
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._pending: list[RequestOutput] = []
        self.computed_tokens = 0
        """Tokens run through the model since start (`EngineStats.computed_tokens`)."""
        # Requests without a seed draw from one generator seeded with EngineConfig.seed, so
        # a run (the same requests in the same order) is reproducible; a seeded request's
        # own stream does not depend on its batch. One generator costs nothing per row.
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: AdapterRef | None = None,
        want_held: bool = False,
        cache_salt: str = "",
    ) -> None:
        """Queue a request. Raises before queueing if the request or its adapter is refused.

        cache_salt: the request shares prefix-cache blocks only with requests of the same
        salt (and adapter): the ingress salts with the tenant, so one tenant cannot time
        whether another's prompts are cached (`Sequence.cache_salt`).

        params.truncate_prompt_tokens: the prompt's last k tokens are all that runs
        (`SamplingParams.kept_prompt`).

        want_held: the caller called adapters.want(adapter) for this request (so the CPU
        cache kept the adapter while the caller loaded it); the queued request takes
        that want over. When this raises, the want stays the caller's to unwant.
        """
        if adapter is not None and not want_held:
            # Want the adapter from before its load, as the async front does: a load by
            # the manager's loader thread in between must not drop the copy just loaded.
            self.adapters.want(adapter)
            try:
                self.add_request(request_id, prompt_token_ids, params, adapter, True, cache_salt)
            except BaseException:
                self.adapters.unwant(adapter)
                raise
            return
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        # the ingress truncates before its own checks; this serves offline and direct callers
        prompt_token_ids = params.kept_prompt(prompt_token_ids, self.max_model_len)
        self._check_prompt(prompt_token_ids, params)
        spec = params.structured_outputs
        matcher = self.grammars.matcher(spec) if spec is not None else None
        if adapter is not None:
            self.adapters.register(adapter)
        seq = Sequence(
            request_id=request_id,
            prompt_len=len(prompt_token_ids),
            tokens=list(prompt_token_ids),
            params=params,
            adapter=adapter,
            arrival=next(self._arrival),
            rng=SeedStream(params.seed) if params.seed is not None else None,
            cache_salt=cache_salt,
            matcher=matcher,
            grammar_on=matcher is not None and not params.structured_after,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq, want_held)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("prompt is empty; allowed: at least one token")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})")
        self._check_in_vocab("logit_bias", [t for t, _ in params.logit_bias])
        self._check_in_vocab("stop_token_ids", params.stop_token_ids)
        self._check_in_vocab("allowed_token_ids", params.allowed_token_ids or ())
        self._check_in_vocab("structured_after", params.structured_after)
        self._check_allowed_can_start(params)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the maximum context length {self.max_model_len}"
            )
        self._check_fits_cache(len(ids), params.max_tokens)

    def _check_in_vocab(self, field: str, ids: Iterable[int]) -> None:
        """Refuse a token id (of a field SamplingParams checked to hold ids >= 0) past the
        model's vocabulary, naming the largest."""
        largest = max(ids, default=-1)
        if largest >= self.vocab_size:
            raise InvalidRequest(
                f"{field}: token id {largest} out of range; allowed: token ids "
                f"0 <= id < {self.vocab_size}",
                field,
            )

    def _check_allowed_can_start(self, p: SamplingParams) -> None:
        """Refuse allowed_token_ids that are all banned below min_tokens (each would stop
        the request): the first step would have no token left to sample."""
        if p.allowed_token_ids is None or not p.min_tokens:
            return
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        if stops.issuperset(p.allowed_token_ids):
            raise InvalidRequest(
                f"allowed_token_ids: every allowed token ends the request (EOS or "
                f"stop_token_ids), which min_tokens={p.min_tokens} forbids before then; "
                "allowed: at least one other token id, or min_tokens 0",
                "allowed_token_ids",
            )

    def _check_fits_cache(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request that needs more KV than the whole cache: it can never run, so
        it is invalid (400), not backpressure (429), which clients retry forever."""
        room = self.blocks.num_blocks * self.config.block_size
        if prompt_len + max_tokens <= room:
            return
        held = f"the KV cache holds {room} tokens (kv_cache_tokens)"
        if prompt_len >= room:
            raise InvalidRequest(
                f"prompt: {prompt_len} tokens leave no room to generate: {held}; allowed: a "
                f"prompt of at most {room - 1} tokens",
                "prompt",
            )
        raise InvalidRequest(
            f"max_tokens: the prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) does not "
            f"fit: {held}; allowed: max_tokens up to {room - prompt_len} for this prompt",
            "max_tokens",
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its final output (finish_reason "abort") comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._pending.append(self._output(seq, "", []))
        return True

    def close(self) -> None:
        """Stop what the engine started: the adapter loader thread and, with tensor
        parallelism, the worker processes. The engine cannot step afterwards."""
        self.adapters.close()
        if self.parts.close is not None:
            self.parts.close()

    def check_health(self) -> None:
        """Raise RuntimeError when a part the engine cannot step without is gone (a
        tensor-parallel worker process)."""
        driver = getattr(self.runner, "driver", None)
        if driver is not None:
            driver.check_alive()

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of requests that produced tokens or finished."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        for seq, error in sched.failed:
            self._seqs.pop(seq.request_id, None)
            outputs.append(dataclasses.replace(self._output(seq, "", []), error=error))
        if not sched.scheduled:
            return outputs
        batch = self.runner.prepare(sched.scheduled)
        result = self.runner.execute(batch)
        self.computed_tokens += sched.num_tokens
        self.scheduler.after_step(sched)
        for (seq, _), (lps, ranks, top) in zip(batch.prompt_seqs, result.prompt, strict=True):
            seq.prompt_logprobs += lps
            seq.prompt_ranks += ranks
            seq.prompt_top_logprobs += top
        outputs += [self._prompt_done(seq) for seq in batch.done]
        seqs = batch.sample_seqs
        if not seqs:
            return outputs
        params, streams = [s.params for s in seqs], [s.rng for s in seqs]
        banned = [self._banned(s) for s in seqs]
        logits, guided = result.logits, [i for i, s in enumerate(seqs) if s.grammar_on]
        if guided:  # the host fills the masks while the device runs the forward
            allowed = self.grammars.allowed([seqs[i].matcher for i in guided], logits.device)
            logits = restrict(logits, guided, allowed)
        sampled = sample(logits, params, streams, self.generator, seqs, banned)
        bad = set(sampled.non_finite)
        refused = self._feed_grammars(seqs, guided, sampled.tokens, bad)
        for i, seq in enumerate(seqs):
            if i in bad:
                outputs.append(self._fail(seq, self._non_finite(seq)))
                continue
            if i in refused:
                why = f"request {seq.request_id}: the grammar refused a token it allowed"
                outputs.append(self._fail(seq, LoraFleetError(why)))
                continue
            if seq.params.logprobs:
                seq.logprobs.append(sampled.logprobs[i])
            if seq.params.top_logprobs:
                seq.top_logprobs.append(sampled.top[i])
            outputs.append(self._append(seq, sampled.tokens[i]))
        return outputs

    def _feed_grammars(
        self, seqs: list[Sequence], guided: list[int], tokens: list[int], bad: set[int]
    ) -> set[int]:
        """Feed the constrained rows' matchers their sampled tokens (a row that failed
        samples nothing); -> the rows whose matcher refused its token."""
        rows = [i for i in guided if i not in bad]
        if not rows:
            return set()
        ok = self.grammars.accept([seqs[i].matcher for i in rows], [tokens[i] for i in rows])
        return {i for i, accepted in zip(rows, ok, strict=True) if not accepted}

    def _non_finite(self, seq: Sequence) -> LoraFleetError:
        """The error of a row left with no finite logit: with its grammar on, when the
        grammar's tokens were all masked by the request's other fields, its own."""
        if not seq.grammar_on:
            return NonFiniteLogits(seq.request_id, seq.num_output)
        return InvalidRequest(
            f"request {seq.request_id}: at output token {seq.num_output} the structured "
            "output allows no token the request's other fields leave (or the model's "
            "logits are not finite); generation stopped",
            "structured_outputs",
        )

    def _fail(self, seq: Sequence, error: LoraFleetError) -> RequestOutput:
        """Stop seq with `error` (its tokens so far were delivered already)."""
        log.error("%s", error)
        self.scheduler.finish(seq, "error")
        self._seqs.pop(seq.request_id, None)
        return dataclasses.replace(self._output(seq, "", []), error=error)

    def _prompt_done(self, seq: Sequence) -> RequestOutput:
        """seq (max_tokens 0) has run its whole prompt: it ends with "length"."""
        self.scheduler.finish(seq, "length")
        self._seqs.pop(seq.request_id, None)
        return self._with_prompt_logprobs(seq, self._output(seq, "", []))

    def _with_prompt_logprobs(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """out, carrying seq's prompt logprobs if they are due: asked for, all gathered
        and not sent yet (they go with the first output after the prompt ran)."""
        if seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent:
            return out
        seq.prompt_logprobs_sent = True
        top = seq.prompt_top_logprobs if seq.params.prompt_logprobs else None
        return dataclasses.replace(
            out,
            prompt_logprobs=seq.prompt_logprobs,
            prompt_ranks=seq.prompt_ranks,
            prompt_top_logprobs=top,
        )

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """Tokens seq may not sample this step: below min_tokens, those that would stop it
        (its stop_token_ids, and EOS unless ignore_eos)."""
        p = seq.params
        if seq.num_output >= p.min_tokens:
            return ()
        return p.stop_token_ids if p.ignore_eos else p.stop_token_ids + self._eos_tuple

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.tokens.append(token)
        if seq.matcher is not None and not seq.grammar_on:
            seq.mark_grammar()  # this token was free; the next is the grammar's if it ended the ids
        p = seq.params
        reason = None
        stops = seq.num_output >= p.min_tokens  # vLLM's rule (the ban kept them out before)
        if stops and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)):
            reason = "stop"
        elif seq.num_output >= p.max_tokens:
            reason = "length"
        text, hit = self.detok.update(seq, final=reason is not None, stop_token=reason == "stop")
        if hit:
            reason = "stop"
        new_ids = seq.output_ids[seq.emitted_tokens :]
        seq.emitted_tokens = seq.num_output
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
        return self._with_prompt_logprobs(seq, self._output(seq, text, new_ids))

    def _output(self, seq: Sequence, text: str, new_ids: list[int]) -> RequestOutput:
        n_lp = len(new_ids) if seq.params.logprobs else 0
        n_top = len(new_ids) if seq.params.top_logprobs else 0
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=text,
            new_logprobs=seq.logprobs[len(seq.logprobs) - n_lp :] if n_lp else [],
            new_top_logprobs=seq.top_logprobs[len(seq.top_logprobs) - n_top :] if n_top else [],
            finish_reason=seq.finish_reason if seq.status is Status.FINISHED else None,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output,
        )

    def stats(self) -> EngineStats:
        a = self.adapters.stats()
        return EngineStats(
            gpu_adapters=a.gpu_keys,
            cpu_adapters=a.cpu_keys,
            pinned=a.pinned,
            free_slots=a.free_slots,
            max_loras=self.config.max_loras,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage(),
            adapter_loads=a.slot_loads,
            num_preemptions=self.scheduler.num_preemptions,
            active_adapters=self.scheduler.active_adapters(),
            draining=a.draining,
            prefix_hit_tokens=self.blocks.prefix_hit_tokens,
            computed_tokens=self.computed_tokens,
        )
