"""`n` choices through the REST handlers over a real Frontend (fake registry, scripted
dispatch): one resolution and one tokenization, n engine requests with their own ids
and seeds, the response's shape (indexes, usage, stream chunks), and that one failing
choice or a client leaving stops every engine request."""

import asyncio
import json

import pytest

from lora_core.errors import CapacityExceeded, NonFiniteLogits, ReplicaFailed
from replica.outputs import RequestOutput
from router import rest
from router.auth import AdapterResolver
from router.body_parse import parse_body
from router.frontend import Frontend
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.polling import wait_for_async
from tests.unit.router.test_frontend_auth import BASE, FakeRegistry, tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared
STEPS = 3


class ChoiceDispatch:
    """Each call yields STEPS outputs "<seed>:<k>" (usage counts as an engine's);
    `fail` maps a call's number (1-based) to (error, outputs before raising); `hang`
    makes calls wait forever after their first output. `ended` records how each call's
    generator ended: "done", "failed", or "aborted" (closed or cancelled early)."""

    def __init__(self, fail=None, hang=False):
        self.fail = fail or {}
        self.hang = hang
        self.calls = []
        self.ended: dict[str, str] = {}

    async def __call__(self, call):
        self.calls.append(call)
        error, after = self.fail.get(len(self.calls), (None, 0))
        how = "aborted"
        try:
            for k in range(STEPS):
                await asyncio.sleep(0)
                if error is not None and k == after:
                    how = "failed"
                    raise error
                if self.hang and k == 1:
                    await asyncio.Event().wait()
                yield RequestOutput(
                    call.request_id,
                    [k],
                    f"{call.params.seed}:{k} ",
                    finish_reason="length" if k == STEPS - 1 else None,
                    num_prompt_tokens=len(call.prompt_token_ids),
                    num_output_tokens=k + 1,
                )
            how = "done"
        finally:
            self.ended[call.request_id] = how


class CountingEncoder:
    """The frontend's tokenizer copy, counting how often the prompt is tokenized."""

    def __init__(self, inner):
        self.inner, self.count = inner, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.count += 1
        return self.inner.apply_chat_template(*args, **kwargs)


def make_front(tokenizer, dispatch):
    registry = FakeRegistry()
    front = Frontend(tokenizer, AdapterResolver(registry, BASE, False, ""), dispatch, 64)
    front._encoder = CountingEncoder(front._encoder)
    return front, registry


CHAT = {"model": "a1", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "a1", "prompt": "hello world"}
HANDLERS = [
    (rest.completions, CompletionRequest, COMPLETION),
    (rest.chat_completions, ChatCompletionRequest, CHAT),
]


