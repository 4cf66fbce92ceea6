"""vLLM's prompt_logprobs end to end (the OpenAI client as vLLM users send it, raw HTTP):
the scores equal echo + logprobs' of the same prompt and an HF + PEFT forward's, in
vLLM's shape, for a text and a token-id prompt, with n choices and on chat; with stream
they are refused as vLLM refuses them. Runs on the package's shared cluster."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.hf_reference import hf_logp
from tests.integration.serve.sampling.test_sampling_api import MESSAGES, PROMPT

pytestmark = pytest.mark.integration
K = 2


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0, timeout=60
    )


def post(cluster, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    return httpx.post(f"{cluster.http}{path}", json=body, headers=headers, timeout=60)


def tokenizer(cluster):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cluster.demo.model_dir))


def check_against_echo(scores: list, echoed, ids: list[int], k: int) -> None:
    """scores (prompt_logprobs) hold what echo + logprobs k showed for prompt ids: each
    token's logprob first, then the k most likely, ranked 1..k."""
    assert len(scores) == len(ids) and scores[0] is None
    assert echoed.token_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = scores[i]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(echoed.token_logprobs[i], abs=1e-5)
        top = sorted(echoed.top_logprobs[i].values(), reverse=True)[:k]
        ranked = sorted(entry.values(), key=lambda v: v["rank"])[:k]
        if own["rank"] > k:  # else the prompt token is one of the top k
            assert list(entry)[0] == str(ids[i]) and len(entry) == k + 1
        assert [v["rank"] for v in ranked] == list(range(1, k + 1))
        assert [v["logprob"] for v in ranked] == pytest.approx(top, abs=1e-5)


@pytest.mark.parametrize("prompt_kind", ["text", "ids"])
def test_prompt_logprobs_equal_the_echo_scores_and_hf(cluster, prompt_kind):
    """vLLM users' scoring request (extra_body prompt_logprobs, max_tokens 0, no echo):
    the choice's prompt_logprobs equal echo + logprobs' and HF + PEFT's log_softmax, each
    token's rank counts the tokens HF finds more likely, decoded_token is its text."""
    import torch

    tok = tokenizer(cluster)
    ids = tok(PROMPT).input_ids
    prompt = PROMPT if prompt_kind == "text" else ids
    r = client(cluster).completions.create(
        model="demo-poet", prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": K}
    )
    (choice,) = r.choices
    assert (choice.text, choice.finish_reason, choice.logprobs) == ("", "length", None)
    scores = choice.model_extra["prompt_logprobs"]
    echoed = client(cluster).completions.create(
        model="demo-poet", prompt=prompt, max_tokens=0, echo=True, logprobs=K
    )
    check_against_echo(scores, echoed.choices[0].logprobs, ids, K)
    logp = hf_logp(cluster.demo.model_dir, cluster.adapters["demo-poet"], ids)[:-1]
    want = logp[torch.arange(len(ids) - 1), ids[1:]]
    own = [scores[i][str(ids[i])] for i in range(1, len(ids))]
    assert [o["logprob"] for o in own] == pytest.approx(want.tolist(), abs=1e-4)
    above = (logp > want[:, None] + 1e-4).sum(-1).add(1).tolist()
    near = (logp >= want[:, None] - 1e-4).sum(-1).tolist()
    assert all(a <= o["rank"] <= b for a, o, b in zip(above, own, near, strict=True))
    assert [o["decoded_token"] for o in own] == [tok.decode([t]) for t in ids[1:]]


def test_n_choices_carry_the_scores_of_one_choice(cluster):
    """n = 2, generating: both choices carry the same prompt_logprobs, of the one choice
    the replica scored the prompt for, equal to the n = 1 request's (to float32 noise: the
    steps batch other tokens), and generate as without them."""
    body = {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 1}  # fmt: skip
    one = post(cluster, "/v1/completions", body).json()["choices"][0]
    r = post(cluster, "/v1/completions", {**body, "n": 2})
    assert r.status_code == 200, r.text
    plain = post(cluster, "/v1/completions", {**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    choices = r.json()["choices"]
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    want = one["prompt_logprobs"]
    assert want[0] is None and len(want) > 2
    for choice in choices:
        assert choice["text"] == one["text"] == plain["choices"][0]["text"]
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(want)
        for entry, wanted in zip(got[1:], want[1:], strict=True):
            assert list(entry) == list(wanted)  # the same tokens, in order
            for token, v in entry.items():
                assert v["logprob"] == pytest.approx(wanted[token]["logprob"], abs=1e-5)
                assert (v["rank"], v["decoded_token"]) == (
                    wanted[token]["rank"],
                    wanted[token]["decoded_token"],
                )


def test_chat_scores_its_templated_prompt_as_completions_score_those_ids(cluster):
    """Chat puts prompt_logprobs on the response (vLLM's place): the scores of the chat
    template's ids, equal to the completion of those ids with echo + logprobs."""
    ids = tokenizer(cluster).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    r = post(cluster, "/v1/chat/completions",
             {"model": "demo-poet", "messages": MESSAGES, "max_tokens": 2, "n": 2,
              "prompt_logprobs": K})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert all("prompt_logprobs" not in c for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(ids)
    echoed = client(cluster).completions.create(
        model="demo-poet", prompt=ids, max_tokens=0, echo=True, logprobs=K
    )
    check_against_echo(body["prompt_logprobs"], echoed.choices[0].logprobs, ids, K)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_prompt_logprobs_are_refused_as_vllm_refuses_them(cluster, path):
    body = {"model": "demo-poet", "stream": True, "prompt_logprobs": 1, "max_tokens": 2}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = post(cluster, path, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt_logprobs"
    assert "not streamed" in r.json()["error"]["message"]
