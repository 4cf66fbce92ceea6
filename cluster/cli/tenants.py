"""`lorafleet tenants ...`: create, delete, list, limit, key, keys, revoke-key, grant,
revoke."""

from __future__ import annotations

import argparse
import sys

from cluster.cli.common import add_verb, print_json, print_table, utc_time
from cluster.records import check_requests_per_minute, key_id
from cluster.registry import Registry, hash_key

TENANT = "tenant name"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tenants", help="manage tenants, API keys and grants")
    verbs = parser.add_subparsers(dest="verb", required=True)
    add_verb(verbs, "create", _create, "create a tenant", listing=False, named=TENANT)
    add_verb(verbs, "delete", _delete, "delete a tenant with its API keys and grants",
             listing=False, named=TENANT)  # fmt: skip
    add_verb(verbs, "list", _list, "list tenants with their request rate limits", listing=True)
    p = add_verb(verbs, "limit", _limit, "set a tenant's request rate limit", listing=False,
                 named=TENANT)  # fmt: skip
    p.add_argument(
        "--requests-per-minute",
        type=_requests_per_minute,
        required=True,
        metavar="N",
        help="inference requests the tenant may send per minute: a burst of up to N, then "
        "one every 60 s / N (0 removes its own limit: the cluster's "
        "tenant_requests_per_minute applies)",
    )
    add_verb(verbs, "key", _key, "issue a new API key (printed once, stored hashed)",
             listing=True, named=TENANT)  # fmt: skip
    add_verb(verbs, "keys", _keys, "list a tenant's key ids", listing=True, named=TENANT)
    p = add_verb(
        verbs, "revoke-key", _revoke_key, "revoke an API key (or --all) at once", listing=False
    )
    p.usage = "%(prog)s [options] NAME (KEY_ID | --all)"
    p.formatter_class = _FlagHelp
    p.add_argument("name", metavar="NAME", help=TENANT)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "key_id", metavar="KEY_ID", nargs="?", help="id from `tenants keys` (or a unique prefix)"
    )
    which.add_argument("--all", action=_AllKeys, help="revoke every key of the tenant")
    for verb, handler in (("grant", _grant), ("revoke", _revoke)):
        what = f"{verb} a tenant's access to an adapter"
        p = add_verb(verbs, verb, handler, what, listing=False, named=TENANT)
        p.add_argument("adapter", metavar="ADAPTER", help="adapter name")


class _AllKeys(argparse.Action):
    """`--all`. It takes an optional value only to catch `--all KEY_ID`, which argparse
    (3.11) would report as "unrecognized arguments", and say what is wrong instead."""

    def __init__(self, option_strings: list[str], dest: str, help: str):
        super().__init__(
            option_strings, dest, nargs="?", const=True, default=False, metavar="", help=help
        )

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        if value is not True:
            parser.error("give a KEY_ID or --all, not both")
        setattr(namespace, self.dest, True)


class _FlagHelp(argparse.HelpFormatter):
    """Shows `--all` as the flag it is: its optional value (see _AllKeys) is no option
    of the user's, and argparse would print it as `--all []`."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _AllKeys):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)


def _create(reg: Registry, args: argparse.Namespace) -> int:
    reg.create_tenant(args.name)
    print(f"created tenant {args.name}")
    return 0


def _delete(reg: Registry, args: argparse.Namespace) -> int:
    keys, grants = reg.delete_tenant(args.name)
    print(f"deleted tenant {args.name} ({keys} keys revoked, {grants} grants removed)")
    return 0


def _requests_per_minute(text: str) -> int:
    try:
        return check_requests_per_minute(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: an integer >= 0") from None


def _list(reg: Registry, args: argparse.Namespace) -> int:
    tenants = reg.list_tenant_limits()
    if args.json:
        print_json([t.to_json() for t in tenants])
    else:
        # "-": no limit of its own (the cluster's tenant_requests_per_minute applies)
        rows = [(t.name, t.requests_per_minute or "-") for t in tenants]
        print_table(("TENANT", "REQUESTS_PER_MINUTE"), rows)
    return 0


def _limit(reg: Registry, args: argparse.Namespace) -> int:
    rpm = args.requests_per_minute
    reg.set_tenant_limit(args.name, rpm)
    if rpm:
        print(f"tenant {args.name}: at most {rpm} requests per minute")
    else:
        print(f"tenant {args.name}: no limit of its own (the cluster's default applies)")
    return 0


def _key(reg: Registry, args: argparse.Namespace) -> int:
    key = reg.issue_api_key(args.name)
    kid = key_id(hash_key(key))
    if args.json:
        print_json({"tenant": args.name, "key": key, "key_id": kid})
        return 0
    # stdout carries the key alone, so `KEY=$(lorafleet tenants key T)` keeps working
    print(key)
    print(f"key id {kid} (revoke: lorafleet tenants revoke-key {args.name} {kid})", file=sys.stderr)
    return 0


def _keys(reg: Registry, args: argparse.Namespace) -> int:
    keys = reg.list_api_keys(args.name)
    if args.json:
        print_json([k.to_json() for k in keys])
    else:
        print_table(("KEY_ID", "CREATED"), [(k.key_id, utc_time(k.created)) for k in keys])
    return 0


def _revoke_key(reg: Registry, args: argparse.Namespace) -> int:
    if args.all:
        ids = reg.revoke_all_api_keys(args.name)
        print(f"revoked {len(ids)} keys of {args.name}" + (f": {', '.join(ids)}" if ids else ""))
    else:
        print(f"revoked key {reg.revoke_api_key(args.name, args.key_id)} of {args.name}")
    return 0


def _grant(reg: Registry, args: argparse.Namespace) -> int:
    new = reg.grant(args.name, args.adapter)
    print(f"granted {args.name} -> {args.adapter}" + ("" if new else " (already granted)"))
    return 0


def _revoke(reg: Registry, args: argparse.Namespace) -> int:
    gone = reg.revoke(args.name, args.adapter)
    print(f"revoked {args.name} -> {args.adapter}" + ("" if gone else " (was not granted)"))
    return 0
