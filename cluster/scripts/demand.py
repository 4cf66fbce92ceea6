"""Registry scripts for adapter demand: what replicas' requests use now (the autoscaling
share; see `cluster.scripts`)."""

from __future__ import annotations

BODIES: dict[str, str] = {
    # ARGV: ns, id, epoch, name, in-flight requests, name, in-flight requests, ...
    # Replaces what id reported active before (names not given are no longer active there)
    # and returns, per given name in order, on how many live replicas it is active now
    # (this one included): the publisher's adapter share is the sum of 1 / that count.
    "report_active": r"""
local id, epoch = ARGV[2], ARGV[3]
local f = fence(id, epoch)
if f then return ret(f, redis.call('GET', k('epoch', id)) or '0') end
local given = {}
for i = 4, #ARGV, 2 do given[ARGV[i]] = true end
for _, name in ipairs(redis.call('SMEMBERS', k('replica', id, 'active'))) do
  if not given[name] then
    redis.call('HDEL', k('active', name), id)
    redis.call('SREM', k('replica', id, 'active'), name)
    if redis.call('EXISTS', k('active', name)) == 0 then
      redis.call('SREM', k('active_names'), name)
    end
  end
end
local copies = {}
for i = 4, #ARGV, 2 do
  local name = ARGV[i]
  redis.call('HSET', k('active', name), id, ARGV[i + 1] .. '|' .. epoch)
  redis.call('SADD', k('replica', id, 'active'), name)
  redis.call('SADD', k('active_names'), name)
  copies[#copies + 1] = #live_entries(k('active', name))
end
return ret('ok', copies)
""",
}
