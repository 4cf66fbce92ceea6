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
    # ARGV: ns, tenant, emission interval T (whole microseconds), burst B (requests). GCRA
    # on Redis's own clock (so ingress clocks never matter): with the tenant's theoretical
    # arrival time TAT (no key: now), a request at `now` is admitted iff
    # TAT <= now + (B - 1) * T, and moves TAT to max(TAT, now) + T; the key expires when
    # TAT passes (an absent key means exactly what a past TAT does). A refusal writes
    # nothing and answers the microseconds until a request would be admitted.
    "admit_request": r"""
local key = k('rate', ARGV[2])
local interval, burst = tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tat = math.max(tonumber(redis.call('GET', key) or '0'), now)
local wait = tat - (burst - 1) * interval - now
if wait > 0 then return ret('limited', wait) end
tat = tat + interval
redis.call('SET', key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000))
return ret('ok')
""",
}
