"""What the engine hands back per request and per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_core.errors import LoraFleetError

TopLogprobs = tuple[tuple[int, float], ...]
"""The most likely (token id, logprob) at one sampled position, most likely first."""


@dataclass
class RequestOutput:
    """Incremental output of one request after one engine step.

    request_id: the caller's id.
    new_token_ids: tokens generated since the previous output of this request.
    new_text: detokenized text for those tokens (stop strings removed).
    new_logprobs: log-probability of each new token (empty unless asked for).
    new_top_logprobs: the most likely alternatives at each new token's position
        (empty unless top_logprobs > 0).
    finish_reason: None while running; then "stop", "length", "abort" or "error".
    error: with finish_reason "error", why the request failed (e.g. its adapter was
    unloaded while it waited); the async engine raises it to that request's caller.
    num_prompt_tokens / num_output_tokens: usage counts so far.
    prompt_logprobs: with SamplingParams.prompt_logprobs, on the request's first output
        once its prompt ran (None on every other): the logprob of prompt tokens 1 ..
        P - 1 (the first token has none).
    prompt_ranks: with prompt_logprobs, each of those tokens' rank in its position's
        distribution (1 = the most likely; `replica.prompt_logprobs.score_rows`).
    prompt_top_logprobs: the most likely tokens at each of those positions (None unless
        prompt_logprobs > 0).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: LoraFleetError | None = None
    prompt_logprobs: list[float] | None = None
    prompt_ranks: list[int] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's state (for routing stats, health and metrics).

    gpu_adapters / cpu_adapters: AdapterRef.key of adapters in GPU slots / CPU cache.
    pinned: keys of pinned adapters.
    free_slots: GPU slots that hold no adapter.
    num_running / num_waiting: sequences in the running batch / the queue.
    kv_usage: fraction of KV blocks in use (0..1).
    adapter_loads: GPU slot loads since start (disk or CPU -> slot).
    num_preemptions: sequences preempted since start.
    active_adapters: distinct adapters among running and waiting sequences (the slot
        demand the autoscaling policy compares with max_loras).
    draining: keys of adapters being unloaded (freed once their last request ends).
    prefix_hit_tokens: prompt tokens taken from the prefix cache since start (not computed).
    computed_tokens: tokens run through the model since start (prompt tokens computed and
        one per decode step of each sequence); with prefix_hit_tokens, the share of
        prompt work the cache saved.
    """

    gpu_adapters: tuple[str, ...]
    cpu_adapters: tuple[str, ...]
    pinned: tuple[str, ...]
    free_slots: int
    max_loras: int
    num_running: int
    num_waiting: int
    kv_usage: float
    adapter_loads: int
    num_preemptions: int
    active_adapters: int
    draining: tuple[str, ...] = ()
    prefix_hit_tokens: int = 0
    computed_tokens: int = 0
