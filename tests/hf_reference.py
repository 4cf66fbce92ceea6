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