def respond(front, handler, model, body):
    return asyncio.run(handler(front, None, parse_body(model, body)))


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def expected_text(seed) -> str:
    return "".join(f"{seed}:{k} " for k in range(STEPS))


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_n_choices_resolve_and_tokenize_once_and_sample_with_derived_seeds(
    tokenizer, handler, model, body
):
    dispatch = ChoiceDispatch()
    front, registry = make_front(tokenizer, dispatch)
    r = respond(front, handler, model, {**body, "n": 3, "seed": 5, "max_tokens": STEPS})
    assert r.status_code == 200
    out = json.loads(r.body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [text_of(c) for c in out["choices"]] == [expected_text(s) for s in (5, 6, 7)]
    assert {c["finish_reason"] for c in out["choices"]} == {"length"}
    prompt = len(dispatch.calls[0].prompt_token_ids)
    assert out["usage"] == {
        "prompt_tokens": prompt, "completion_tokens": 3 * STEPS, "total_tokens": prompt + 9,
    }  # fmt: skip
    assert (registry.resolves, front._encoder.count) == (1, 1)
    rid = dispatch.calls[0].request_id.removesuffix("-0")
    assert [c.request_id for c in dispatch.calls] == [f"{rid}-{i}" for i in range(3)]
    assert len({(c.prompt_token_ids, c.adapter) for c in dispatch.calls}) == 1
    assert dispatch.ended == dict.fromkeys((c.request_id for c in dispatch.calls), "done")


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_greedy_and_unseeded_choices_send_the_same_params_n_times(tokenizer, handler, model, body):
    dispatch = ChoiceDispatch()
    front, _ = make_front(tokenizer, dispatch)
    r = respond(front, handler, model, {**body, "n": 3, "temperature": 0, "max_tokens": STEPS})
    assert r.status_code == 200
    assert {(c.params.seed, c.params.temperature) for c in dispatch.calls} == {(None, 0.0)}
    assert len(dispatch.calls) == 3


def test_one_choice_keeps_the_single_request_id(tokenizer):
    dispatch = ChoiceDispatch()
    front, _ = make_front(tokenizer, dispatch)
    r = respond(front, rest.completions, CompletionRequest, {**COMPLETION, "seed": 5})
    assert r.status_code == 200 and len(json.loads(r.body)["choices"]) == 1
    assert [c.request_id.count("-") for c in dispatch.calls] == [1]  # "req-<hex>"
    assert dispatch.calls[0].params.seed == 5


def stream_events(front, handler, model, body, leave_after=None, left=None):
    """The SSE data of a streamed response (JSON-decoded but [DONE]); leave_after: close
    the body after that many events, as Starlette does when the client disconnects, and
    call left() at once (before the event loop runs anything else)."""

    async def go():
        response = await handler(front, None, parse_body(model, body))
        events = []
        async for raw in response.body_iterator:
            events.append(raw.decode().removeprefix("data: ").strip())
            if leave_after is not None and len(events) == leave_after:
                await response.body_iterator.aclose()
                left()
                break
        return events

    datas = asyncio.run(go())
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


STREAM = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": STEPS}


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_a_stream_of_n_choices_reassembles_to_the_whole_response(tokenizer, handler, model, body):
    dispatch = ChoiceDispatch()
    front, _ = make_front(tokenizer, dispatch)
    events = stream_events(front, handler, model, {**body, **STREAM, "n": 2, "seed": 9})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    usage = [c for c in chunks if "usage" in c]
    assert usage == [chunks[-1]] and usage[0]["choices"] == []
    prompt = len(dispatch.calls[0].prompt_token_ids)
    assert usage[0]["usage"] == {
        "prompt_tokens": prompt, "completion_tokens": 2 * STEPS, "total_tokens": prompt + 6,
    }  # fmt: skip
    per_choice = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        per_choice[choice["index"]].append(choice)
    chat = handler is rest.chat_completions
    for i, seed in enumerate((9, 10)):
        got = per_choice[i]
        if chat:  # each choice opens with its role chunk, all before any content
            assert got[0]["delta"] == {"role": "assistant", "content": ""}
            assert chunks[i]["choices"][0] == got[0]
            got = got[1:]
        texts = [c["delta"].get("content", "") if chat else c["text"] for c in got]
        assert "".join(texts) == expected_text(seed)
        assert [c["finish_reason"] for c in got] == [None] * (STEPS - 1) + ["length"]


@pytest.mark.parametrize("handler, model, body", HANDLERS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_failing_before_its_first_output_fails_the_request_and_aborts_the_rest(
    tokenizer, handler, model, body, stream
):
    dispatch = ChoiceDispatch(fail={2: (CapacityExceeded("full"), 0)}, hang=True)
    front, _ = make_front(tokenizer, dispatch)
    r = respond(front, handler, model, {**body, "n": 3, "stream": stream})
    assert r.status_code == 429
    assert json.loads(r.body)["error"]["code"] == "capacity_exceeded"
    ids = [c.request_id for c in dispatch.calls]
    assert dispatch.ended == {ids[0]: "aborted", ids[1]: "failed", ids[2]: "aborted"}


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_a_choice_failing_mid_way_fails_a_whole_answer_and_aborts_the_rest(
    tokenizer, handler, model, body
):
    dispatch = ChoiceDispatch(fail={3: (NonFiniteLogits("req-x", 1), 1)}, hang=True)
    front, _ = make_front(tokenizer, dispatch)
    r = respond(front, handler, model, {**body, "n": 3})
    assert r.status_code == 500
    assert json.loads(r.body)["error"]["code"] == "non_finite_logits"
    ids = [c.request_id for c in dispatch.calls]
    assert dispatch.ended == {ids[0]: "aborted", ids[1]: "aborted", ids[2]: "failed"}


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_a_choice_failing_mid_stream_ends_it_with_the_error_event_and_aborts_the_rest(
    tokenizer, handler, model, body
):
    dispatch = ChoiceDispatch(fail={1: (NonFiniteLogits("req-x", 1), 1)}, hang=True)
    front, _ = make_front(tokenizer, dispatch)
    events = stream_events(front, handler, model, {**body, **STREAM, "n": 3})
    assert events[-2:] == [
        {"error": {"message": str(NonFiniteLogits("req-x", 1)), "type": "server_error",
                   "param": None, "code": "non_finite_logits"}},
        "[DONE]",
    ]  # fmt: skip
    assert not any("usage" in e for e in events[:-1])
    ids = [c.request_id for c in dispatch.calls]
    assert dispatch.ended == {ids[0]: "failed", ids[1]: "aborted", ids[2]: "aborted"}


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_a_client_leaving_a_stream_aborts_every_choice(tokenizer, handler, model, body):
    dispatch = ChoiceDispatch(hang=True)
    front, _ = make_front(tokenizer, dispatch)
    seen = {}
    events = stream_events(
        front, handler, model, {**body, **STREAM, "n": 3}, 2, lambda: seen.update(dispatch.ended)
    )
    assert len(events) == 2 and len(dispatch.calls) == 3
    # aborted by the time the close returns, not when the garbage collector gets to them
    assert seen == dict.fromkeys((c.request_id for c in dispatch.calls), "aborted")


@pytest.mark.parametrize("handler, model, body", HANDLERS)
def test_a_client_leaving_a_whole_answer_aborts_every_choice(tokenizer, handler, model, body):
    dispatch = ChoiceDispatch(hang=True)
    front, _ = make_front(tokenizer, dispatch)

    async def go():
        # Serve cancels the handler's task when the HTTP client disconnects
        task = asyncio.ensure_future(handler(front, None, parse_body(model, {**body, "n": 3})))
        await wait_for_async(lambda: len(dispatch.calls) >= 3, 30, "3 engine requests", 0.01)
        await asyncio.sleep(0.05)  # every choice past its first output, collecting
        assert dispatch.ended == {}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return dict(dispatch.ended)

    seen = asyncio.run(go())
    assert seen == dict.fromkeys((c.request_id for c in dispatch.calls), "aborted")


def test_a_failed_replica_restarts_only_its_own_choice(tokenizer):
    dispatch = ChoiceDispatch(fail={2: (ReplicaFailed("gone"), 1)})
    front, _ = make_front(tokenizer, dispatch)
    r = respond(front, rest.completions, CompletionRequest, {**COMPLETION, "n": 2, "seed": 1})
    assert r.status_code == 200
    out = json.loads(r.body)
    assert [text_of(c) for c in out["choices"]] == [expected_text(1), expected_text(2)]
    assert out["usage"]["completion_tokens"] == 2 * STEPS
    assert [c.params.seed for c in dispatch.calls] == [1, 2, 2]
    ended = [dispatch.ended[c.request_id] for c in dispatch.calls]
    assert ended == ["done", "failed", "done"]
