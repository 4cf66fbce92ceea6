"""Autoscaling on adapter-slot demand: the policy inside Serve's own wrapper with Serve's
real context and config, then a live cluster (1 slot per replica) that grows from 1 to 2
replicas under two adapters' requests and shrinks back when they stop. The clients keep
at most 6 requests in flight against a target of 8 per replica, so request load alone
(Serve's default policy) never asks for a second replica: only adapter demand can."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from cluster.autoscaling import LoraAutoscalingPolicy
from replica.autoscaling_metrics import ACTIVE_ADAPTERS, ADAPTER_SHARE, KV_USAGE, MAX_LORAS, WAITING
from tests.integration.serve.cluster_fixture import APP, start_cluster, stop_cluster
from tests.polling import wait_for

pytestmark = pytest.mark.integration


def serve_context(current: int, target: int, metrics, ongoing: float, config, state, now):
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=DeploymentID(name="LoraReplica", app_name="lorafleet"),
        deployment_name="LoraReplica",
        app_name="lorafleet",
        current_num_replicas=current,
        target_num_replicas=target,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics=lambda: metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def test_inside_serves_wrapper_adapter_demand_scales_up_where_queue_length_would_not():
    """The policy as Serve's controller runs it: wrapped by Serve's delay / factor logic,
    reading Serve's own AutoscalingContext. Two requests for two adapters on one replica
    with one slot: Serve's default policy stays at 1 (2 / 8 requests); this one goes to 2
    once upscale_delay_s has passed, and back down when the demand is gone."""
    from ray.serve.autoscaling_policy import (
        _apply_autoscaling_config,
        replica_queue_length_autoscaling_policy,
    )
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(
        min_replicas=1,
        max_replicas=4,
        target_ongoing_requests=8,
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
    )
    busy = {
        ACTIVE_ADAPTERS: {"r0": 2.0},
        ADAPTER_SHARE: {"r0": 2.0},
        MAX_LORAS: {"r0": 1.0},
        KV_USAGE: {"r0": 0.1},
        WAITING: {"r0": 1.0},
    }
    lora = _apply_autoscaling_config(LoraAutoscalingPolicy())
    default = _apply_autoscaling_config(replica_queue_length_autoscaling_policy)
    n_default, _ = default(serve_context(1, 1, busy, 2.0, config, {}, 0.0))
    n_lora, state = lora(serve_context(1, 1, busy, 2.0, config, {}, 0.0))
    assert (n_default, n_lora) == (1, 2)
    assert state["lorafleet_reason"] == "adapters"

    idle = {ACTIVE_ADAPTERS: {"r0": 0.0, "r1": 0.0}, MAX_LORAS: {"r0": 1.0, "r1": 1.0}}
    n_idle, _ = lora(serve_context(2, 2, idle, 0.0, config, state, 1.0))
    assert n_idle == 1  # no demand left: down to min_replicas


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["LoraReplica"]
    return status.replica_states.get("RUNNING", 0)


def controller_log() -> str:
    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    return "".join(p.read_text() for p in (session / "logs" / "serve").glob("controller_*.log"))


@pytest.fixture(scope="module")
def scaling(tmp_path_factory):
    cluster = start_cluster(
        tmp_path_factory.mktemp("scaling"),
        auth=False,
        max_loras=1,
        served_model_name="fleet-base",
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 8,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 2.0,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 1.5,
        },
    )
    yield cluster
    stop_cluster(cluster)


def test_adapter_demand_grows_the_fleet_and_idle_shrinks_it(scaling):
    assert running_replicas() == 1
    stop = threading.Event()
    codes: list[int] = []

    def client(model: str) -> None:
        with httpx.Client(base_url=scaling.http, timeout=60) as c:
            while not stop.is_set():
                body = {"model": model, "prompt": "hi", "max_tokens": 32, "ignore_eos": True}
                codes.append(c.post("/v1/completions", json=body).status_code)

    # 6 requests in flight (load 6 / 8 = 0.75 replicas) for 2 adapters on 1 slot each.
    workers = [
        threading.Thread(target=client, args=(m,), daemon=True)
        for m in ("demo-poet", "demo-chef")
        for _ in range(3)
    ]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: running_replicas() == 2, 90, "scaling up to 2 replicas")
        # the added replica takes adapters (an idle one would leave the first thrashing):
        # its first registry tick loads the adapter with the most requests per copy
        wait_for(
            lambda: sum(v > 0 for v in scaling.gauge("active_adapters").values()) == 2,
            30,
            "both replicas serving adapters",
        )
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    assert codes and set(codes) == {200}, sorted(set(codes))

    # the controller's log names the signal that asked for the second replica
    def adapters_asked() -> bool:  # the log file may lag the controller by a moment
        wishes = re.findall(r"1 replicas, want (\d+) \(adapters;", controller_log())
        return any(int(w) > 1 for w in wishes)

    wait_for(adapters_asked, 15, "a controller log line: 1 replica, adapters want > 1")
    wait_for(lambda: running_replicas() == 1, 90, "scaling back down to 1 replica")


def test_base_requests_are_counted_under_the_served_model_name(scaling):
    before = scaling.counter("requests_total", model="fleet-base", finish_reason="length")
    body = {"model": "fleet-base", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{scaling.http}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    wait_for(
        lambda: (
            scaling.counter("requests_total", model="fleet-base", finish_reason="length")
            == before + 1
        ),
        20,
        "the counter of fleet-base",
    )
