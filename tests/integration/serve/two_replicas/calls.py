"""The OpenAI client calls the two-replica cluster's tests share."""

from __future__ import annotations

import openai

PROMPT = "hello world how are"
MAX_TOKENS = 8


def client(cluster, key="ops") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http}/v1", api_key=cluster.keys[key], max_retries=0)


def complete(cluster, model, key="ops", **kw) -> openai.types.Completion:
    r = client(cluster, key).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kw
    )
    return r
