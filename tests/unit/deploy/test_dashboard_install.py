"""deploy.dashboard.install_dashboard on session folders laid out as Ray 2.60's head lays
them out (dashboard/modules/metrics/metrics_head.py, _create_default_grafana_configs)."""

from __future__ import annotations

from pathlib import Path

import pytest

import deploy.dashboard as dashboard
from deploy.dashboard import install_dashboard
from deploy.dashboards import DASHBOARD_JSON

# Ray 2.60's DASHBOARD_PROVISIONING_TEMPLATE (dashboard/modules/metrics/templates.py).
PROVIDER = """
apiVersion: 1

providers:
  - name: Ray    # Default dashboards provided by OSS Ray
    folder: Ray
    type: file
    options:
      path: {dashboard_output_folder}
"""


def ray_session(session: Path, dashboards: Path | None = None) -> Path:
    """A session folder as Ray's head leaves it; returns the dashboards folder."""
    grafana = session / "metrics" / "grafana"
    folder = dashboards or grafana / "dashboards"
    folder.mkdir(parents=True)
    (folder / "serve_grafana_dashboard.json").write_text("{}")
    provisioning = grafana / "provisioning"
    (provisioning / "datasources").mkdir(parents=True)
    (provisioning / "dashboards").mkdir()
    (provisioning / "dashboards" / "default.yml").write_text(
        PROVIDER.format(dashboard_output_folder=folder)
    )
    (grafana / "grafana.ini").write_text("[paths]\n")
    return folder


def test_writes_into_the_provisioned_folder_and_is_idempotent(tmp_path):
    folder = ray_session(tmp_path / "session_x")
    written = install_dashboard(tmp_path / "session_x")
    assert written == folder / "lorafleet.json"
    assert written.read_bytes() == DASHBOARD_JSON.read_bytes()
    assert install_dashboard(tmp_path / "session_x") == written
    assert written.read_bytes() == DASHBOARD_JSON.read_bytes()
    # Ray's own dashboards stay, and no partial file is left for Grafana to find.
    assert sorted(p.name for p in folder.iterdir()) == [
        "lorafleet.json",
        "serve_grafana_dashboard.json",
    ]


def test_follows_a_provider_pointing_elsewhere(tmp_path):
    """RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR moves Ray's dashboards out of the session."""
    elsewhere = tmp_path / "shared" / "dashboards"
    ray_session(tmp_path / "session_x", dashboards=elsewhere)
    assert install_dashboard(tmp_path / "session_x") == elsewhere / "lorafleet.json"
    assert not (tmp_path / "session_x" / "metrics" / "grafana" / "dashboards").exists()


@pytest.mark.parametrize("leave_out", ["metrics", "provider", "dashboards"])
def test_none_without_rays_grafana_folders(tmp_path, leave_out):
    session = tmp_path / "session_x"
    folder = ray_session(session)
    grafana = session / "metrics" / "grafana"
    if leave_out == "metrics":
        for path in sorted(session.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
    elif leave_out == "provider":
        (grafana / "provisioning" / "dashboards" / "default.yml").unlink()
    else:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    before = sorted(session.rglob("*"))
    assert install_dashboard(session) is None
    assert sorted(session.rglob("*")) == before


def test_none_for_a_missing_session(tmp_path):
    assert install_dashboard(tmp_path / "no_such_session") is None


def test_default_session_and_metrics_root_override(tmp_path, monkeypatch):
    monkeypatch.delenv(dashboard.METRICS_ROOT_ENV, raising=False)
    monkeypatch.setattr(dashboard, "DEFAULT_SESSION_DIR", tmp_path / "session_latest")
    folder = ray_session(tmp_path / "session_latest")
    assert install_dashboard() == folder / "lorafleet.json"

    # RAY_METRICS_OUTPUT_ROOT puts the whole metrics root outside the session.
    other = ray_session(tmp_path / "root_parent")
    monkeypatch.setenv(dashboard.METRICS_ROOT_ENV, str(tmp_path / "root_parent" / "metrics"))
    assert install_dashboard() == other / "lorafleet.json"
