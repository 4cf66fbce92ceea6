"""Install the cluster's Grafana dashboard where Ray's Grafana provisioning reads it.

Ray's dashboard head (Ray 2.60, dashboard/modules/metrics/metrics_head.py) writes, at
each start, `<metrics root>/grafana/provisioning/dashboards/default.yml`: a file provider
whose `options.path` is the folder of Ray's own dashboards, `<metrics root>/grafana/
dashboards` unless RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR moved it. The metrics root is
`<session>/metrics`, or RAY_METRICS_OUTPUT_ROOT. A Grafana started with the grafana.ini
Ray writes beside them rescans that folder every few seconds, so a file copied there
appears in its "Ray" folder without a restart. Pure file work: no Ray import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from deploy.dashboards import DASHBOARD_JSON

DEFAULT_SESSION_DIR = Path("/tmp/ray/session_latest")
METRICS_ROOT_ENV = "RAY_METRICS_OUTPUT_ROOT"
PROVIDER_CONFIG = Path("grafana/provisioning/dashboards/default.yml")
"""Relative to the metrics root."""
# Ray renders default.yml from a fixed template (dashboard/modules/metrics/templates.py);
# one regex on its `path:` line spares a YAML dependency.
_PATH_LINE = re.compile(r"^\s*path:\s*(\S.*?)\s*$", re.MULTILINE)


def metrics_root(session_dir: Path | None) -> Path:
    """Where Ray's head writes its Prometheus and Grafana configs for this session."""
    if session_dir is not None:
        return session_dir / "metrics"
    env = os.environ.get(METRICS_ROOT_ENV)
    return Path(env) if env else DEFAULT_SESSION_DIR / "metrics"


def provisioned_folder(root: Path) -> Path | None:
    """The dashboards folder Ray's Grafana provider reads, or None when Ray wrote no
    provider config there or its folder is missing."""
    try:
        config = (root / PROVIDER_CONFIG).read_text()
    except OSError:
        return None
    match = _PATH_LINE.search(config)
    folder = Path(match.group(1)) if match else root / "grafana" / "dashboards"
    return folder if folder.is_dir() else None


def install_dashboard(session_dir: Path | None = None) -> Path | None:
    """Copy deploy/dashboards/lorafleet.json into the Grafana dashboards folder of the
    Ray session (default: $RAY_METRICS_OUTPUT_ROOT, else /tmp/ray/session_latest).

    Returns the written file, or None when the session has no such folder: Ray started
    without its dashboard / metrics module, or this is not the head node. Running it
    again rewrites the same file.
    """
    folder = provisioned_folder(metrics_root(session_dir))
    if folder is None:
        return None
    target = folder / DASHBOARD_JSON.name
    # Grafana rescans the folder on its own schedule: write aside, then rename, so it never
    # reads half a file.
    partial = target.with_name(f".{target.name}.partial")
    partial.write_bytes(DASHBOARD_JSON.read_bytes())
    partial.replace(target)
    return target
