"""vLLM's min_p and allowed_token_ids end to end (REST completions and chat through the
OpenAI client's extra_body, raw bodies, and gRPC fields 20 and 21): allowed_token_ids
restricts every sampled token, greedy or not, to the set and answers what an offline
engine with the same SamplingParams generates; min_p is honoured the same way; bad values
are 400 / INVALID_ARGUMENT naming the field.

One app with one replica, shared with this package's other modules (conftest.py).
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from replica.sampling_checks import ALLOWED_TOKEN_IDS_ALLOWED
from replica.sampling_params import SamplingParams
from router.logprobs import TokenTable
from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from tests.integration.serve.cluster_fixture import offline_outputs
from tests.integration.serve.sampling.test_sampling_api import MAX_TOKENS, MESSAGES, PROMPT, create

pytestmark = pytest.mark.integration
MIN_P = "allowed: a number 0 <= min_p <= 1 (0 = off)"
VOCAB = 384  # the demo model's (deploy/demo.py)


def _token_strings(cluster) -> TokenTable:
    """Token id -> its string as REST's logprobs spell it."""
    from transformers import AutoTokenizer

    return TokenTable(AutoTokenizer.from_pretrained(str(cluster.demo.model_dir)))


def _allowed(cluster) -> list[int]:
    """A set greedy's answer is not in: 40 ids, greedy's first token left out."""
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    _, plain = offline_outputs(cluster, PROMPT, free, ["demo-poet"])["demo-poet"]
    return [t for t in range(30, 150, 3) if t != plain[0]]


def _stub_meta(cluster):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    return stub, (("authorization", f"Bearer {cluster.keys['ops']}"),)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_restrict_rest_and_grpc_tokens(cluster, temperature):
    allowed = _allowed(cluster)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=5, allowed_token_ids=allowed
    )
    text, ids = offline_outputs(cluster, PROMPT, params, ["demo-poet"])["demo-poet"]
    assert ids and set(ids) <= set(allowed)
    fields = {"temperature": temperature, "seed": 5, "logprobs": 3}
    rest = create(cluster, "completions", **fields, extra_body={"allowed_token_ids": allowed})
    choice = rest.choices[0]
    assert choice.text == text
    table = _token_strings(cluster)
    allowed_text = {table[t].text for t in allowed}
    assert choice.logprobs.tokens == [table[t].text for t in ids]
    # logprobs stay the raw distribution's: greedy's first pick, left out of the set,
    # is still the most likely token of the first position
    assert set(choice.logprobs.top_logprobs[0]) - allowed_text
    stub, meta = _stub_meta(cluster)
    req = pb.GenerateRequest(
        model="demo-poet", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=temperature,
        seed=5, allowed_token_ids=allowed,
    )  # fmt: skip
    chunks = list(stub.Generate(req, metadata=meta))
    assert [t for c in chunks for t in c.token_ids] == ids
    chat = create(cluster, "chat", temperature=0, logprobs=True,
                  extra_body={"allowed_token_ids": allowed})  # fmt: skip
    assert {t.token for t in chat.choices[0].logprobs.content} <= allowed_text


def test_min_p_on_rest_and_grpc_equals_offline(cluster):
    """A seeded draw at temperature 2 with min_p 0.5 answers what the offline engine
    does with min_p (and differs from the draw without it)."""
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=2.0, seed=11)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=2.0, seed=11, min_p=0.5)
    want = offline_outputs(cluster, PROMPT, params, ["demo-poet"])["demo-poet"]
    assert want != offline_outputs(cluster, PROMPT, free, ["demo-poet"])["demo-poet"]
    rest = create(cluster, "completions", temperature=2.0, seed=11, extra_body={"min_p": 0.5})
    assert rest.choices[0].text == want[0]
    stub, meta = _stub_meta(cluster)
    req = pb.GenerateRequest(
        model="demo-poet", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=2.0, seed=11,
        min_p=0.5,
    )  # fmt: skip
    assert [t for c in stub.Generate(req, metadata=meta) for t in c.token_ids] == want[1]


def _bad_values(vocab: int = VOCAB) -> list[tuple[dict, str, str]]:
    """(fields, param, message); the out-of-vocabulary id is refused by the replica's
    engine (the vocabulary is the model's), the others by the ingress."""
    return [
        ({"min_p": -0.1}, "min_p", f"min_p=-0.1; {MIN_P}"),
        ({"min_p": 1.5}, "min_p", f"min_p=1.5; {MIN_P}"),
        (
            {"allowed_token_ids": []},
            "allowed_token_ids",
            f"allowed_token_ids: an empty list allows no token; {ALLOWED_TOKEN_IDS_ALLOWED}",
        ),
        (
            {"allowed_token_ids": [5, vocab]},
            "allowed_token_ids",
            f"allowed_token_ids: token id {vocab} out of range; allowed: token ids 0 <= id < "
            f"{vocab}",
        ),
    ]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_400_naming_the_field(cluster, path):
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    body = {"model": "demo-poet", "max_tokens": 2}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    for fields, param, message in _bad_values():
        for stream in (False, True):
            r = httpx.post(
                f"{cluster.http}{path}", json={**body, **fields, "stream": stream},
                headers=headers, timeout=60,
            )  # fmt: skip
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert (err["param"], err["message"]) == (param, message), fields


def test_bad_values_are_grpc_invalid_argument(cluster):
    stub, meta = _stub_meta(cluster)
    for fields, _, message in _bad_values():
        if fields.get("allowed_token_ids") == []:
            continue  # proto3 cannot send an empty list apart from none: it is off
        req = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, max_tokens=2, **fields)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=meta))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert e.value.details() == message, fields
