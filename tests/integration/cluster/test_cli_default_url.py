"""The admin CLI on its default URL (no --redis-url, no LORAFLEET_REDIS_URL) says when no
cluster serves from that registry: a cluster without redis_url has its local Redis on a
port picked at start, and a Redis on the default port (a system redis-server) read or
wrote the wrong registry without a word."""

from __future__ import annotations

import pytest

from cluster.cli import common
from cluster.cli.__main__ import main
from cluster.records import ServedBase
from cluster.registry import Registry
from lora_core.base_shape import BaseShape
from tests.redis_fixture import free_port

SHAPE = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate=128)  # fmt: skip
NOTE = (
    "lorafleet: note: no cluster serves from the default registry {url} (namespace t); "
    '`serve run` prints its registry\'s URL at start ("lorafleet: local registry at ..."): '
    "pass it as --redis-url or LORAFLEET_REDIS_URL\n"
)


@pytest.fixture
def default_url(monkeypatch: pytest.MonkeyPatch):
    """Points the CLI's default URL at url (the real one is 6379, not the test's)."""
    monkeypatch.delenv("LORAFLEET_REDIS_URL", raising=False)
    monkeypatch.setenv("LORAFLEET_NAMESPACE", "t")

    def point(url: str) -> None:
        monkeypatch.setattr(common, "DEFAULT_URL", url)

    return point


def test_a_registry_no_cluster_serves_from_gets_a_note(default_url, redis_url, capsys):
    default_url(redis_url)
    assert main(["tenants", "list"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("TENANT  REQUESTS_PER_MINUTE\n", NOTE.format(url=redis_url))
    # a URL given (not the default) is the registry asked for, cluster or not
    default_url(f"redis://127.0.0.1:{free_port()}/0")
    assert main(["tenants", "list", "--redis-url", redis_url]) == 0
    assert capsys.readouterr() == ("TENANT  REQUESTS_PER_MINUTE\n", "")


def test_a_registry_a_cluster_serves_from_gets_none(default_url, redis_url, capsys):
    registry = Registry(redis_url, "t")
    registry.set_served(ServedBase("tiny", SHAPE, max_lora_rank=16))
    registry.close()
    default_url(redis_url)
    assert main(["tenants", "list"]) == 0
    assert capsys.readouterr() == ("TENANT  REQUESTS_PER_MINUTE\n", "")


def test_an_unreachable_default_says_where_the_url_is(default_url, capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"
    default_url(url)
    assert main(["status"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"lorafleet: error: cannot reach Redis at {url}: ")
    assert line.endswith(
        " (the default URL; `serve run` prints its registry's URL at start (\"lorafleet: "
        'local registry at ..."): pass it as --redis-url or LORAFLEET_REDIS_URL)'
    )
