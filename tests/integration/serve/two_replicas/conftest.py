"""The two-replica cluster's modules share one cluster (a cluster start is the slow part
of these tests): the default app (`cluster_fixture.start_cluster`), stopped once the
package's last test ran. Modules run in name order, which the tests rely on: generation
first (its affinity test reads where the concurrent test left adapters), then tenancy
(admin endpoints register, pin and unload), then upkeep (a Redis outage, last)."""

from __future__ import annotations

import pytest

from tests.integration.serve.cluster_fixture import (
    offline_greedy_texts,
    start_cluster,
    stop_cluster,
)
from tests.integration.serve.two_replicas.calls import MAX_TOKENS, PROMPT


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    stop_cluster(c)


@pytest.fixture(scope="package")
def offline(cluster):
    """model name -> greedy text of PROMPT, from an offline LLMEngine."""
    return offline_greedy_texts(cluster, PROMPT, MAX_TOKENS)
