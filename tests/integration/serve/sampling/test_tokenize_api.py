"""vLLM's /tokenize and /detokenize on the live cluster (raw HTTP): a prompt's count is
the prompt_tokens the completion and chat routes bill for it, the tokens detokenize back
to the prompt, and a model the key may not use is the inference routes' 404. Runs on
the package's shared cluster."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.serve.sampling.test_sampling_api import MESSAGES, PROMPT

pytestmark = pytest.mark.integration


def post(cluster, path: str, body: dict, key: str = "ops") -> httpx.Response:
    headers = {"Authorization": f"Bearer {cluster.keys[key]}"} if key else {}
    return httpx.post(f"{cluster.http}{path}", json=body, headers=headers, timeout=60)


def test_tokenize_counts_what_inference_bills_and_detokenize_inverts_it(cluster):
    tok = post(cluster, "/tokenize", {"model": "demo-poet", "prompt": PROMPT})
    assert tok.status_code == 200, tok.text
    tok = tok.json()
    done = post(cluster, "/v1/completions", {"model": "demo-poet", "prompt": PROMPT,
                                             "max_tokens": 1})  # fmt: skip
    assert tok["count"] == len(tok["tokens"]) == done.json()["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == 1024
    back = post(cluster, "/detokenize", {"model": "demo-poet", "tokens": tok["tokens"]})
    assert back.json() == {"prompt": PROMPT}

    chat = post(cluster, "/tokenize", {"model": "demo-poet", "messages": MESSAGES}).json()
    answer = post(cluster, "/v1/chat/completions", {"model": "demo-poet", "messages": MESSAGES,
                                                    "max_tokens": 1})  # fmt: skip
    assert chat["count"] == answer.json()["usage"]["prompt_tokens"] == len(chat["tokens"])


def test_keys_and_models_answer_as_on_inference(cluster):
    for path, body in [("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5, 6]})]:
        assert post(cluster, path, body, key="").status_code == 401
        forbidden = post(cluster, path, body | {"model": "t1-private"}, key="t2")
        inference = post(cluster, "/v1/completions", {"model": "t1-private", "prompt": PROMPT},
                         key="t2")  # fmt: skip
        assert forbidden.status_code == inference.status_code == 404
        assert forbidden.content == inference.content
