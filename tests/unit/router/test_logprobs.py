"""Token raw bytes, text offsets and top logprobs of OpenAI responses, on the demo
byte-level BPE tokenizer: from the token table up to REST bodies and SSE streams."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import pre_tokenizers

from deploy.demo import build_tokenizer
from replica.outputs import RequestOutput
from replica.sampling_params import SamplingParams
from router.auth import AdapterResolver
from router.frontend import Frontend
from router.logprobs import _BYTE_DECODER, Candidate, LogprobReader, TokenLogprob, TokenTable
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.openai_responses import Head, Piece, completion_chunk
from router.rest import chat_completions, completions

BASE = "base"
TEXTS = [
    "f\uf043 memory",  # U+F043 = EF 81 83: one token per byte
    "\u05b4x tenants",  # U+05B4 = D6 B4: two tokens
    "日本語 serving 🙂 ok",
    "plain ascii text",
]
END = 4  # <|end|>, a special token: in the token list, not in the text


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


def test_byte_decoder_inverts_the_byte_level_alphabet():
    assert set(_BYTE_DECODER) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_BYTE_DECODER.values()) == list(range(256))
    assert (_BYTE_DECODER["Ġ"], _BYTE_DECODER["A"], _BYTE_DECODER["Ā"]) == (32, 65, 0)


@pytest.mark.parametrize("text", TEXTS)
def test_raw_bytes_rebuild_the_text(tokenizer, text):
    table = TokenTable(tokenizer)
    infos = [table[t] for t in tokenizer(text).input_ids]
    assert b"".join(i.raw for i in infos) == text.encode()
    assert all(i.in_text for i in infos)
    # pieces of a split character are spelled by their bytes, whole characters as text
    for i in infos:
        try:
            assert i.text == i.raw.decode("utf-8")
        except UnicodeDecodeError:
            assert i.text == "bytes:" + "".join(f"\\x{b:02x}" for b in i.raw)
    assert any(i.text.startswith("bytes:") for i in infos) == (not text.isascii())


def test_special_tokens_are_left_out_of_the_text(tokenizer):
    info = TokenTable(tokenizer)[END]
    assert (info.text, info.raw, info.in_text) == ("<|end|>", b"<|end|>", False)


def _outputs(tokenizer, ids: list[int], size: int, alts=()) -> list[RequestOutput]:
    """ids streamed `size` at a time (text held back while a character is incomplete),
    each sampled with logprob -0.25 and alternatives `alts` ((id, logprob), ...)."""
    outs, emitted = [], ""
    for start in range(0, len(ids), size):
        chunk = ids[start : start + size]
        text = tokenizer.decode(ids[: start + size], skip_special_tokens=True).rstrip("\ufffd")
        tops = [tuple(alts)] * len(chunk) if alts else []
        outs.append(RequestOutput("r", chunk, text[len(emitted) :], [-0.25] * len(chunk), tops))
        emitted = text
    return outs


def _offsets(tokenizer, ids: list[int], size: int) -> list[int]:
    reader = LogprobReader(TokenTable(tokenizer))
    return [e.text_offset for out in _outputs(tokenizer, ids, size) for e in reader.read(out)]


def test_offsets_of_a_character_split_over_tokens(tokenizer):
    ids = tokenizer("f\uf043 memory").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["f", "ï", "ģ", "ĥ", "Ġmemory"]
    assert _offsets(tokenizer, ids, 1) == [0, 1, 1, 1, 2]


# Invalid UTF-8 (byte-level vocab characters: "æ" = E6, a lead byte; "ģ" = 81, a
# continuation byte; "Ġ" = space) -> the text's U+FFFD and the tokens' exact offsets.
# A special token after an incomplete character cannot know yet whether that character
# will complete: it points at it, like a token inside a character.
INVALID = [
    (["æ", "Ġ", "x"], "\ufffd x", [0, 1, 2]),
    (["ģ", "x"], "\ufffdx", [0, 1]),
    (["æ", "ģ", "Ġ"], "\ufffd ", [0, 0, 1]),
    (["æ", "æ", "x"], "\ufffd\ufffdx", [0, 1, 2]),
    (["x", "æ", "<|end|>", "Ġ", "æ"], "x\ufffd \ufffd", [0, 1, 1, 2, 3]),
]


@pytest.mark.parametrize("pieces, text, offsets", INVALID)
def test_offsets_after_invalid_utf8(tokenizer, pieces, text, offsets):
    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert _offsets(tokenizer, ids, 1) == offsets


@pytest.mark.parametrize("text", [*TEXTS, *(t for _, t, _ in INVALID)])
@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_offsets_point_into_the_text_in_any_chunking(tokenizer, text, size):
    ids = tokenizer(text).input_ids
    ids = ids[:2] + [END] + ids[2:]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    offsets = _offsets(tokenizer, ids, size)
    assert offsets == _offsets(tokenizer, ids, len(ids))
    assert offsets == sorted(offsets) and offsets[-1] < len(whole)
    for t, off in zip(ids, offsets, strict=True):
        token = tokenizer.decode([t], skip_special_tokens=True)
        if "\ufffd" not in token:
            assert whole[off:].startswith(token), (t, off)


class Replica:
    """Dispatch that replays scripted outputs."""

    def __init__(self, outputs):
        self.outputs = outputs

    async def __call__(self, call):
        for out in self.outputs:
            yield out


def _front(tokenizer, alts) -> Frontend:
    ids = tokenizer(TEXTS[0]).input_ids
    resolver = AdapterResolver(None, BASE, auth=False, admin_key="")
    return Frontend(tokenizer, resolver, Replica(_outputs(tokenizer, ids, 2, alts)), 64)


def _alts(tokenizer, k: int) -> tuple[tuple[int, float], ...]:
    """k alternatives "a", "b": more likely than the sampled tokens, none equal to one."""
    return tuple((tokenizer.convert_tokens_to_ids(c), -0.5 - i) for i, c in enumerate("ab"))[:k]


def _respond(handler, front, req):
    async def go():
        resp = await handler(front, None, req)
        if not hasattr(resp, "body_iterator"):
            return json.loads(resp.body)
        events = [e async for e in resp.body_iterator]
        data = [e.decode().removeprefix("data: ").strip() for e in events]
        return [json.loads(d) for d in data if d != "[DONE]"]

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_with_top_alternatives(tokenizer, stream):
    req = CompletionRequest(model=BASE, prompt="hi", logprobs=2, stream=stream)
    assert req.to_sampling_params() == SamplingParams(logprobs=True, top_logprobs=2)
    got = _respond(completions, _front(tokenizer, _alts(tokenizer, 2)), req)
    choices = [c["choices"][0] for c in (got if stream else [got])]
    text = "".join(c["text"] for c in choices)
    lps = {k: [x for c in choices for x in c["logprobs"][k]] for k in choices[0]["logprobs"]}
    ids = tokenizer(TEXTS[0]).input_ids
    tokens = ["f", "bytes:\\xef", "bytes:\\x81", "bytes:\\x83", " memory"]
    assert len(ids) == len(tokens) and text == TEXTS[0]
    assert lps["tokens"] == tokens and lps["token_logprobs"] == [-0.25] * len(ids)
    assert lps["text_offset"] == [0, 1, 1, 1, 2]
    # OpenAI legacy semantics: the k most likely tokens plus the sampled one.
    assert lps["top_logprobs"] == [{"a": -0.5, "b": -1.5, t: -0.25} for t in tokens]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_carry_raw_bytes_and_top_alternatives(tokenizer, stream):
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(
        model=BASE, messages=msgs, logprobs=True, top_logprobs=1, stream=stream
    )
    got = _respond(chat_completions, _front(tokenizer, _alts(tokenizer, 1)), req)
    choices = [c["choices"][0] for c in (got if stream else [got])]
    content = [x for c in choices if c["logprobs"] for x in c["logprobs"]["content"]]
    ids = tokenizer(TEXTS[0]).input_ids
    assert bytes(b for c in content for b in c["bytes"]) == TEXTS[0].encode()
    assert [c["bytes"] for c in content] == [[0x66], [0xEF], [0x81], [0x83], list(b" memory")]
    assert [(c["token"], c["logprob"]) for c in content] == [
        (t, -0.25) for t in ["f", "bytes:\\xef", "bytes:\\x81", "bytes:\\x83", " memory"]
    ]
    assert len(ids) == len(content)
    top = [{"token": "a", "logprob": -0.5, "bytes": [0x61]}]
    assert all(c["top_logprobs"] == top for c in content)


def test_top_logprobs_keys_keep_the_sampled_tokens_own_logprob():
    def piece(raw, lp):
        return Candidate("bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw, lp)

    alts = (piece(b"\xef", -1.0), Candidate("a", b"a", -2.0), piece(b"\xe6", -2.5))
    entry = TokenLogprob(piece(b"\x81", -3.0), 0, alts)
    body = completion_chunk(Head("id", BASE, 0), 0, Piece("", [entry]), True)
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [
        {"bytes:\\xef": -1.0, "a": -2.0, "bytes:\\xe6": -2.5, "bytes:\\x81": -3.0}
    ]
    # two tokens spelling the same text share a key; the sampled one keeps its own value
    same = TokenLogprob(Candidate("x", b"x", -3.0), 0, (Candidate("x", b"x", -1.0),))
    body = completion_chunk(Head("id", BASE, 0), 0, Piece("", [same]), True)
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"x": -3.0}]
