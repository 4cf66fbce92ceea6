"""The Serve router shell's input conversion (pure functions, no Ray cluster)."""

from types import SimpleNamespace

from lora_core.identity import AdapterRef
from replica.sampling_params import SamplingParams
from replica.serve_protocol import GenerateCall
from router.ranking import ReplicaLoad
from router.request_router import call_of, load_of


def test_load_of_reads_routing_stats_and_prefers_the_longer_queue():
    stats = {
        "gpu": ["k1"],
        "cpu": ["k1", "k2"],
        "free_slots": 1,
        "queue_len": 2,
        "kv_usage": 0.5,
        "time": 9.0,
    }
    assert load_of("r", stats, None) == ReplicaLoad(
        "r", frozenset({"k1"}), frozenset({"k1", "k2"}), 1, 2, 0.5, 9.0
    )
    assert load_of("r", stats, 5).queue_len == 5
    assert load_of("r", stats, 1).queue_len == 2
    assert load_of("r", {}, None) == ReplicaLoad("r")


def test_call_of_finds_the_generate_call_in_args_or_kwargs():
    ref = AdapterRef("a", 1, "f" * 64, "/p", 8)
    call = GenerateCall("id", (1,), SamplingParams(), ref)
    assert call_of(SimpleNamespace(args=[call], kwargs={})) is call
    assert call_of(SimpleNamespace(args=[], kwargs={"call": call})) is call
    assert call_of(SimpleNamespace(args=["x"], kwargs={})) is None
    assert call_of(None) is None
    assert call.adapter_key == ref.key
