"""Structured outputs: a request's tokens kept to a JSON schema, any JSON object, a
regular expression, one of a list of strings, an EBNF grammar, or a structural tag (free
text in which each trigger string starts a begin string, schema-valid JSON and an end
string: tool calls inside text; `replica.structural_tag`) (vLLM's structured outputs and
OpenAI's `response_format`). xgrammar does the grammar work, as in vLLM.

How a step runs: each constrained sequence holds an `xgrammar.GrammarMatcher` (its
grammar compiled once per engine and cached). After the model's forward is launched, the
host fills one bitmask row per constrained sequence (the tokens its matcher allows next)
once the forward is launched, so it runs while the device computes, spread over a few
xgrammar threads; then it copies the bitmask over once (pinned, not blocking the host), and every other
token's logit is set to -inf before the sampler sees the logits (so before logit_bias,
the penalties, the argmax or the draw). The sampled token is then fed to the matcher.
As in vLLM, a constrained request's logprobs are those of this masked distribution: a
token the grammar forbids has logprob -inf and is never among the top logprobs (every
other logits change leaves logprobs raw). A batch with no constrained row pays nothing.

A request with `structured_after` ids (a reasoning model's "</think>", set by the ingress)
is free until its output ends with them: until then its row is no constrained row, its
matcher sees nothing, and those ids and everything before them are not the grammar's.

JSON grammars are compiled without free whitespace between tokens by default (xgrammar's
`any_whitespace=False`): one space after ':' and ',', none elsewhere, so a model cannot
run to max_tokens emitting newlines inside a JSON value (a known failure of free-whitespace
JSON grammars). A spec with `whitespace` N > 0 (asked for by vLLM's
`disable_any_whitespace: false`) allows any whitespace, but at most N characters in each
gap (`max_whitespace_cnt`), so that failure stays bounded. The spec, whitespace included,
is the compiled-grammar cache's key. Output that reaches max_tokens first ends with
"length" and may be incomplete, as in vLLM.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from lora_core.errors import InvalidRequest
from replica.structured_spec import StructuredOutput, xgrammar_reason

CACHE_SIZE = 256
"""Compiled grammars an engine keeps at most (least recently used dropped first)."""
CACHE_BYTES = 512 << 20
"""Host memory the kept compiled grammars may take together (xgrammar's
`memory_size_bytes`), least recently used dropped first; the newest is always kept. With
a 128k vocabulary a compiled regex took 7.6 MB and a JSON schema 0.1-1.1 MB, so a count
alone let 256 request-made grammars hold about 2 GB (`benchmarks/grammar_size_cpu.py`)."""
FILL_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
"""Threads xgrammar fills a step's masks with. With a 128k vocabulary one row takes 1.2 us
(where a JSON object's key starts) to 187 us (inside a JSON string), and 1.6 ms for a
regex with a counted repeat, on one thread of the development machine
(`benchmarks/structured_fill_cpu.py`); on an H100 host 64 rows inside JSON strings took
3.6-4.2 ms with 8 threads, all hidden behind the forward (`benchmarks/engine_gpu.py
--structured`)."""


class Grammars:
    """One engine's compiled grammars and the token masks of a step.

    tokenizer: the engine's (a Hugging Face tokenizer); vocab_size: the width of the
    model's logits (may exceed the tokenizer's: those ids are never allowed); stop_ids:
    the tokens that end a sequence (EOS), which a grammar allows once it is complete.
    Thread-safe: the async front compiles before taking the engine lock."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        max_cache_bytes: int = CACHE_BYTES,
    ):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler: Any = None
        # spec -> (compiled grammar, its memory_size_bytes when kept)
        self._cache: OrderedDict[StructuredOutput, tuple[Any, int]] = OrderedDict()
        self._cache_limit = max_cache_bytes
        self.cache_bytes = 0  # what the kept grammars take (memory_size_bytes summed)
        self._lock = threading.Lock()
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._batch: Any = None
        self._pinned: torch.Tensor | None = None

    def compile(self, spec: StructuredOutput) -> Any:
        """The `xgrammar.CompiledGrammar` of spec, compiled on first use; InvalidRequest
        (param "structured_outputs") when spec does not compile (against this tokenizer:
        a token id past its vocabulary too)."""
        with self._lock:  # keyed by the whole spec: kind, value and whitespace
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
                return entry[0]
            compiler = self._get_compiler()
        # compiled outside the lock: the engine thread, looking up a cached grammar under
        # the engine lock, must not wait for another request's compile (two threads
        # compiling one new spec at once both do it; one result is kept)
        try:
            compiled = compiler.compile_grammar(spec.grammar())
        except (ValueError, RuntimeError) as e:  # RuntimeError: what needs the tokenizer,
            # such as a structural tag's token id past the vocabulary
            raise InvalidRequest(
                f"structured output ({spec.kind}): {xgrammar_reason(e)}", "structured_outputs"
            ) from None
        with self._lock:
            kept = self._cache.get(spec)
            if kept is not None:  # another thread compiled it meanwhile
                return kept[0]
            size = compiled.memory_size_bytes
            self._cache[spec] = (compiled, size)
            self.cache_bytes += size
            while len(self._cache) > 1 and (
                len(self._cache) > CACHE_SIZE or self.cache_bytes > self._cache_limit
            ):
                self.cache_bytes -= self._cache.popitem(last=False)[1][1]
        return compiled

    def matcher(self, spec: StructuredOutput) -> Any:
        """A new `xgrammar.GrammarMatcher` for one sequence."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def allowed(self, matchers: list[Any], device: torch.device) -> torch.Tensor:
        """bool [len(matchers), vocab_size] on device: the tokens each matcher allows next.

        The engine calls this after it has launched the step's forward, so the fill (on
        the host, spread over FILL_THREADS threads of xgrammar's own) runs while the
        device computes. The bitmask crosses from pinned memory without blocking the host
        (it waits for nothing but the forward queued before it, on the device) and is
        unpacked there. The pinned rows are written again only next step, after this
        step's sampling has synchronised with the device."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        bits = self._host_bits(len(matchers), device)
        self._batch.batch_fill_next_token_bitmask(matchers, bits)
        on_device = bits.to(device, non_blocking=True)
        return unpack_bitmask(on_device, self.vocab_size, self._shift(device))

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Feed each matcher its sampled token (one call for the step); False where a
        matcher refused it."""
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def _host_bits(self, rows: int, device: torch.device) -> torch.Tensor:
        """int32 [rows, ceil(V / 32)] on the host, pinned when device is CUDA."""
        import xgrammar as xgr

        if device.type != "cuda":
            return xgr.allocate_token_bitmask(rows, self.vocab_size)
        if self._pinned is None or self._pinned.shape[0] < rows:
            size = max(rows, 2 * (0 if self._pinned is None else self._pinned.shape[0]), 64)
            self._pinned = xgr.allocate_token_bitmask(size, self.vocab_size).pin_memory()
        return self._pinned[:rows]

    def _shift(self, device: torch.device) -> torch.Tensor:
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        return shifts

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler


def unpack_bitmask(
    bits: torch.Tensor, vocab_size: int, shifts: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 [n, ceil(V / 32)] (bit j of word w: token 32 w + j is allowed) -> bool [n, V]."""
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.view(bits.shape[0], -1)[:, :vocab_size].bool()


def restrict(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """float32 [n, V] -> a copy with every logit of rows that `allowed` ([len(rows), V],
    in rows' order) does not allow set to -inf (a copy: the model's logits are inference
    tensors, maybe a CUDA graph's output buffer)."""
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))
