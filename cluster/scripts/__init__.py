"""Lua scripts of the registry: every multi-key read or write is one atomic script.

Each script gets ARGV[1] = namespace and builds keys with `k(...)` exactly as
`cluster.keys` documents them. Each returns a JSON array whose first element is a
status ("ok", "not_found", "stale", ...) that `cluster.ops` turns into a value or
a typed error. Redis runs a script with time frozen at its start, so the lease
checks inside one script all see the same instant.

The shared Lua helpers live in `helpers`; the adapter, tenant and key scripts in
`catalog`; the replica, residency, pin, warm and listing scripts in `fleet`; the
adapter-demand ones (activity, warm claims, hot adapters) in `demand`; tenants' request
rate limits in `limits`.
"""

from __future__ import annotations

from cluster.scripts import catalog, demand, fleet, limits
from cluster.scripts.helpers import HELPERS

SCRIPTS: dict[str, str] = {
    name: HELPERS + body
    for name, body in (catalog.BODIES | fleet.BODIES | demand.BODIES | limits.BODIES).items()
}
