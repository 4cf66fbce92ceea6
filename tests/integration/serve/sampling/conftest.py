"""The sampling API's modules share one cluster: one app with one replica (a cluster
start is the slow part of these tests), stopped once the package's last test ran. It has
no reasoning_parser: with one, a chat's structured output starts after the model's
</think> (`router.frontend.Frontend.thinking_first`), which the demo model never writes.
test_reasoning_api.py adds a second app with one for its own tests."""

from __future__ import annotations

import pytest

from tests.integration.serve.cluster_fixture import start_cluster, stop_cluster


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    c = start_cluster(
        tmp_path_factory.mktemp("cluster"),
        num_replicas=1,
        tool_call_parser="hermes",
    )
    yield c
    stop_cluster(c)
