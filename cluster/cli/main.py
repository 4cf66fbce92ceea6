"""Admin verbs of the `lorafleet` CLI (registered into deploy/cli.py's parser).

    lorafleet adapters register NAME PATH [--base-model ID] [--tenant T]
        [--public | --private] [--replace]
    lorafleet adapters list | show NAME | unregister NAME
    lorafleet adapters pin NAME [--pool P] | unpin NAME | warm NAME --replicas N [--pool P]
    lorafleet replicas list | reap
    lorafleet tenants create NAME | delete NAME | list | grant NAME ADAPTER | revoke NAME ADAPTER
    lorafleet tenants key NAME | keys NAME | revoke-key NAME (KEY_ID | --all)
    lorafleet tenants limit NAME --requests-per-minute N
    lorafleet status

Every verb takes --redis-url (env LORAFLEET_REDIS_URL, default redis://127.0.0.1:6379/0),
--namespace (env LORAFLEET_NAMESPACE, default lorafleet) and --redis-timeout (env
LORAFLEET_REDIS_TIMEOUT, default 3: the seconds one Redis command may take, retries
included); an empty variable counts as unset. Listings, `adapters register` and
`tenants key` take --json.
Exit codes: 0 success, 1 error (one line on stderr), 2 usage error (argparse), 130
interrupted (Ctrl-C), 141 stdout closed before the output was written (`| head`; nothing
on stderr).
"""

from __future__ import annotations

import argparse

from cluster.cli import adapters, replicas, tenants


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Add the admin subcommands (adapters, replicas, tenants, status). Each sets `func`."""
    adapters.register(sub)
    replicas.register(sub)
    tenants.register(sub)
