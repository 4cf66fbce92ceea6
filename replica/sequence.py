"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

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

    text: the output decoded so far (cut at a stop string); emitted_text_len of it were
    streamed. decoded_text: the text of the first decoded_upto output tokens, which end
    in a complete character; decoded_from <= decoded_upto: where the detokenizer's next
    window starts (`replica.detokenizer`).
    """

    request_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    arrival: int
    rng: SeedStream | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    hashes: list[int] = field(default_factory=list)
    parked: bool = False
    announced: int = 0
    lora_slot: int = -1
    holds_slot: bool = False
    finish_reason: str | None = None
    text: str = ""
    emitted_text_len: int = 0
    decoded_from: int = 0
    decoded_upto: int = 0
    decoded_text: str = ""
    emitted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
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
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.num_computed
