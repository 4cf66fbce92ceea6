"""deploy/dashboards/lorafleet.json: well formed, the rendering of panels.py, naming only
metrics that exist (lorafleet's read from replica/serve_metrics.py's source, Serve's from
the installed Ray's source), every lorafleet metric shown; PromQL checked by promtool."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.dashboards import DASHBOARD_JSON
from deploy.dashboards.render import render

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = json.loads(DASHBOARD_JSON.read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
VARIABLES = DASHBOARD["templating"]["list"]
TARGET_EXPRS = [t["expr"] for p in PANELS for t in p["targets"]]
VARIABLE_QUERIES = [v["definition"] for v in VARIABLES if "definition" in v]
REQUIRED = {"ray_lorafleet_active_adapters"}
"""Shown although replica/serve_metrics.py may not export it yet (added in parallel)."""


def names_in_queries(prefix: str) -> set[str]:
    return set(re.findall(rf"\b{prefix}\w+", " ".join(TARGET_EXPRS + VARIABLE_QUERIES)))


def assigned_names(node: ast.Assign | ast.AnnAssign) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id for t in targets if isinstance(t, ast.Name)]


def lorafleet_exported() -> set[str]:
    """Prometheus names of replica/serve_metrics.py's metrics, read from its source (importing
    it would need Ray): a gauge per GAUGES key, named lorafleet_<key>, and the counters."""
    source = (ROOT / "replica" / "serve_metrics.py").read_text()
    gauges = next(
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign | ast.AnnAssign) and "GAUGES" in assigned_names(node)
    )
    assert re.search(r'Gauge\(\s*f"lorafleet_\{name\}"', source), "gauges not lorafleet_<key>"
    counters = re.findall(r'Counter\(\s*"(lorafleet_\w+)"', source)
    assert len(counters) == 3
    return {f"ray_lorafleet_{name}" for name in gauges} | {
        f"ray_{c}" if c.endswith("_total") else f"ray_{c}_total" for c in counters
    }


def serve_exported() -> list[re.Pattern]:
    """One pattern per metric Ray Serve defines (Gauge/Counter/Histogram in the installed
    ray/serve source, tests left out), matching its Prometheus names: `ray_` + name, a
    counter + `_total` (unless it ends so), a histogram + `_bucket` / `_sum` / `_count`;
    an f-string name's {placeholder} matches any lowercase word."""
    spec = importlib.util.find_spec("ray")  # a top-level spec: found without importing Ray
    assert spec is not None and spec.submodule_search_locations
    serve_dir = Path(next(iter(spec.submodule_search_locations))) / "serve"
    definition = re.compile(r'\b(Gauge|Counter|Histogram)\(\s*(?:name\s*=\s*)?(f?)"(serve_[^"]+)"')
    patterns = []
    for path in serve_dir.rglob("*.py"):
        if "tests" in path.relative_to(serve_dir).parts:
            continue
        for kind, fstring, name in definition.findall(path.read_text()):
            parts = re.split(r"\{[^}]*\}", name) if fstring else [name]
            base = "[a-z0-9_]+".join(re.escape(p) for p in parts)
            suffix = {
                "Gauge": "",
                "Counter": "" if name.endswith("_total") else "_total",
                "Histogram": "(?:_bucket|_sum|_count)",
            }[kind]
            patterns.append(re.compile(f"ray_{base}{suffix}"))
    return patterns


def is_serve_metric(name: str, patterns: list[re.Pattern]) -> bool:
    return any(p.fullmatch(name) for p in patterns)


def test_file_is_the_rendering_of_panels_py():
    assert DASHBOARD_JSON.read_text() == render(), "run: python -m deploy.dashboards.render"


def test_frame_follows_rays_generated_dashboards():
    assert DASHBOARD["schemaVersion"] == 27 and DASHBOARD["uid"] and DASHBOARD["title"]
    datasource = VARIABLES[0]
    assert (datasource["name"], datasource["type"], datasource["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    names = {v["name"] for v in VARIABLES}
    assert {"SessionName", "Cluster"} <= names
    for query in TARGET_EXPRS:
        assert 'SessionName=~"$SessionName"' in query and 'ray_io_cluster=~"$Cluster"' in query


def test_ids_unique_and_every_panel_described_with_queries():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert len(PANELS) >= 15
    for panel in PANELS:
        assert panel["type"] == "timeseries" and panel["title"].strip()
        assert panel["datasource"] == "${datasource}"
        assert panel["description"].strip(), panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_queries_use_only_defined_variables():
    defined = {v["name"] for v in VARIABLES}
    used = set(re.findall(r"\$(\w+)", " ".join(TARGET_EXPRS + VARIABLE_QUERIES)))
    assert used <= defined, used - defined


def test_panels_do_not_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (panel["title"], cells[(x, y)])
                cells[(x, y)] = panel["title"]


def test_lorafleet_metrics_in_queries_are_exported():
    # Fails on ray_lorafleet_active_adapters alone until replica/serve_metrics.py's GAUGES
    # has "active_adapters".
    missing = names_in_queries("ray_lorafleet_") - lorafleet_exported()
    assert not missing, f"not exported by replica/serve_metrics.py: {sorted(missing)}"


def test_every_lorafleet_metric_is_shown():
    unshown = (lorafleet_exported() | REQUIRED) - names_in_queries("ray_lorafleet_")
    assert not unshown, f"no panel shows {sorted(unshown)}"


def test_serve_metrics_in_queries_exist_in_ray_serve():
    patterns = serve_exported()
    used = names_in_queries("ray_serve_")
    assert len(used) >= 10
    unknown = {name for name in used if not is_serve_metric(name, patterns)}
    assert not unknown, f"Ray Serve defines no such metric: {sorted(unknown)}"


@pytest.mark.parametrize(
    "name, exists",
    [
        ("ray_serve_deployment_replica_healthy", True),
        ("ray_serve_num_http_requests_total", True),  # f-string name, counter suffix
        ("ray_serve_http_request_latency_ms_bucket", True),
        ("ray_serve_num_http_requests", False),  # a counter without _total
        ("ray_serve_deployment_replica_healthy_total", False),  # a gauge with it
        ("ray_serve_deployment_processing_latency_ms", False),  # a histogram, bare
        ("ray_serve_num_replicas", False),  # invented
    ],
)
def test_serve_name_check_tells_real_from_invented(name, exists):
    assert is_serve_metric(name, serve_exported()) is exists


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (apt: prometheus) absent")
def test_promql_parses(tmp_path):
    """Every query as a recording rule, the dashboard variables replaced by match-all."""
    rules = [
        {"record": f"lorafleet:check_{i}", "expr": re.sub(r"\$\w+", ".*", expr)}
        for i, expr in enumerate(TARGET_EXPRS)
    ]
    path = tmp_path / "rules.yml"
    # JSON is YAML: no YAML writer needed.
    path.write_text(json.dumps({"groups": [{"name": "lorafleet", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
