"""Registry scripts for tenants' request rate limits (see `cluster.scripts`)."""

from __future__ import annotations

BODIES: dict[str, str] = {
    # ARGV: ns, tenant, requests per minute ('0' = none of its own: the field goes). Checked
    # and written in one script, so a limit never lands on a tenant deleted meanwhile
    # (delete_tenant drops the whole hash, and with it the limit).
    "set_tenant_limit": r"""
local tenant = ARGV[2]
if redis.call('EXISTS', k('tenant', tenant)) == 0 then return ret('no_tenant', tenant) end
if ARGV[3] == '0' then
  redis.call('HDEL', k('tenant', tenant), 'requests_per_minute')
else
  redis.call('HSET', k('tenant', tenant), 'requests_per_minute', ARGV[3])
end
return ret('ok')
""",
    # ARGV: ns. {tenant, its own requests per minute ('' = none)} for every tenant.
    # O(tenants): an admin listing, never on the request path.
    "tenant_limits": r"""
local out = {}
for _, tenant in ipairs(redis.call('SMEMBERS', k('tenants'))) do
  out[#out + 1] = {tenant, redis.call('HGET', k('tenant', tenant), 'requests_per_minute') or ''}
end
return ret('ok', out)
""",
    # ARGV: ns, tenant, window (unix minute), expiry s. One request of tenant in that
    # window: the window's count with it. The counter's expiry is set with its first
    # request, in the same script, so no counter outlives its window by more than that.
    "count_request": r"""
local key = k('rate', ARGV[2], ARGV[3])
local n = redis.call('INCR', key)
if n == 1 then redis.call('EXPIRE', key, ARGV[4]) end
return ret('ok', n)
""",
}
