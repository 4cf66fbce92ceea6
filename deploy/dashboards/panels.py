"""The lorafleet dashboard's panels as data, and its two rows of lorafleet's own metrics.

Built the way Ray builds its own dashboards (ray/dashboard/modules/metrics/dashboards/
*_panels.py): panels are data, render.py lays them out; serve_panels.py holds the row of
Serve's metrics. Metric names are Prometheus names: Ray prefixes every metric with `ray_`,
a counter gets `_total` unless its name ends with it, a histogram is `_bucket` / `_sum` /
`_count`. lorafleet's own come from replica/serve_metrics.py: per-model counters and
per-replica gauges, which Serve tags with `deployment`, `replica` and `application`.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLICA_DEPLOYMENT = "LoraReplica"
"""The Serve deployment name of replica/deployment.py (and of the multiplexed baseline)."""

SESSION = ('SessionName=~"$SessionName"', 'ray_io_cluster=~"$Cluster"')
"""The session and cluster variables' matchers, as in Ray's default dashboard."""
SCOPE = (*SESSION, 'application=~"$Application"')
"""Matchers every query carries."""

REPLICAS = f'deployment="{REPLICA_DEPLOYMENT}"'
PER_REPLICA = (REPLICAS, 'replica=~"$Replica"')
MODELS = 'model=~"$Model"'
FAILED = 'finish_reason=~"error|abort"'
HTTP = 'route!~"/-/.*"'
"""Leaves out Serve's own endpoints (/-/healthz, /-/routes), as Ray's Serve dashboard does."""
GRPC = r'method!~"/ray\\.serve\\.RayServeAPIService/.*"'
OTHER = (
    " Each replica names the first 100 models it served (its default cap) and counts "
    'requests for later adapters under model="(other)": a big fleet\'s long tail shows '
    "there, and an adapter may be split between its name (on replicas that served it "
    "early) and (other)."
)
"""Appended to the per-model panels' descriptions (replica/serve_metrics.ModelLabels)."""
WINDOW = "[5m]"
"""Range of every rate(), the one Ray's dashboards use."""


@dataclass(frozen=True)
class Target:
    """One query of a panel."""

    expr: str
    """PromQL."""
    legend: str
    """Grafana legend format ({{label}} expands to the series' label)."""


@dataclass(frozen=True)
class Panel:
    """One timeseries panel."""

    id: int
    """Unique among all panels and rows of the dashboard."""
    title: str
    description: str
    """Shown as the panel's (i) tooltip: what it measures and how to read it."""
    unit: str
    """A Grafana unit id (reqps, ms, percentunit, short, ...)."""
    targets: tuple[Target, ...]
    max: float | None = None
    """Upper end of the y axis (None: fit the data)."""


@dataclass(frozen=True)
class Row:
    """A titled row of panels (laid out two per line)."""

    id: int
    title: str
    panels: tuple[Panel, ...]


def sel(metric: str, *matchers: str) -> str:
    """metric{the SCOPE matchers, then matchers}."""
    return metric + "{" + ",".join((*SCOPE, *matchers)) + "}"


def per_replica(metric: str) -> str:
    """One series per LoraReplica replica (summing drops Ray's worker/node labels)."""
    return f"sum by (replica) ({sel(metric, *PER_REPLICA)})"


def quantile(q: float, bucket: str, by: str, *matchers: str) -> str:
    """The q-quantile of a Ray histogram over WINDOW, per `by` labels."""
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({sel(bucket, *matchers)}{WINDOW})))"


MODEL_ROW = Row(
    100,
    "Traffic by model",
    (
        Panel(
            1,
            "Requests/s by model and finish reason",
            "Requests ended per second, per model (the adapter's name, or the base model's) "
            "and finish reason: stop, length, abort (the client left) or error. Counted by the "
            "replica as each request ends (ray_lorafleet_requests_total)." + OTHER,
            "reqps",
            (
                Target(
                    f"sum by (model, finish_reason) "
                    f"(rate({sel('ray_lorafleet_requests_total', MODELS)}{WINDOW}))",
                    "{{model}} {{finish_reason}}",
                ),
            ),
        ),
        Panel(
            2,
            "Failed requests/s by model",
            "The error and abort part of the panel beside it, on its own scale: error is a "
            "failure inside the replica (its log says which), abort a client that left before "
            "the end (timeouts, cancelled streams)." + OTHER,
            "reqps",
            (
                Target(
                    f"sum by (model, finish_reason) "
                    f"(rate({sel('ray_lorafleet_requests_total', MODELS, FAILED)}{WINDOW}))",
                    "{{model}} {{finish_reason}}",
                ),
            ),
        ),
        Panel(
            3,
            "Prompt tokens/s by model",
            "Prompt tokens of ended requests per second, per model "
            "(ray_lorafleet_prompt_tokens_total): the prefill load each tenant brings." + OTHER,
            "short",
            (
                Target(
                    f"sum by (model) (rate({sel('ray_lorafleet_prompt_tokens_total', MODELS)}"
                    f"{WINDOW}))",
                    "{{model}}",
                ),
            ),
        ),
        Panel(
            4,
            "Generated tokens/s by model",
            "Tokens generated per second, per model (ray_lorafleet_generated_tokens_total), "
            "counted when each request ends: the decode load each tenant brings." + OTHER,
            "short",
            (
                Target(
                    f"sum by (model) (rate({sel('ray_lorafleet_generated_tokens_total', MODELS)}"
                    f"{WINDOW}))",
                    "{{model}}",
                ),
            ),
        ),
    ),
)

