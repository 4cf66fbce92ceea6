"""Install the cluster's Grafana dashboard where Ray's Grafana provisioning reads it.

Ray's dashboard head (Ray 2.60, dashboard/modules/metrics/metrics_head.py) writes, at
each start, `<metrics root>/grafana/provisioning/dashboards/default.yml`: a file provider
whose `options.path` is the folder of Ray's own dashboards, `<metrics root>/grafana/
dashboards` unless RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR moved it. The metrics root is
`<session>/metrics`, or RAY_METRICS_OUTPUT_ROOT. A Grafana started with the grafana.ini
Ray writes beside them rescans that folder every few seconds, so a file copied there
appears in its "Ray" folder without a restart. File work: Ray is never imported here,
only asked for its session folder when this process already runs it.
"""

from __future__ import annotations

import os
import re
import sys
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
    """Where Ray's head writes its Prometheus and Grafana configs for this session: the
    given session's, else $RAY_METRICS_OUTPUT_ROOT, else the session of the Ray this
    process is connected to, else /tmp/ray/session_latest."""
    if session_dir is not None:
        return session_dir / "metrics"
    env = os.environ.get(METRICS_ROOT_ENV)
    if env:
        return Path(env)
    return (connected_session() or DEFAULT_SESSION_DIR) / "metrics"


def connected_session() -> Path | None:
    """The session folder of the Ray cluster this process is connected to, or None.
    session_latest is the host's newest session: another cluster's when this one has its
    own temp dir, or another one started after it."""
    ray = sys.modules.get("ray")  # not imported: this process runs no Ray
    if ray is None or not ray.is_initialized():
        return None
    # Ray's own libraries (ray.train) read the session folder the same way
    node = ray._private.worker._global_node
    return Path(node.get_session_dir_path()) if node is not None else None


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
    Ray session (default: `metrics_root`'s: $RAY_METRICS_OUTPUT_ROOT, else the connected
    Ray's session, else /tmp/ray/session_latest).

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
