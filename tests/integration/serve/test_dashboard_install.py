"""install_dashboard against the folders a real Ray head writes (Ray with its dashboard,
hence its metrics module, in a temp dir of its own: ~10 s on 2 CPUs)."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest
import ray

import deploy.dashboard as dashboard
from deploy.dashboard import PROVIDER_CONFIG, install_dashboard
from deploy.dashboards import DASHBOARD_JSON
from deploy.local_redis import free_port
from tests.polling import wait_for
from tests.unit.deploy.test_dashboard_install import ray_session as ray_session_of

pytestmark = pytest.mark.integration


@pytest.fixture
def ray_session():
    """The session folder of a fresh local Ray started with its dashboard."""
    if ray.is_initialized():  # a previous module's Ray: this test needs its own options
        ray.shutdown()
    # Short, so Ray's socket paths under it stay within the unix-socket length limit.
    temp = Path(tempfile.mkdtemp(prefix="lfdash", dir="/tmp"))
    ray.init(
        num_cpus=1,
        include_dashboard=True,
        dashboard_port=free_port(),
        log_to_driver=False,
        _temp_dir=str(temp),
    )
    try:
        yield temp / "session_latest"
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def wait_written(path: Path) -> None:
    """The dashboard head writes Grafana's configs a few seconds after ray.init returns."""
    wait_for(path.is_file, 30, f"Ray writing {path}", interval_s=0.2)


def test_installs_beside_rays_own_dashboards(ray_session):
    provider = ray_session / "metrics" / PROVIDER_CONFIG
    wait_written(provider)
    folder = Path(re.search(r"path:\s*(\S+)", provider.read_text()).group(1))
    wait_written(folder / "serve_grafana_dashboard.json")

    written = install_dashboard(ray_session)
    assert written is not None and written.parent.resolve() == folder.resolve()
    assert written.read_bytes() == DASHBOARD_JSON.read_bytes()
    assert install_dashboard(ray_session) == written


def test_without_a_session_it_takes_the_connected_clusters(ray_session, monkeypatch, tmp_path):
    # build_app names no session. /tmp/ray/session_latest is the host's newest Ray session:
    # another cluster's when this one runs under its own temp dir, or another started
    # after it (the dashboard went into a neighbour's Grafana, and this one had none).
    monkeypatch.delenv(dashboard.METRICS_ROOT_ENV, raising=False)
    # the host's "latest" session, kept off the real /tmp/ray
    monkeypatch.setattr(dashboard, "DEFAULT_SESSION_DIR", tmp_path / "host_latest")
    elsewhere = ray_session_of(tmp_path / "host_latest")
    provider = ray_session / "metrics" / PROVIDER_CONFIG
    wait_written(provider)
    folder = Path(re.search(r"path:\s*(\S+)", provider.read_text()).group(1))

    written = install_dashboard()
    assert written is not None and written.parent.resolve() == folder.resolve()
    assert not (elsewhere / DASHBOARD_JSON.name).exists()