REPLICA_ROW = Row(
    200,
    "LoraReplica replicas",
    (
        Panel(
            5,
            "Engine queue per replica",
            "Requests running + waiting in each replica's engine (ray_lorafleet_queue_len); "
            "the LoRA-affinity router skips a replica whose queue reaches overload_queue_len. "
            "Updated each time Serve polls routing stats.",
            "short",
            (Target(per_replica("ray_lorafleet_queue_len"), "{{replica}}"),),
        ),
        Panel(
            6,
            "KV cache usage per replica",
            "Fraction of each replica's KV cache blocks in use (ray_lorafleet_kv_usage). Near "
            "100% new requests wait for blocks to free, whatever their adapter.",
            "percentunit",
            (Target(per_replica("ray_lorafleet_kv_usage"), "{{replica}}"),),
            max=1.0,
        ),
        Panel(
            7,
            "GPU adapter slots per replica",
            "Adapters resident in GPU slots (ray_lorafleet_gpu_adapters) and slots holding "
            "nothing (ray_lorafleet_free_slots); together they are the replica's max_loras.",
            "short",
            (
                Target(per_replica("ray_lorafleet_gpu_adapters"), "{{replica}} resident"),
                Target(per_replica("ray_lorafleet_free_slots"), "{{replica}} free"),
            ),
        ),
        Panel(
            8,
            "Adapters in flight per replica",
            "Distinct adapters among each replica's running + waiting requests "
            "(ray_lorafleet_active_adapters), beside its GPU slot count (resident + free). "
            "Above the slot count, requests wait for slot swaps: route fewer tenants to it "
            "or raise max_loras.",
            "short",
            (
                Target(per_replica("ray_lorafleet_active_adapters"), "{{replica}} active"),
                Target(
                    f"{per_replica('ray_lorafleet_gpu_adapters')} + "
                    f"{per_replica('ray_lorafleet_free_slots')}",
                    "{{replica}} GPU slots",
                ),
            ),
        ),
        Panel(
            9,
            "Adapters in the CPU cache per replica",
            "Adapters held in each replica's CPU cache (ray_lorafleet_cpu_adapters): a slot "
            "load from there skips the disk read.",
            "short",
            (Target(per_replica("ray_lorafleet_cpu_adapters"), "{{replica}}"),),
        ),
        Panel(
            10,
            "Adapter slot loads/s per replica",
            "Adapters loaded into GPU slots per second. ray_lorafleet_adapter_loads is a "
            "gauge holding a count that only grows (loads since the replica started), so "
            "rate() is the right function: it measures the increase as for a counter and "
            "takes a drop to 0 (the engine restarted under the same tags) as a reset, where "
            "deriv(), a least-squares slope meant for gauges that go both ways, would report "
            "a large negative rate. A steady high rate means slot thrashing.",
            "short",
            (
                Target(
                    f"sum by (replica) (rate({sel('ray_lorafleet_adapter_loads', *PER_REPLICA)}"
                    f"{WINDOW}))",
                    "{{replica}}",
                ),
            ),
        ),
        Panel(
            20,
            "Tokens/s per replica: computed and prefix-cache hits",
            "Tokens per second each replica ran through the model (ray_lorafleet_computed_tokens: "
            "prompt tokens computed and one per sequence per decode step) beside the prompt "
            "tokens it took from its prefix cache instead of computing them "
            "(ray_lorafleet_prefix_hit_tokens). Both are growing counts: rate() as for adapter "
            "loads. Blocks are shared only under the same adapter version; the choices of one "
            "request and requests with one system prompt hit here.",
            "short",
            (
                Target(
                    f"sum by (replica) (rate({sel('ray_lorafleet_computed_tokens', *PER_REPLICA)}"
                    f"{WINDOW}))",
                    "computed {{replica}}",
                ),
                Target(
                    f"sum by (replica) (rate({sel('ray_lorafleet_prefix_hit_tokens', *PER_REPLICA)}"
                    f"{WINDOW}))",
                    "cache hits {{replica}}",
                ),
            ),
        ),
    ),
)
