"""Session-wide fixtures: tiny models and PEFT adapters built once per test run."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path

# On a machine without CUDA the Triton kernels can only run in Triton's interpreter, and
# Triton reads this when it is first imported (transformers/peft may import it early).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

_SESSION: dict = {}


def _exit_before_native_teardown() -> None:
    """The suite's process ends here, with pytest's exit status, once Python's other
    atexit handlers have run (this one is registered before torch, Ray and grpc are
    imported, so it runs after theirs): the C++ static destructors, which run after
    this, are skipped. About one pytest run in ten (2026-12-02 here, CI on 2026-12-04)
    segfaulted there after every test had passed: Ray 2.60's OpenTelemetry metric
    exporter thread, which the driver's ray.shutdown() leaves running, logged through
    spdlog while exit() was destroying its logger registry (core dump of 2026-12-04:
    that thread in RayLog::~RayLog <- OpenTelemetryMetricExporter::Export, the main
    thread in __run_exit_handlers; ray-project/ray#60048 is a sibling of this race).
    LORAFLEET_TEST_FULL_EXIT=1 keeps the normal interpreter shutdown."""
    session = _SESSION.get("session")
    if session is None or os.environ.get("LORAFLEET_TEST_FULL_EXIT") == "1":
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(session.exitstatus))


atexit.register(_exit_before_native_teardown)


def pytest_sessionstart(session) -> None:
    _SESSION["session"] = session
    # The HF references (and the tiny models' init) run in this process too: their first
    # multi-threaded cos / sin / erfinv must not be MKL's first call (replica.vml_warmup).
    from replica.vml_warmup import warm_vector_math

    warm_vector_math()


from tests.tiny import (  # noqa: E402 - after the atexit hook
    ADAPTER_SPECS,
    MOE_ADAPTER_SPECS,
    make_peft_adapter,
    make_think_model,
    make_tiny_mixtral,
    make_tiny_model,
    make_tiny_qwen_moe,
)


@pytest.fixture(autouse=True)
def fresh_kernel_plans():
    """The Triton launchers memoise their plans (kernels.triton.launch.plan_cache); a test
    that patches a planning function or constant must neither meet plans made before it
    nor leave its own behind. Where no test has imported the launchers, nothing to do."""
    launch = sys.modules.get("kernels.triton.launch")
    if launch is not None:
        launch.clear_plans()
    yield
    launch = sys.modules.get("kernels.triton.launch")
    if launch is not None:
        launch.clear_plans()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def llama_dir(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "llama", "llama", seed=1)


@pytest.fixture(scope="session")
def qwen2_dir(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "qwen2", "qwen2", seed=2)


@pytest.fixture(scope="session")
def qwen3_dir(tiny_dir) -> Path:
    """A tiny Qwen3 whose head_dim (24) is not hidden/heads (16)."""
    return make_tiny_model(tiny_dir / "qwen3", "qwen3", seed=6, head_dim=24)


@pytest.fixture(scope="session")
def qwen3_bias_dir(tiny_dir) -> Path:
    """qwen3_dir's sizes with attention_bias (biases on q, k, v and o); the qwen3
    adapters fit it."""
    return make_tiny_model(
        tiny_dir / "qwen3-bias", "qwen3", seed=7, head_dim=24, attention_bias=True
    )


@pytest.fixture(scope="session")
def qwen3_yarn_dir(tiny_dir) -> Path:
    """qwen3_dir's sizes with yarn RoPE scaling (factor 4 over an original context of 8
    positions, which short test prompts run past); the qwen3 adapters fit it."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    return make_tiny_model(
        tiny_dir / "qwen3-yarn", "qwen3", seed=10, head_dim=24,
        rope_parameters={"rope_theta": 10000.0, **yarn},
    )  # fmt: skip


@pytest.fixture(scope="session")
def odd_vocab_dir(tiny_dir) -> Path:
    """The tiny Llama's sizes with an odd vocabulary (383: no tp > 1 divides it, so the
    last rank's vocab shard is padded) and tied embeddings; the llama adapters fit it."""
    return make_tiny_model(
        tiny_dir / "llama-odd-vocab", "llama", seed=3, vocab_size=383, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def think_dir(tiny_dir) -> Path:
    """A tiny reasoning model: "<think>" and "</think>" are one token each (`make_think_model`)."""
    return make_think_model(tiny_dir / "think")


def _adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: make_peft_adapter(model_dir, root / name, seed=10 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tiny_dir) -> dict[str, Path]:
    return _adapters(llama_dir, tiny_dir / "llama-adapters")


@pytest.fixture(scope="session")
def qwen2_adapters(qwen2_dir, tiny_dir) -> dict[str, Path]:
    return _adapters(qwen2_dir, tiny_dir / "qwen2-adapters")


@pytest.fixture(scope="session")
def qwen3_adapters(qwen3_dir, tiny_dir) -> dict[str, Path]:
    return _adapters(qwen3_dir, tiny_dir / "qwen3-adapters")


@pytest.fixture(scope="session")
def mixtral_dir(tiny_dir) -> Path:
    """A tiny Mixtral: 4 experts, top-2 (checkpoint in transformers' per-expert naming)."""
    return make_tiny_mixtral(tiny_dir / "mixtral", seed=5)


@pytest.fixture(scope="session")
def mixtral_adapters(mixtral_dir, tiny_dir) -> dict[str, Path]:
    return _moe_adapters(mixtral_dir, tiny_dir / "mixtral-adapters")


def _moe_adapters(model_dir: Path, out_dir: Path) -> dict[str, Path]:
    return {
        name: make_peft_adapter(model_dir, out_dir / name, seed=20 + i, **spec)
        for i, (name, spec) in enumerate(MOE_ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="session")
def qwen3_moe_dir(tiny_dir) -> Path:
    """A tiny Qwen3-MoE: 3 layers, the middle one a dense MLP (mlp_only_layers), 4 experts,
    top-2 not renormalised (norm_topk_prob false, the config's default), head_dim 24 !=
    hidden/heads (checkpoint in transformers' per-expert naming)."""
    return make_tiny_qwen_moe(
        tiny_dir / "qwen3-moe", "qwen3_moe", seed=11, num_hidden_layers=3, mlp_only_layers=[1],
        head_dim=24,
    )  # fmt: skip


@pytest.fixture(scope="session")
def qwen3_moe_adapters(qwen3_moe_dir, tiny_dir) -> dict[str, Path]:
    return _moe_adapters(qwen3_moe_dir, tiny_dir / "qwen3-moe-adapters")


@pytest.fixture(scope="session")
def qwen2_moe_dir(tiny_dir) -> Path:
    """A tiny Qwen2-MoE: 3 layers, the last one a dense MLP (mlp_only_layers), 4 experts,
    top-2 not renormalised, a shared expert, q/k/v biases."""
    return make_tiny_qwen_moe(
        tiny_dir / "qwen2-moe", "qwen2_moe", seed=12, num_hidden_layers=3, mlp_only_layers=[2]
    )


@pytest.fixture(scope="session")
def qwen2_moe_adapters(qwen2_moe_dir, tiny_dir) -> dict[str, Path]:
    return _moe_adapters(qwen2_moe_dir, tiny_dir / "qwen2-moe-adapters")
