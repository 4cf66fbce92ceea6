"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from lora_core.identity import AdapterRef
from replica.outputs import TopLogprobs
from replica.sampler import SeedStream
from replica.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """tokens: prompt followed by generated tokens. num_computed: tokens whose KV exists.

    block_table: KV blocks in order; the first num_cached of them are in the prefix
    cache (taken from it, or published once computed). hashes: the prefix-cache hashes
    of the leading full blocks of `tokens`, computed as the scheduler needs them and
    kept for the sequence's life (tokens only grow, so they stay valid across
    preemption). parked: running but waiting, computing nothing, for a block another
    running sequence is computing now (`replica.scheduler`); announced: this sequence
    has told the scheduler it is computing its blocks num_cached..announced-1.

    prompt_logprobs / prompt_ranks / prompt_top_logprobs: with params.prompt_logprobs set,
    the logprob (its rank, and the most likely tokens) of prompt tokens 1, 2, ... so far, gathered chunk by
    chunk as the prompt is computed; kept across preemption, so a recomputed chunk adds
    nothing twice. prompt_logprobs_sent: they went out with an output.
    """

    request_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    arrival: int
    rng: SeedStream | None = None
    cache_salt: str = ""
    """Mixed into the prefix-cache hashes of this sequence's blocks: sequences share KV
    blocks only with sequences of the same salt (and adapter). "" for none."""
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    hashes: list[int] = field(default_factory=list)
    parked: bool = False
    announced: int = 0
    lora_slot: int = -1
    holds_slot: bool = False
    matcher: Any = None
    """With params.structured_outputs: the xgrammar GrammarMatcher of the tokens so far
    (those after params.structured_after's ids, if any)."""
    grammar_on: bool = False
    """The grammar holds this sequence's next token: it has a matcher and, with
    params.structured_after, its output has ended with those ids (`mark_grammar`)."""
    finish_reason: str | None = None
    text: str = ""
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    detok_stream: Any = None
    """The output's `tokenizers` DecodeStream (`replica.detokenizer`), made on first use."""
    detok_fed: int = 0
    """Output ids fed to detok_stream."""
    detok_settled: int = 0
    """Output ids whose text is in `text` (the rest end inside a character)."""
    _generated: np.ndarray = field(
        default_factory=lambda: np.empty(0, np.int64), init=False, repr=False
    )
    """Backing store of `output_array`; its first _num_copied entries are up to date."""
    _num_copied: int = field(default=0, init=False, repr=False)

    @cached_property
    def adapter_key(self) -> str:
        """adapter.key ("" for none); cached: the scheduler's queue reads it per look."""
        return self.adapter.key if self.adapter else ""

    @cached_property
    def prefix_key(self) -> str:
        """What the prefix-cache hashes are keyed by besides the tokens: the adapter's key
        and the cache salt (`replica.block_manager.block_hash`)."""
        return f"{self.adapter_key}\x00{self.cache_salt}" if self.cache_salt else self.adapter_key

    @cached_property
    def prompt_array(self) -> np.ndarray:
        """int64 [prompt_len]: the prompt's ids, built once (read by the repetition
        penalty every step, `replica.logits_processors`)."""
        return np.asarray(self.tokens[: self.prompt_len], dtype=np.int64)

    @property
    def output_array(self) -> np.ndarray:
        """int64 [num_output]: the generated ids, kept in step with `tokens` by copying
        only those added since the last read into a buffer that doubles when full (the
        penalties read it every step; converting the list every step cost the host a few
        microseconds per row)."""
        n, have = self.num_output, self._num_copied
        if n > len(self._generated):
            grown = np.empty(max(n, 2 * len(self._generated), 16), np.int64)
            grown[:have] = self._generated[:have]
            self._generated = grown
        if n > have:
            self._generated[have:n] = self.tokens[self.prompt_len + have :]
            self._num_copied = n
        return self._generated[:n]

    @property
    def scored_until(self) -> int | None:
        """With prompt logprobs still to gather: the first position whose logits are
        still needed (positions p < it are scored: prompt token p + 1 has its logprob), so
        KV from the prefix cache may cover positions before it only. None otherwise."""
        if self.params.prompt_logprobs is None:
            return None
        scored = len(self.prompt_logprobs)
        return scored if scored < self.prompt_len - 1 else None

    def mark_grammar(self) -> None:
        """Called after each token appended while the grammar is off: turn it on when the
        output now ends with params.structured_after (the tokens after them are the
        grammar's). Example: after (7, 8), output [5, 7, 8] turns it on."""
        after = self.params.structured_after
        if self.num_output >= len(after):
            self.grammar_on = self.tokens[len(self.tokens) - len(after) :] == list(after)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.num_computed
