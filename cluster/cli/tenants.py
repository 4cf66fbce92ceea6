"""`lorafleet tenants ...`: create, list, key, grant, revoke."""

from __future__ import annotations

import argparse

from cluster.cli.common import add_verb, print_json, print_table
from cluster.registry import Registry


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tenants", help="manage tenants, API keys and grants")
    verbs = parser.add_subparsers(dest="verb", required=True)
    add_verb(verbs, "create", _create, "create a tenant", listing=False).add_argument("name")
    add_verb(verbs, "list", _list, "list tenants", listing=True)
    add_verb(
        verbs, "key", _key, "issue a new API key (printed once, stored hashed)", listing=False
    ).add_argument("name")
    for verb, handler in (("grant", _grant), ("revoke", _revoke)):
        p = add_verb(verbs, verb, handler, f"{verb} a tenant's access to an adapter", listing=False)
        p.add_argument("name")
        p.add_argument("adapter")


def _create(reg: Registry, args: argparse.Namespace) -> int:
    reg.create_tenant(args.name)
    print(f"created tenant {args.name}")
    return 0


def _list(reg: Registry, args: argparse.Namespace) -> int:
    names = reg.list_tenants()
    if args.json:
        print_json(names)
    else:
        print_table(("TENANT",), [(n,) for n in names])
    return 0


def _key(reg: Registry, args: argparse.Namespace) -> int:
    print(reg.issue_api_key(args.name))
    return 0


def _grant(reg: Registry, args: argparse.Namespace) -> int:
    new = reg.grant(args.name, args.adapter)
    print(f"granted {args.name} -> {args.adapter}" + ("" if new else " (already granted)"))
    return 0


def _revoke(reg: Registry, args: argparse.Namespace) -> int:
    gone = reg.revoke(args.name, args.adapter)
    print(f"revoked {args.name} -> {args.adapter}" + ("" if gone else " (was not granted)"))
    return 0
