"""Render the panels as Grafana dashboard JSON: `python -m deploy.dashboards.render`
rewrites lorafleet.json (a unit test fails while the file and the panels disagree).

The frame follows Ray 2.60's generated dashboards (ray/dashboard/modules/metrics/
dashboards/*_base.json and grafana_dashboard_factory.py): schemaVersion 27, the
`datasource` variable of type prometheus that every panel and query names as
`${datasource}`, the SessionName and Cluster variables of Ray's default dashboard, rows
with panels two per line, 12 wide and 8 high. Panels are `timeseries`, not the legacy
`graph` Ray still emits, which Grafana 11 no longer ships and converts on load.
"""

from __future__ import annotations

import json

from deploy.dashboards import DASHBOARD_JSON
from deploy.dashboards.panels import (
    MODEL_ROW,
    REPLICA_ROW,
    REPLICAS,
    SCOPE,
    SESSION,
    Panel,
    Row,
)
from deploy.dashboards.serve_panels import SERVE_ROW

ROWS = (MODEL_ROW, REPLICA_ROW, SERVE_ROW)
UID = "lorafleetDashboard"
DATASOURCE = "${datasource}"
WIDTH, HEIGHT, PER_LINE = 12, 8, 2
"""Panel size in Grafana's 24-column grid, as Ray's dashboard factory lays them out."""


def _query_variable(name: str, query: str, description: str, **overrides: object) -> dict:
    """A variable filled by a label_values() query: "All" (any value) by default."""
    variable = {
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": DATASOURCE,
        "definition": query,
        "description": description,
        "hide": 0,
        "includeAll": True,
        "multi": True,
        "name": name,
        "options": [],
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }
    variable.update(overrides)
    return variable


def variables() -> list[dict]:
    """datasource, SessionName and Cluster as in Ray's default dashboard, then the
    application, replica and model filters of this one."""
    session, scope = ",".join(SESSION), ",".join(SCOPE)
    return [
        {
            "current": {"selected": False},
            "description": "Filter queries of a specific Prometheus type.",
            "hide": 2,
            "includeAll": False,
            "multi": False,
            "name": "datasource",
            "options": [],
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "skipUrlSync": False,
            "type": "datasource",
        },
        # Sorted newest first and single-valued, so a Prometheus that outlived several Ray
        # sessions shows the current one.
        _query_variable(
            "SessionName",
            "label_values(ray_node_network_receive_speed{}, SessionName)",
            "Filter queries to specific Ray sessions.",
            allValue=".+",
            current={"selected": False},
            multi=False,
            sort=2,
        ),
        _query_variable(
            "Cluster",
            "label_values(ray_node_network_receive_speed{}, ray_io_cluster)",
            "Filter queries to specific Ray clusters for KubeRay (the ray_io_cluster label).",
            current={"selected": False},
            multi=False,
            sort=2,
        ),
        _query_variable(
            "Application",
            # Serve sets this gauge for every deployment, autoscaled or not, and unlike
            # the health gauge it is in every scrape (serve_panels.py, HEALTHY).
            f"label_values(ray_serve_autoscaling_target_replicas{{{session},{REPLICAS}}}, "
            "application)",
            "Serve applications with a LoraReplica deployment.",
        ),
        _query_variable(
            "Replica",
            f"label_values(ray_lorafleet_queue_len{{{scope},{REPLICAS}}}, replica)",
            "LoraReplica replicas (per-replica panels).",
        ),
        _query_variable(
            "Model",
            f"label_values(ray_lorafleet_requests_total{{{scope}}}, model)",
            "Models: adapter names, the base model's, and (other): adapters past each "
            "replica's cap of named ones (per-model panels).",
        ),
    ]


def panel_json(panel: Panel, x: int, y: int) -> dict:
    """One timeseries panel at grid position (x, y)."""
    defaults: dict = {
        "unit": panel.unit,
        "min": 0,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": True,
        },
    }
    if panel.max is not None:
        defaults["max"] = panel.max
    return {
        "datasource": DATASOURCE,
        "description": panel.description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y},
        "id": panel.id,
        "options": {
            # Ray's graph panels show a table legend with avg / current / max, newest first.
            "legend": {
                "calcs": ["mean", "lastNotNull", "max"],
                "displayMode": "table",
                "placement": "bottom",
                "sortBy": "Last *",
                "sortDesc": True,
            },
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {"expr": t.expr, "legendFormat": t.legend, "refId": chr(ord("A") + i)}
            for i, t in enumerate(panel.targets)
        ],
        "title": panel.title,
        "type": "timeseries",
    }


def layout(rows: tuple[Row, ...]) -> list[dict]:
    """Grafana's flat panel list: each row header, then its panels two per line."""
    out: list[dict] = []
    y = 0
    for row in rows:
        out.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": 2 * WIDTH, "x": 0, "y": y},
                "id": row.id,
                "panels": [],
                "title": row.title,
                "type": "row",
            }
        )
        y += 1
        for i, panel in enumerate(row.panels):
            out.append(panel_json(panel, WIDTH * (i % PER_LINE), y + HEIGHT * (i // PER_LINE)))
        y += HEIGHT * -(-len(row.panels) // PER_LINE)
    return out


def build_dashboard() -> dict:
    """The whole dashboard, as Grafana's JSON model."""
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": "-- Grafana --",
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "lorafleet: traffic per model, adapter residency per replica, Serve.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": layout(ROWS),
        "refresh": False,
        "schemaVersion": 27,
        "style": "dark",
        "tags": ["lorafleet"],
        "templating": {"list": variables()},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "lorafleet",
        "uid": UID,
        "version": 1,
    }


def render() -> str:
    """lorafleet.json's text."""
    return json.dumps(build_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    DASHBOARD_JSON.write_text(render())
    print(f"wrote {DASHBOARD_JSON}")
