"""A real CPU engine behind a Frontend, called as the replica deployment calls it (an
AsyncEngine; no Ray), for the REST handler tests over a real engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from replica.async_engine import AsyncEngine
from replica.engine import LLMEngine
from router.auth import AdapterResolver
from router.frontend import Frontend
from tests.unit.router.test_frontend_auth import BASE, FakeRegistry


@contextlib.contextmanager
def served_frontend(
    engine: LLMEngine,
    max_model_len: int | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    tokenizer=None,
) -> Iterator[Frontend]:
    """A Frontend (no auth, base model BASE) whose requests engine runs; max_model_len:
    the Frontend's context (default the engine's); tool_call_parser, reasoning_parser:
    the Frontend's; tokenizer: the Frontend's (default the engine's; one of the same
    vocabulary with another chat template, say)."""
    front_end = AsyncEngine(engine.config, engine)

    async def dispatch(call):  # as replica.deployment calls it
        outputs = front_end.generate(
            call.request_id, list(call.prompt_token_ids), call.params, call.adapter,
            call.cache_salt, call.group,
        )  # fmt: skip
        async for out in outputs:
            yield out

    resolver = AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="")
    try:
        max_len = max_model_len or engine.max_model_len
        yield Frontend(
            tokenizer or engine.tokenizer,
            resolver,
            dispatch,
            max_len,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
    finally:
        front_end.shutdown()
