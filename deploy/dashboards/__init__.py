"""The cluster's Grafana dashboard.

panels.py says what it shows, render.py lays it out as Grafana JSON, and lorafleet.json
is the rendered file (committed, so it can be imported by hand into any Grafana).
After editing panels.py: `PYTHONPATH=$PWD python -m deploy.dashboards.render`.
"""

from pathlib import Path

DASHBOARD_JSON = Path(__file__).parent / "lorafleet.json"
