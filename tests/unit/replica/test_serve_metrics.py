"""The `model` label of the request counters is bounded per replica: the base model and
the first max_models adapters keep their own series, later adapters share "(other)".

The counters are Ray Serve's real ones (they record without a running cluster); each
`inc` is observed on its way in, since nothing can be read back without a cluster."""

from __future__ import annotations

import pytest

from replica.outputs import RequestOutput
from replica.serve_metrics import DEFAULT_MAX_MODELS, OTHER_MODEL, ModelLabels, RequestCounters


@pytest.mark.parametrize(
    "max_models, seen, labels",
    [
        (2, "a llama b c a", "a llama b (other) a"),
        (2, "llama llama a b c d b", "llama llama a b (other) (other) b"),
        (0, "a llama b", "(other) llama (other)"),
        (5, "a b c", "a b c"),
    ],
)
def test_model_labels_first_come_first_kept(max_models: int, seen: str, labels: str):
    label = ModelLabels("llama", max_models)
    assert " ".join(label(m) for m in seen.split()) == labels


def test_without_a_base_model_name_every_model_counts():
    label = ModelLabels("", 1)
    assert [label(m) for m in ("llama", "a", "llama")] == ["llama", OTHER_MODEL, "llama"]


def test_max_models_must_not_be_negative():
    with pytest.raises(ValueError, match=r"max_models=-1; allowed: >= 0"):
        ModelLabels("llama", -1)


def _output(prompt: int, generated: int, reason: str) -> RequestOutput:
    return RequestOutput(
        "r", finish_reason=reason, num_prompt_tokens=prompt, num_output_tokens=generated
    )


@pytest.fixture
def counted(monkeypatch) -> tuple[RequestCounters, list[tuple[str, float, dict]]]:
    """(real counters with the default cap and base "llama", every inc made: (metric,
    value, tags))."""
    counters = RequestCounters("llama")
    calls: list[tuple[str, float, dict]] = []
    for attr in ("requests", "prompt_tokens", "generated_tokens"):
        metric = getattr(counters, attr)
        real = metric.inc

        def spy(value=1.0, tags=None, _real=real, _attr=attr):
            calls.append((_attr, value, dict(tags)))
            _real(value, tags)

        monkeypatch.setattr(metric, "inc", spy)
    return counters, calls


def test_counters_bound_the_model_label(counted):
    counters, calls = counted
    for i in range(3 * DEFAULT_MAX_MODELS):
        counters.record(f"tenant-{i}", "stop", _output(3, 2, "stop"))
        counters.record("llama", "length", _output(5, 7, "length"))
    counters.record("tenant-0", "abort", None)
    counters.record(f"tenant-{2 * DEFAULT_MAX_MODELS}", "error", None)
    models = {tags["model"] for _, _, tags in calls}
    kept = {f"tenant-{i}" for i in range(DEFAULT_MAX_MODELS)}
    assert models == kept | {"llama", OTHER_MODEL}
    requests = [(tags["model"], tags["finish_reason"]) for m, _, tags in calls if m == "requests"]
    assert requests.count((OTHER_MODEL, "stop")) == 2 * DEFAULT_MAX_MODELS
    assert requests.count(("llama", "length")) == 3 * DEFAULT_MAX_MODELS
    assert requests[-2:] == [("tenant-0", "abort"), (OTHER_MODEL, "error")]
    other_tokens = [
        (m, v) for m, v, tags in calls if m != "requests" and tags["model"] == OTHER_MODEL
    ]
    assert sorted(set(other_tokens)) == [("generated_tokens", 2), ("prompt_tokens", 3)]
    assert len(other_tokens) == 2 * 2 * DEFAULT_MAX_MODELS
