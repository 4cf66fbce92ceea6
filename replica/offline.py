"""The offline job behind `lorafleet generate` (kept apart from argument parsing)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lora_core.base_shape import BaseShape
from lora_core.errors import InvalidRequest, LoraFleetError
from lora_core.identity import AdapterRef
from lora_core.validate import validate_adapter_dir
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.logit_bias import logit_bias_of_json
from replica.offline_cli import ASKING_FIELDS, NULL_IS_DEFAULT, SAMPLING_FIELDS, InputLine
from replica.outputs import RequestOutput, TopLogprobs
from replica.sampling_params import SamplingParams
from replica.serve_protocol import check_prompt_ids
from replica.structured_forms import structured_outputs_of


def parse_adapter_args(items: list[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter {item!r}; allowed: NAME=PATH")
        if name in out:
            raise ValueError(f"--adapter {name!r} given twice")
        out[name] = Path(path)
    return out


def adapter_ref(
    name: str, path: Path, max_rank: int, version: int = 1, base: BaseShape | None = None
) -> AdapterRef:
    """An identity for a local adapter directory (validated, content-hashed; with base,
    also its fit to the base model's shapes, as registration checks it)."""
    manifest = validate_adapter_dir(path, max_rank=max_rank, base=base)
    return AdapterRef(
        name=name,
        version=version,
        content_hash=manifest.content_hash,
        path=manifest.path,
        rank=manifest.rank,
        base_model=manifest.base_model,
    )


def local_base_shape(model: str) -> BaseShape | None:
    """The shapes of a model directory's config.json (None when model is no such directory:
    the engine then says what is wrong with it)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    return BaseShape.from_hf_config(json.loads(config.read_text()))


class OfflineJob:
    def __init__(self, engine: LLMEngine, adapters: dict[str, AdapterRef], defaults: dict):
        self.engine = engine
        self.adapters = adapters
        self.defaults = defaults

    @classmethod
    def from_args(cls, args: argparse.Namespace, adapter_paths: dict[str, Path]) -> OfflineJob:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
            max_lora_rank=args.max_lora_rank,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=not args.no_prefix_caching,
            dense_prompt_min=args.dense_prompt_min,
            kernel_warmup=not args.no_kernel_warmup,
        )
        base = local_base_shape(args.model)  # adapters refused before the model loads
        refs = {
            n: adapter_ref(n, p, args.max_lora_rank, base=base) for n, p in adapter_paths.items()
        }
        engine = LLMEngine(config)
        for ref in refs.values():
            engine.adapters.register(ref)
        defaults = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
        }
        return cls(engine, refs, defaults)

    def _params(self, row: dict) -> SamplingParams:
        given = {k: row[k] for k in SAMPLING_FIELDS if k in row}
        given = {k: v for k, v in given.items() if v is not None or k not in NULL_IS_DEFAULT}
        fields = {**self.defaults, **given}
        if isinstance(fields.get("stop"), list):
            fields["stop"] = tuple(fields["stop"])
        for name in ("stop_token_ids", "allowed_token_ids"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        if "logit_bias" in fields:
            fields["logit_bias"] = logit_bias_of_json(fields["logit_bias"])
        if fields.get("structured_outputs") is not None:
            try:
                fields["structured_outputs"] = structured_outputs_of(fields["structured_outputs"])
            except ValueError as e:
                raise InvalidRequest(str(e), "structured_outputs") from None
        return SamplingParams(**fields)

    def _add(self, rid: str, row: dict) -> SamplingParams:
        """Queue one line's request (raises before queueing if it is refused)."""
        name = row.get("adapter")
        if name is not None and name not in self.adapters:
            names = ", ".join(sorted(self.adapters))
            allowed = f"null or one of {names}" if names else "null (no --adapter given)"
            raise InvalidRequest(f"adapter {name!r} not found; allowed: {allowed}")
        params = self._params(row)
        self.engine.add_request(
            rid, self._prompt_ids(row["prompt"]), params, self.adapters.get(name) if name else None
        )
        return params

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.tokenizer(prompt).input_ids
        check_prompt_ids(prompt, self.engine.vocab_size)
        return prompt

    def run(self, lines: list[InputLine], progress: bool = True) -> list[dict]:
        """Queue every line, step until all finish -> one output row per line, in order:
        the line's fields (less its logprobs flags) + token_ids, text, finish_reason and,
        when asked for, logprobs / top_logprobs / prompt_logprobs / prompt_top_logprobs
        (see README)."""
        results: list[dict] = []
        for i, line in enumerate(lines):
            try:
                params = self._add(str(i), line.fields)
            except LoraFleetError as e:
                raise InvalidRequest(f"line {line.number}: {e}") from e
            results.append(_result_row(line.fields, params))
        bar = _progress(len(lines), progress)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._collect(results[int(out.request_id)], out)
                if out.finished:
                    bar.update(1)
        bar.close()
        return results

    def _collect(self, res: dict, out: RequestOutput) -> None:
        res["token_ids"].extend(out.new_token_ids)
        res["text"] += out.new_text
        if "logprobs" in res:
            res["logprobs"].extend(out.new_logprobs)
        if "top_logprobs" in res:
            res["top_logprobs"].extend(self._top(pos) for pos in out.new_top_logprobs)
        if out.prompt_logprobs is not None:  # the first token of a prompt has none
            res["prompt_logprobs"] = [None, *out.prompt_logprobs]
            if out.prompt_top_logprobs is not None:
                tops = [self._top(pos) for pos in out.prompt_top_logprobs]
                res["prompt_top_logprobs"] = [None, *tops]
        if out.error is not None:
            res["error"] = str(out.error)
        res["finish_reason"] = out.finish_reason

    def _top(self, pos: TopLogprobs) -> list[dict]:
        decode = self.engine.tokenizer.decode
        return [{"token_id": t, "token": decode([t]), "logprob": lp} for t, lp in pos]


def _result_row(row: dict, params: SamplingParams) -> dict:
    res = {k: v for k, v in row.items() if k not in ASKING_FIELDS}
    res.update(token_ids=[], text="", finish_reason=None)
    if params.logprobs:
        res["logprobs"] = []
    if params.top_logprobs:
        res["top_logprobs"] = []
    return res


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, desc="generate", unit="req", disable=not enabled or total < 2, file=None
    )
