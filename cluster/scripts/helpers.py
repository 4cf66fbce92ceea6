"""Lua helpers prepended to every registry script: key building, result encoding,
residency parsing, live locations, lease fencing (see `cluster.scripts`)."""

from __future__ import annotations

HELPERS = r"""
local ns = ARGV[1]
local function k(...) return ns .. ':' .. table.concat({...}, ':') end
local function ret(...) return cjson.encode({...}) end
local function hmap(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end
local function split_resident(v)
  return string.match(v, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
end
-- Live locations of name (only entries whose replica still holds its lease with
-- the epoch that wrote them); version nil means any version. One MGET for all leases
-- (unpack caps this at a few thousand replicas per adapter).
local function locations(name, version)
  local out = {}
  local flat = redis.call('HGETALL', ns .. ':resident:' .. name)
  if #flat == 0 then return out end
  local lease_keys = {}
  for i = 1, #flat, 2 do lease_keys[#lease_keys + 1] = ns .. ':lease:' .. flat[i] end
  local leases = redis.call('MGET', unpack(lease_keys))
  for i = 1, #flat, 2 do
    local tier, ver, ep, pool = split_resident(flat[i + 1])
    if (version == nil or ver == version) and leases[(i + 1) / 2] == ep then
      out[#out + 1] = {flat[i], tier, pool}
    end
  end
  return out
end
-- Live entries of a per-replica hash whose values end in '|epoch' (activity, warm claims):
-- {replica id, value without the epoch} for each replica whose lease holds that epoch.
local function live_entries(key)
  local out = {}
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return out end
  local lease_keys = {}
  for i = 1, #flat, 2 do lease_keys[#lease_keys + 1] = ns .. ':lease:' .. flat[i] end
  local leases = redis.call('MGET', unpack(lease_keys))
  for i = 1, #flat, 2 do
    local value, ep = string.match(flat[i + 1], '^(.*)|([^|]*)$')
    if ep and leases[(i + 1) / 2] == ep then out[#out + 1] = {flat[i], value} end
  end
  return out
end
-- Drop what replica id reported as active (a new incarnation, a deregistered or reaped one).
local function drop_activity(id)
  for _, name in ipairs(redis.call('SMEMBERS', k('replica', id, 'active'))) do
    redis.call('HDEL', k('active', name), id)
    if redis.call('EXISTS', k('active', name)) == 0 then
      redis.call('SREM', k('active_names'), name)
    end
  end
  redis.call('DEL', k('replica', id, 'active'))
end
-- nil when (id, epoch) holds the lease; else the script's refusal, ret(status, current
-- epoch): 'stale' when a newer registration exists, 'lapsed' when the lease expired (or
-- Redis lost it) and the replica must re-register.
local function fence(id, epoch)
  local cur = redis.call('GET', k('epoch', id))
  if cur and cur ~= epoch then return ret('stale', cur) end
  if not cur or redis.call('GET', k('lease', id)) ~= epoch then
    return ret('lapsed', cur or '0')
  end
  return nil
end
-- Redis's clock in ms (frozen for the script's run).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The desired-state version: +1 per change. A missing counter (a new namespace, or a
-- Redis restarted without persistence, or flushed) starts from the clock in ms, not 0,
-- so versions after a restart never repeat one a replica applied before it (a replica
-- skips a version equal to the one it holds: a repeat would hide the new state).
local function bump(name, change)
  if redis.call('EXISTS', k('desired')) == 0 then
    redis.call('SET', k('desired'), now_ms())
  end
  local v = redis.call('INCR', k('desired'))
  redis.call('PUBLISH', k('hints'), cjson.encode({version = v, adapter = name, change = change}))
  return v
end
local function finalize(name)
  for _, id in ipairs(redis.call('HKEYS', k('resident', name))) do
    redis.call('SREM', k('replica', id, 'adapters'), name)
  end
  redis.call('DEL', k('adapter', name), k('grants', name), k('resident', name),
    k('active', name), k('warm_claims', name), k('prefetch_claims', name))
  redis.call('SREM', k('active_names'), name)
  redis.call('SREM', k('adapters'), name)
  redis.call('SREM', k('draining'), name)
  redis.call('HDEL', k('pins'), name)
  redis.call('HDEL', k('warm'), name)
  bump(name, 'removed')
end
-- Whether a pin / warm target of target_pool binds a replica of replica_pool (the Lua twin
-- of records.pin_applies: "all" binds every replica, mixed replicas take every pool).
local function binds(target_pool, replica_pool)
  return target_pool == 'all' or replica_pool == target_pool or replica_pool == 'mixed'
end
-- Whether replicas of pools a and b serve a common phase: equal pools, or either one
-- mixed (it runs both). binds made symmetric: a prefill replica counts prefill and mixed
-- replicas' demand and copies when it ranks what to prefetch, a mixed one counts all.
local function overlaps(a, b)
  return a == b or a == 'mixed' or b == 'mixed'
end
-- An active:{name} entry's value (live_entries strips the epoch): requests in flight,
-- pool and deployment of the replica that reported it. A bare count (written by a
-- replica of an older version, mid rolling upgrade) reads as mixed, in no deployment.
local function split_active(v)
  local n, pool, deployment = string.match(v, '^(%d+)|([^|]*)|(.*)$')
  if not n then return tonumber(v) or 0, 'mixed', nil end
  return tonumber(n), pool, deployment
end
local function allowed(rec, tenant)
  return rec.public == '1' or rec.owner == tenant
    or redis.call('SISMEMBER', k('grants', rec.name), tenant) == 1
end
-- Drop replica id's record, residency and set membership. Its epoch counter stays, so a
-- later registration of the same id still gets a newer epoch than any old incarnation.
local function forget(id)
  for _, name in ipairs(redis.call('SMEMBERS', k('replica', id, 'adapters'))) do
    redis.call('HDEL', k('resident', name), id)
  end
  drop_activity(id)
  redis.call('DEL', k('replica', id), k('replica', id, 'adapters'))
  redis.call('SREM', k('replicas'), id)
end
-- nil when pinning name leaves every replica an evictable GPU slot, else {slots, names
-- pinned already}. All pins share one budget whatever their pool: a mixed replica takes
-- pins of every pool (records.pin_applies), so the budget is one for all. slots is the
-- served base's max_loras; without one (no deployment published it) nothing is checked.
-- Re-pinning a pinned name (to any pool) adds no pin, so it is never refused.
local function pin_overflow(name)
  local raw = redis.call('GET', k('served'))
  local slots = raw and tonumber(cjson.decode(raw).max_loras)
  if not slots or redis.call('HEXISTS', k('pins'), name) == 1 then return nil end
  local held = redis.call('HKEYS', k('pins'))
  if #held + 1 < slots then return nil end
  table.sort(held)
  return {slots, held}
end
"""
