"""Baseline replica for benchmarks: Serve's own model multiplexing instead of our router.

`multiplexed_deployment(max_loras)` is the replica deployment with an
`@serve.multiplexed` adapter loader, to run under Serve's default power-of-two
router, which prefers replicas that report the request's `multiplexed_model_id`
(the ingress sets it to the adapter key). Everything else is `LoraReplica`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from lora_core.identity import AdapterRef
from replica.deployment import LoraReplica
from replica.outputs import RequestOutput
from replica.serve_protocol import GenerateCall


def multiplexed_deployment(max_loras: int) -> serve.Deployment:
    """The baseline deployment; Serve keeps at most `max_loras` adapters per replica."""

    class MultiplexedLoraReplica(LoraReplica):
        async def generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
            if call.adapter is not None:
                self.refs[call.adapter.key] = call.adapter
                await self.adapter(serve.get_multiplexed_model_id())
            async for out in super().generate(call):
                yield out

        @serve.multiplexed(max_num_models_per_replica=max_loras)
        async def adapter(self, key: str) -> AdapterRef:
            # CPU only: the scheduler moves it into a GPU slot when a request needs it
            # (a direct GPU load would fail while every slot serves running requests).
            ref = self.refs[key]
            await self.engine.load_adapter(ref)
            return ref

    return serve.deployment(
        MultiplexedLoraReplica,
        name="LoraReplica",
        graceful_shutdown_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=5.0,
    )
