"""install_dashboard against the folders a real Ray head writes (Ray with its dashboard,
hence its metrics module, in a temp dir of its own: ~10 s on 2 CPUs)."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import ray

from deploy.dashboard import PROVIDER_CONFIG, install_dashboard
from deploy.dashboards import DASHBOARD_JSON
from deploy.local_redis import free_port

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


def wait_for(path: Path, timeout_s: float = 30.0) -> None:
    """The dashboard head writes Grafana's configs a few seconds after ray.init returns."""
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert time.monotonic() < deadline, f"Ray wrote no {path}"
        time.sleep(0.2)


def test_installs_beside_rays_own_dashboards(ray_session):
    provider = ray_session / "metrics" / PROVIDER_CONFIG
    wait_for(provider)
    folder = Path(re.search(r"path:\s*(\S+)", provider.read_text()).group(1))
    wait_for(folder / "serve_grafana_dashboard.json")

    written = install_dashboard(ray_session)
    assert written is not None and written.parent.resolve() == folder.resolve()
    assert written.read_bytes() == DASHBOARD_JSON.read_bytes()
    assert install_dashboard(ray_session) == written
