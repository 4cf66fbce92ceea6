"""`lorafleet adapters ...`: register, list, show, unregister, pin, unpin, warm."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.catalog import base_model_note, config_base_model
from cluster.cli.common import (
    DEFAULT_MAX_LORA_RANK,
    add_max_lora_rank,
    add_verb,
    print_json,
    print_table,
    utc_time,
)
from cluster.keys import check_name
from cluster.records import PIN_POOLS, AdapterListing
from cluster.registry import LIST_PAGE, Registry
from lora_core.errors import AdapterNotFound
from lora_core.validate import WEIGHTS_FILE

ADAPTER = "adapter name"
# A registration reads, hashes and scans every byte of the weights (~3 s for 1.6 GB from
# the page cache, far longer from network storage): above this it says so first.
ANNOUNCE_BYTES = 256 << 20


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("adapters", help="manage the adapter catalog")
    verbs = parser.add_subparsers(dest="verb", required=True)

    p = add_verb(
        verbs, "register", _register, "validate and register a PEFT adapter directory", listing=True
    )
    add_max_lora_rank(p)
    p.add_argument("name", metavar="NAME", help="adapter name (what clients put in `model`)")
    p.add_argument(
        "path", metavar="PATH", help="PEFT adapter directory (adapter_config.json + weights)"
    )
    p.add_argument(
        "--base-model",
        metavar="ID",
        type=_base_model,
        default=None,
        help="base model id (default: the cluster's; without a cluster, the adapter config's)",
    )
    p.add_argument(
        "--tenant",
        default=None,
        help="owning tenant (always authorized); --replace keeps the current owner unless given",
    )
    access = p.add_mutually_exclusive_group()
    access.add_argument(
        "--public",
        dest="public",
        action="store_const",
        const=True,
        default=None,
        help="any tenant may use it (--replace keeps the current setting unless "
        "--public or --private is given; a new adapter is private)",
    )
    access.add_argument(
        "--private",
        dest="public",
        action="store_const",
        const=False,
        help="only the owner and granted tenants may use it",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="register a new version of NAME (its owner, public flag and grants are kept); "
        "a NAME that does not exist (or is being unregistered) is registered as a new "
        "adapter, with a note on stderr",
    )

    add_verb(verbs, "list", _list, "list adapters with pins, warm targets, locations", listing=True)
    add_verb(verbs, "show", _show, "show one adapter", listing=True, named=ADAPTER)
    add_verb(verbs, "unregister", _unregister, "stop new requests; unload when idle",
             listing=False, named=ADAPTER)  # fmt: skip
    p = add_verb(verbs, "pin", _pin, "load NAME into a GPU slot on every replica of the pool "
                 "and keep it there", listing=False, named=ADAPTER)  # fmt: skip
    _pool(p, "replicas the pin binds")
    add_verb(verbs, "unpin", _unpin, "remove NAME's pin", listing=False, named=ADAPTER)
    p = add_verb(verbs, "warm", _warm, "desire N GPU-resident copies of NAME", listing=False,
                 named=ADAPTER)  # fmt: skip
    p.add_argument(
        "--replicas", metavar="N", type=int, required=True, help="copies (0 clears the target)"
    )
    _pool(p, "replicas that count towards N")


def _base_model(text: str) -> str:
    # the ids a cluster publishes and `set_base_shape` stores follow the name rule; an
    # empty one was recorded as "no base model"
    try:
        return check_name("base model", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, or leave the option out") from None


def _announce(path: str) -> None:
    """One line on stderr before the validation of big weights, which is silent for long."""
    try:
        size = (Path(path).expanduser() / WEIGHTS_FILE).stat().st_size
    except OSError:
        return  # the registration names what is wrong with the path
    if size >= ANNOUNCE_BYTES:
        print(
            f"lorafleet: validating and hashing {size / 2**30:.1f} GiB of weights in {path}",
            file=sys.stderr,
            flush=True,
        )


def _pool(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--pool",
        choices=PIN_POOLS,
        default="all",
        help=f"{what}: all, or prefill / decode (that pool and mixed replicas; default all)",
    )


def _register(reg: Registry, args: argparse.Namespace) -> int:
    # The cluster's own base model (published by its deployment) decides shapes and
    # rank; without a cluster, a base model whose shapes were stored under its id.
    served = reg.get_served()
    base, limit = None, args.max_lora_rank
    if served is None:
        limit = DEFAULT_MAX_LORA_RANK if limit is None else limit
        base_id = args.base_model or config_base_model(args.path)
        base = reg.get_base_shape(base_id) if base_id else None
    _announce(args.path)
    note = _replace_note(reg, args.name) if args.replace else None
    rec = reg.register_adapter(
        args.name,
        args.path,
        base_model=args.base_model,
        tenant=args.tenant,
        public=args.public,
        replace=args.replace,
        base=base,
        served=served,
        max_lora_rank=limit,
    )
    if args.json:
        print_json(AdapterListing(rec, None, None, ()).to_json())
    else:
        print(
            f"registered {rec.name} version {rec.version} (rank {rec.rank}, "
            f"sha256 {rec.content_hash[:16]})"
        )
    notes = [note]
    if served is not None and args.base_model is None:  # an explicit one was checked
        notes.append(base_model_note(args.path, served.model_id))
    for text in filter(None, notes):
        print(f"lorafleet: note: {text}", file=sys.stderr)
    return 0


def _replace_note(reg: Registry, name: str) -> str | None:
    """What `--replace` did not find, when NAME is no active adapter: the registration
    then makes a new adapter (private and without owner unless asked), which the
    operator, expecting a new version, should hear of. A script's "create or update"
    still works: this is a note, not a refusal."""
    try:
        state = reg.get_adapter(name).state
    except AdapterNotFound:
        return f"--replace found no adapter {name!r}; registered it as a new adapter"
    if state == "draining":
        return (
            f"--replace found {name!r} being unregistered; registered it as a new adapter "
            "(the old one's owner, public flag and grants are not kept)"
        )
    return None


def _locations(a: AdapterListing) -> str:
    return ",".join(f"{loc.replica}:{loc.tier}" for loc in a.locations) or "-"


def _list(reg: Registry, args: argparse.Namespace) -> int:
    # paged, so listing a big catalog never blocks the request path for long
    names = reg.list_adapter_names()
    listings = [
        a
        for i in range(0, len(names), LIST_PAGE)
        for a in reg.list_adapters(names[i : i + LIST_PAGE])
    ]
    if args.json:
        print_json([a.to_json() for a in listings])
        return 0
    rows = [
        (
            a.record.name,
            a.record.version,
            a.record.rank,
            a.record.base_model or "-",
            a.record.state,
            a.pin or "-",
            f"{a.warm.replicas}/{a.warm.pool}" if a.warm else "-",
            _locations(a),
            a.record.path,
        )
        for a in listings
    ]
    print_table(
        ("NAME", "VERSION", "RANK", "BASE_MODEL", "STATE", "PIN", "WARM", "LOCATIONS", "PATH"), rows
    )
    return 0


def _show(reg: Registry, args: argparse.Namespace) -> int:
    data = reg.show_adapter(args.name).to_json()
    if args.json:
        print_json(data)
        return 0
    data["locations"] = (
        ", ".join(f"{x['replica']}:{x['tier']}({x['pool']})" for x in data["locations"]) or "-"
    )
    data["target_modules"] = ",".join(data["target_modules"])
    data["created"] = utc_time(data["created"])
    print_table(("FIELD", "VALUE"), [(k, "-" if v in (None, "") else v) for k, v in data.items()])
    return 0


def _unregister(reg: Registry, args: argparse.Namespace) -> int:
    outcome = reg.unregister_adapter(args.name)
    print(f"{args.name}: {outcome}")
    return 0


def _pin(reg: Registry, args: argparse.Namespace) -> int:
    reg.pin(args.name, args.pool)
    print(f"pinned {args.name} (pool {args.pool})")
    return 0


def _unpin(reg: Registry, args: argparse.Namespace) -> int:
    was = reg.unpin(args.name)
    print(f"unpinned {args.name}" + ("" if was else " (was not pinned)"))
    return 0


def _warm(reg: Registry, args: argparse.Namespace) -> int:
    reg.warm(args.name, args.replicas, args.pool)
    if args.replicas == 0:
        print(f"cleared the warm target of {args.name}")
        return 0
    print(f"warm target of {args.name}: {args.replicas} replicas (pool {args.pool})")
    live = [
        r
        for r in reg.list_replicas()
        if r.live and (args.pool == "all" or r.pool in (args.pool, "mixed"))
    ]
    if len(live) < args.replicas:
        print(
            f"lorafleet: note: {len(live)} live replicas in pool {args.pool} now; the target "
            "is kept and met as replicas join",
            file=sys.stderr,
        )
    return 0
