"""The dashboard's row of Ray Serve's own metrics (names as Ray 2.60 defines them).

- `ray_serve_deployment_replica_healthy`, `ray_serve_autoscaling_target_replicas`:
  serve/_private/deployment_state.py (the controller, every deployment);
- `ray_serve_autoscaling_desired_replicas`, `ray_serve_autoscaling_total_requests`,
  `ray_serve_autoscaling_target_ongoing_requests`: serve/_private/autoscaling_state.py
  (only for deployments with an autoscaling_config);
- `ray_serve_deployment_queued_queries`: serve/_private/router.py (each handle);
- `ray_serve_deployment_processing_latency_ms`: serve/_private/replica.py;
- `ray_serve_num_{http,grpc}_requests`, `ray_serve_num_{http,grpc}_error_requests`,
  `ray_serve_{http,grpc}_request_latency_ms`: serve/_private/request_ingress_metrics.py
  (the proxies).
"""

from __future__ import annotations

from deploy.dashboards.panels import (
    GRPC,
    HTTP,
    REPLICA_DEPLOYMENT,
    REPLICAS,
    WINDOW,
    Panel,
    Row,
    Target,
    quantile,
    sel,
)

PROTOCOLS = (("http", "HTTP", HTTP), ("grpc", "gRPC", GRPC))
"""(name in the metric, in legends, matcher leaving out Serve's own routes or methods)."""


def _sum_rate(counter: str, matcher: str, by: str = "") -> str:
    """Sum of a proxy counter's per-second rate, per `by` labels ("": one total)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({sel(counter, matcher)}{WINDOW}))"


def _per_app(agg: str, gauge: str) -> str:
    """agg (sum or max) of a LoraReplica gauge per application: `sum` adds up series that
    are parts (one per handle or replica), `max` collapses copies of one value."""
    return f"{agg} by (application) ({sel(gauge, REPLICAS)})"


# Serve refreshes the health gauge only every RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S
# (10 s) while it is unchanged, and in between it is missing from most scrapes: 7 of 30
# in a lorafleet test cluster (RAY_metrics_report_interval_ms=500, 2026-12-04), where
# ray_serve_autoscaling_target_replicas was in all 30. Prometheus marks a series stale
# at the first scrape without it, so the plain gauge would show gaps. Each replica's last
# value within a minute bridges them; a stopped replica's is 0.
HEALTHY = (
    "sum by (application) "
    f"(last_over_time({sel('ray_serve_deployment_replica_healthy', REPLICAS)}[1m]))"
)


SERVE_ROW = Row(
    300,
    "Serve",
    (
        Panel(
            11,
            f"{REPLICA_DEPLOYMENT} replicas: healthy, target, autoscaler decision",
            "Healthy replicas of the LoraReplica deployment "
            "(ray_serve_deployment_replica_healthy, each replica's last report within a "
            "minute: Serve refreshes it only every 10 s), the number Serve is driving it to "
            "(ray_serve_autoscaling_target_replicas: num_replicas, or the autoscaler's "
            "bounded choice) and, with an autoscaling_config, the policy's raw decision "
            "before min/max_replicas (ray_serve_autoscaling_desired_replicas).",
            "short",
            (
                Target(HEALTHY, "healthy {{application}}"),
                Target(
                    _per_app("max", "ray_serve_autoscaling_target_replicas"),
                    "target {{application}}",
                ),
                Target(
                    _per_app("max", "ray_serve_autoscaling_desired_replicas"),
                    "autoscaler decision {{application}}",
                ),
            ),
        ),
        Panel(
            12,
            "Autoscaler input",
            "With an autoscaling_config only: the ongoing requests the autoscaler sees for "
            "LoraReplica (ray_serve_autoscaling_total_requests) and its configured "
            "target_ongoing_requests per replica (ray_serve_autoscaling_target_ongoing_requests); "
            "their quotient is the raw replica count it asks for.",
            "short",
            (
                Target(
                    _per_app("max", "ray_serve_autoscaling_total_requests"),
                    "ongoing requests {{application}}",
                ),
                Target(
                    _per_app("max", "ray_serve_autoscaling_target_ongoing_requests"),
                    "target per replica {{application}}",
                ),
            ),
        ),
        Panel(
            13,
            "Requests queued for a LoraReplica",
            "Requests the ingress holds because no LoraReplica can take them yet "
            "(ray_serve_deployment_queued_queries, summed over handles). Past the deployment's "
            "max_queued_requests, clients get 503 (see the errors panel).",
            "short",
            (
                Target(
                    _per_app("sum", "ray_serve_deployment_queued_queries"),
                    "{{application}}",
                ),
            ),
        ),
        Panel(
            14,
            "End-to-end latency p50 / p99",
            "Request latency measured by Serve's HTTP and gRPC proxies "
            "(ray_serve_http_request_latency_ms, ray_serve_grpc_request_latency_ms): for a "
            "streamed completion, the time to its last token.",
            "ms",
            tuple(
                Target(
                    quantile(q, f"ray_serve_{proto}_request_latency_ms_bucket", "application", m),
                    f"{label} p{round(q * 100)} {{{{application}}}}",
                )
                for proto, label, m in PROTOCOLS
                for q in (0.5, 0.99)
            ),
        ),
        Panel(
            15,
            f"{REPLICA_DEPLOYMENT} processing latency p50 / p99",
            "Time a LoraReplica spends on one call (ray_serve_deployment_processing_latency_ms): "
            "the end-to-end latency without the proxy, the ingress and the wait for a replica.",
            "ms",
            tuple(
                Target(
                    quantile(
                        q,
                        "ray_serve_deployment_processing_latency_ms_bucket",
                        "application",
                        REPLICAS,
                    ),
                    f"p{round(q * 100)} {{{{application}}}}",
                )
                for q in (0.5, 0.99)
            ),
        ),
        Panel(
            16,
            "HTTP and gRPC errors/s by code",
            "Error responses per second by code (ray_serve_num_http_error_requests_total, "
            "ray_serve_num_grpc_error_requests_total); Serve counts every HTTP 4xx and 5xx. "
            "router/errors.py maps lorafleet's: 400 invalid request, 401 bad tenant key, 404 "
            "unknown or forbidden adapter, 429 capacity, 503 backpressure or a draining "
            "adapter, 500 failures; gRPC codes follow the same table.",
            "reqps",
            tuple(
                Target(
                    _sum_rate(f"ray_serve_num_{proto}_error_requests_total", m, "error_code"),
                    f"{label} {{{{error_code}}}}",
                )
                for proto, label, m in PROTOCOLS
            ),
        ),
        Panel(
            17,
            "HTTP and gRPC error ratio",
            "Share of requests answered with an error, per protocol: error responses "
            "(ray_serve_num_{http,grpc}_error_requests_total) over all responses "
            "(ray_serve_num_{http,grpc}_requests_total). Empty while there is no traffic.",
            "percentunit",
            tuple(
                Target(
                    f"{_sum_rate(f'ray_serve_num_{proto}_error_requests_total', m)} / "
                    f"{_sum_rate(f'ray_serve_num_{proto}_requests_total', m)}",
                    label,
                )
                for proto, label, m in PROTOCOLS
            ),
            max=1.0,
        ),
    ),
)
