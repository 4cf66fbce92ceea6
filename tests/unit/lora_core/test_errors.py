"""Every lorafleet error survives pickling: a replica's error reaches the ingress through
Ray, which pickles it (cloudpickle honours __reduce__ as pickle does)."""

from __future__ import annotations

import pickle

import pytest

from lora_core import errors

# One instance of every error type, built with its own constructor's arguments.
CASES = [
    errors.InvalidRequest("max_tokens: -1; allowed: >= 1"),
    errors.RequestTooLarge("body: 40000000 bytes; allowed: at most 33554432 bytes", "body"),
    errors.AdapterNotFound("poet"),
    errors.AdapterIncompatible("r", "rank 128 exceeds max_rank", "rank <= 64"),
    errors.AdapterLoadFailed("/x: adapter_config.json is missing"),
    errors.AdapterDraining("poet"),
    errors.AdapterVersionUnavailable("poet v2 is not on this replica"),
    errors.AdapterAlreadyExists("adapter 'poet' already exists"),
    errors.PinRefused("no evictable slot would remain"),
    errors.Unauthorized("invalid API key"),
    errors.CapacityExceeded("queue full", retry_after_s=2.5),
    errors.ModelLoadFailed("no config.json"),
    errors.RegistryUnavailable("redis://127.0.0.1:1/0 refused the connection"),
    errors.StaleEpoch("epoch 3 < 4"),
    errors.NonFiniteLogits("req-7", 12),
    errors.ReplicaFailed("replica r1 stopped while answering"),
    errors.TenantRateLimited("acme", 600, 17),
]


def test_every_error_type_is_covered():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    covered = {type(e) for e in CASES}
    abstract = {errors.AdapterError}
    assert set(subclasses(errors.LoraFleetError)) - abstract == covered


@pytest.mark.parametrize("err", CASES, ids=lambda e: type(e).__name__)
def test_round_trip_keeps_type_message_and_fields(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.args == err.args
    assert back.__dict__ == err.__dict__
    assert back.retryable == err.retryable


def test_fields_survive():
    back = pickle.loads(pickle.dumps(errors.AdapterIncompatible("r", "rank 128", "rank <= 64")))
    assert (back.field, back.problem, back.allowed) == ("r", "rank 128", "rank <= 64")
    assert str(back) == "r: rank 128; allowed: rank <= 64"
    assert pickle.loads(pickle.dumps(errors.AdapterNotFound("poet"))).name == "poet"
    assert pickle.loads(pickle.dumps(errors.CapacityExceeded("m", 2.5))).retry_after_s == 2.5
    back = pickle.loads(pickle.dumps(errors.TenantRateLimited("acme", 600, 17)))
    assert (back.tenant, back.limit, back.retry_after_s) == ("acme", 600, 17)
