"""The offline job behind `lorafleet generate` (kept apart from argument parsing)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lora_core.errors import AdapterNotFound, InvalidRequest
from lora_core.identity import AdapterRef
from lora_core.validate import validate_adapter_dir
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline_cli import SAMPLING_FIELDS
from replica.sampling_params import SamplingParams


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


def adapter_ref(name: str, path: Path, max_rank: int, version: int = 1) -> AdapterRef:
    """An identity for a local adapter directory (validated, content-hashed)."""
    manifest = validate_adapter_dir(path, max_rank=max_rank)
    return AdapterRef(
        name=name,
        version=version,
        content_hash=manifest.content_hash,
        path=manifest.path,
        rank=manifest.rank,
        base_model=manifest.base_model,
    )


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
        )
        refs = {n: adapter_ref(n, p, args.max_lora_rank) for n, p in adapter_paths.items()}
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

    def _params(self, row: dict, line: int) -> SamplingParams:
        fields = {**self.defaults, **{k: row[k] for k in SAMPLING_FIELDS if k in row}}
        if isinstance(fields.get("stop"), list):
            fields["stop"] = tuple(fields["stop"])
        try:
            return SamplingParams(**fields)
        except (InvalidRequest, TypeError) as e:
            raise InvalidRequest(f"line {line}: {e}") from e

    def run(self, rows: list[dict], progress: bool = True) -> list[dict]:
        """Queue every row, step until all finish; returns rows + token_ids/text/finish_reason."""
        results: list[dict] = [dict(r) for r in rows]
        for i, row in enumerate(rows):
            name = row.get("adapter")
            if name is not None and name not in self.adapters:
                raise AdapterNotFound(name)
            ids = self.engine.tokenizer(row["prompt"]).input_ids
            self.engine.add_request(
                str(i), ids, self._params(row, i + 1), self.adapters.get(name) if name else None
            )
            results[i].update(token_ids=[], text="", finish_reason=None)
        bar = _progress(len(rows), progress)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[int(out.request_id)]
                res["token_ids"].extend(out.new_token_ids)
                res["text"] += out.new_text
                if out.new_logprobs:
                    res.setdefault("logprobs", []).extend(out.new_logprobs)
                if out.error is not None:
                    res["error"] = str(out.error)
                if out.finished:
                    res["finish_reason"] = out.finish_reason
                    bar.update(1)
        bar.close()
        return results


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, desc="generate", unit="req", disable=not enabled or total < 2, file=None
    )
