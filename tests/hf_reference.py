"""The references engine outputs are compared with: HF transformers (+ PEFT) in float32."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(model_dir: str | Path, adapter_path: str | Path | None = None):
    """The HF model of model_dir in float32 and eval mode, with the PEFT adapter at
    adapter_path applied (None: the base model)."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, str(adapter_path))
    return model.eval()


def hf_logp(model_dir, adapter_path, tokens: list[int]) -> torch.Tensor:
    """float32 [len(tokens), V]: log_softmax of the model's logits at every position."""
    with torch.no_grad():
        logits = hf_model(model_dir, adapter_path)(input_ids=torch.tensor([tokens])).logits
    return torch.log_softmax(logits[0].float(), -1)


def hf_greedy(model_dir, adapter_path, prompt_ids: list[int], **generate) -> list[int]:
    """The token ids `generate(do_sample=False, **generate)` appends to prompt_ids."""
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model(model_dir, adapter_path).generate(
            input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, **generate
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_greedy_batch(model_dir, adapters: dict, tokenizer, prompts: list[str], max_new_tokens: int):
    """HF's greedy tokens of every prompt with the base and each adapter {name: path}, keyed
    as `tests.tiny.mixed_requests` names its requests ("<name or base>-<prompt index>")."""
    want = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt).input_ids
        for name in (None, *adapters):
            path = adapters[name] if name else None
            want[f"{name or 'base'}-{i}"] = hf_greedy(
                model_dir, path, ids, max_new_tokens=max_new_tokens
            )
    return want
