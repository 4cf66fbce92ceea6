"""`lorafleet tenants limit` and the limits in `tenants list`, as a real subprocess
against a real redis-server."""

from __future__ import annotations

import json

import pytest

from cluster.registry import Registry
from tests.integration.cluster.test_cli_admin import cli, error_line, ok
from tests.redis_fixture import dump_redis

__all__ = ["cli"]  # the fixture, shared


def test_limit_set_listed_and_removed(cli, registry: Registry):
    registry.create_tenant("acme")
    registry.create_tenant("zeta")
    assert ok(cli("tenants", "limit", "acme", "--requests-per-minute", "600")) == (
        "tenant acme: at most 600 requests per minute\n"
    )
    assert registry.tenant_limit("acme") == 600
    assert ok(cli("tenants", "list")) == ("TENANT  REQUESTS_PER_MINUTE\nacme    600\nzeta    -\n")
    assert json.loads(ok(cli("tenants", "list", "--json"))) == [
        {"tenant": "acme", "requests_per_minute": 600},
        {"tenant": "zeta", "requests_per_minute": 0},
    ]
    assert ok(cli("tenants", "limit", "acme", "--requests-per-minute", "0")) == (
        "tenant acme: no limit of its own (the cluster's default applies)\n"
    )
    assert registry.tenant_limit("acme") == 0


def test_limit_of_an_unknown_tenant_is_an_error(cli, registry: Registry, redis_url):
    before = dump_redis(redis_url)
    assert error_line(cli("tenants", "limit", "ghost", "--requests-per-minute", "5")) == (
        "tenant 'ghost' does not exist; allowed: a tenant that `tenants list` shows "
        "(`tenants create` makes one)"
    )
    assert dump_redis(redis_url) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--requests-per-minute", "-1"), "argument --requests-per-minute: '-1'; allowed: an "
         "integer >= 0"),
        (("--requests-per-minute", "1.5"), "argument --requests-per-minute: '1.5'; allowed"),
        ((), "the following arguments are required: --requests-per-minute"),
    ],
)  # fmt: skip
def test_bad_values_are_usage_errors(cli, registry: Registry, argv, message):
    registry.create_tenant("acme")
    proc = cli("tenants", "limit", "acme", *argv)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert message in proc.stderr.splitlines()[-1]
    assert registry.tenant_limit("acme") == 0
