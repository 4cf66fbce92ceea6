"""`lorafleet replicas list` and `lorafleet status`."""

from __future__ import annotations

import argparse

from cluster.cli.common import add_verb, print_json, print_table
from cluster.registry import Registry


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("replicas", help="inspect serving replicas")
    verbs = parser.add_subparsers(dest="verb", required=True)
    add_verb(verbs, "list", _list, "list replicas, their pools, leases and residency", listing=True)
    add_verb(verbs, "reap", _reap, "forget lapsed replicas; finish drained adapters",
             listing=False)  # fmt: skip
    add_verb(sub, "status", _status, "cluster-wide counts", listing=True)


def _list(reg: Registry, args: argparse.Namespace) -> int:
    infos = reg.list_replicas()
    if args.json:
        print_json([r.to_json() for r in infos])
        return 0
    rows = [
        (
            r.replica_id,
            r.pool,
            r.deployment,
            r.slot_capacity,
            r.epoch,
            "yes" if r.live else "no",
            r.gpu_adapters,
            r.cpu_adapters,
        )
        for r in infos
    ]
    print_table(("REPLICA", "POOL", "DEPLOYMENT", "SLOTS", "EPOCH", "LIVE", "GPU", "CPU"), rows)
    return 0


def _reap(reg: Registry, args: argparse.Namespace) -> int:
    replicas, adapters = reg.reap()
    print(f"removed {replicas} lapsed replicas and {adapters} drained adapters")
    return 0


def _status(reg: Registry, args: argparse.Namespace) -> int:
    st = reg.status()
    if args.json:
        print_json(st.to_json())
        return 0
    live = ", ".join(f"{pool} {n}" for pool, n in st.replicas_live.items())
    print_table(
        ("ITEM", "VALUE"),
        [
            ("adapters", st.adapters),
            ("draining", st.draining),
            ("tenants", st.tenants),
            ("pins", st.pins),
            ("warm targets", st.warm),
            ("replicas", f"{sum(st.replicas_live.values())} live of {st.replicas_total}"),
            ("live by pool", live),
            ("desired-state version", st.desired_version),
        ],
    )
    return 0
