"""`tenants key / keys / revoke-key` through the CLI's main() against a real redis-server."""

from __future__ import annotations

import json

import pytest

from cluster.cli.__main__ import main
from cluster.records import key_id
from cluster.registry import Registry, hash_key
from tests.redis_fixture import dump_redis


@pytest.fixture
def cli(redis_url: str, capsys, monkeypatch):
    """cli(*argv) -> (rc, stdout, stderr) of main() on the test Redis (namespace "t")."""
    monkeypatch.setenv("LORAFLEET_NAMESPACE", "t")
    monkeypatch.setenv("LORAFLEET_REDIS_URL", redis_url)

    def run(*argv: str) -> tuple[int, str, str]:
        rc = main(list(argv))
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


@pytest.fixture
def acme(registry: Registry) -> Registry:
    registry.create_tenant("acme")
    return registry


def test_key_prints_key_on_stdout_and_id_on_stderr(cli, acme: Registry):
    rc, out, err = cli("tenants", "key", "acme")
    key = out.strip()
    kid = key_id(hash_key(key))
    assert (rc, out, acme.resolve_key(key)) == (0, key + "\n", "acme")
    assert err == f"key id {kid} (revoke: lorafleet tenants revoke-key acme {kid})\n"
    rc, out, err = cli("tenants", "key", "acme", "--json")
    got = json.loads(out)
    assert (rc, err, sorted(got)) == (0, "", ["key", "key_id", "tenant"])
    assert (got["tenant"], got["key_id"]) == ("acme", key_id(hash_key(got["key"])))


def test_keys_lists_ids_and_times(cli, acme: Registry):
    assert cli("tenants", "keys", "acme") == (0, "KEY_ID  CREATED\n", "")
    keys = [acme.issue_api_key("acme") for _ in range(2)]
    listed = acme.list_api_keys("acme")
    rc, out, _ = cli("tenants", "keys", "acme", "--json")
    assert rc == 0 and json.loads(out) == [k.to_json() for k in listed]
    assert {k.key_id for k in listed} == {key_id(hash_key(k)) for k in keys}
    rc, out, _ = cli("tenants", "keys", "acme")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == [k.key_id for k in listed]
    assert all(len(r) == 3 and r[2].endswith("Z") for r in rows)  # date, time


def test_revoke_key_by_id_prefix_and_all(cli, acme: Registry):
    k1, k2, k3 = (acme.issue_api_key("acme") for _ in range(3))
    id1 = key_id(hash_key(k1))
    assert cli("tenants", "revoke-key", "acme", id1[:8]) == (0, f"revoked key {id1} of acme\n", "")
    assert acme.resolve_key(k1) is None and acme.resolve_key(k2) == "acme"
    rc, out, err = cli("tenants", "revoke-key", "acme", "--all")
    ids = ", ".join(sorted(key_id(hash_key(k)) for k in (k2, k3)))
    assert (rc, out, err) == (0, f"revoked 2 keys of acme: {ids}\n", "")
    assert acme.resolve_key(k2) is None and acme.resolve_key(k3) is None
    assert cli("tenants", "revoke-key", "acme", "--all") == (0, "revoked 0 keys of acme\n", "")


@pytest.mark.parametrize(
    "argv,message",
    [
        (("revoke-key", "acme", "0123456789ab"),
         "tenant 'acme' has no key with id '0123456789ab'; allowed: an id listed by "
         "`tenants keys acme`"),
        (("revoke-key", "acme", "lf-abc"), "key id 'lf-abc' is invalid; allowed: 6-64 hex"),
        (("revoke-key", "ghost", "--all"), "tenant 'ghost' does not exist"),
        (("keys", "ghost"), "tenant 'ghost' does not exist"),
    ],
)  # fmt: skip
def test_errors_exit_1_with_one_line(cli, acme: Registry, redis_url, argv, message: str):
    acme.issue_api_key("acme")
    before = dump_redis(redis_url)
    rc, out, err = cli("tenants", *argv)
    assert (rc, out) == (1, "")
    assert err.startswith("lorafleet: error: " + message) and err.count("\n") == 1
    assert dump_redis(redis_url) == before


@pytest.mark.parametrize("argv", [("acme",), ("acme", "0123456789ab", "--all")])
def test_revoke_key_needs_exactly_one_of_id_and_all(cli, argv):
    with pytest.raises(SystemExit) as info:
        cli("tenants", "revoke-key", *argv)
    assert info.value.code == 2


def test_empty_redis_url_env_counts_as_unset(cli, acme: Registry, redis_url, monkeypatch):
    monkeypatch.setenv("LORAFLEET_REDIS_URL", "")
    assert cli("tenants", "list", "--redis-url", redis_url) == (
        0,
        "TENANT  REQUESTS_PER_MINUTE\nacme    -\n",
        "",
    )
    monkeypatch.setattr("cluster.cli.common.DEFAULT_URL", redis_url)  # the default Redis
    code, out, err = cli("tenants", "list")
    assert (code, out) == (0, "TENANT  REQUESTS_PER_MINUTE\nacme    -\n")
    # the default it used, where no cluster serves (test_cli_default_url.py)
    assert err.startswith(
        f"lorafleet: note: no cluster serves from the default registry {redis_url} "
    )
