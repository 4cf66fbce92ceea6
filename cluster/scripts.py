"""Lua scripts of the registry: every multi-key read or write is one atomic script.

Each script gets ARGV[1] = namespace and builds keys with `k(...)` exactly as
`cluster.keys` documents them. Each returns a JSON array whose first element is a
status ("ok", "not_found", "stale", ...) that `cluster.ops` turns into a value or
a typed error. Redis runs a script with time frozen at its start, so the lease
checks inside one script all see the same instant.
"""

from __future__ import annotations

_HELPERS = r"""
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
-- nil when (id, epoch) holds the lease; 'stale' when a newer registration exists;
-- 'lapsed' when the lease expired (or Redis lost it) and the replica must re-register.
local function fence(id, epoch)
  local cur = redis.call('GET', k('epoch', id))
  if cur and cur ~= epoch then return 'stale' end
  if not cur or redis.call('GET', k('lease', id)) ~= epoch then return 'lapsed' end
  return nil
end
-- The desired-state version: +1 per change. A missing counter (a new namespace, or a
-- Redis restarted without persistence, or flushed) starts from the clock in ms, not 0,
-- so versions after a restart never repeat one a replica applied before it (a replica
-- skips a version equal to the one it holds: a repeat would hide the new state).
local function bump(name, change)
  if redis.call('EXISTS', k('desired')) == 0 then
    local now = redis.call('TIME')
    redis.call('SET', k('desired'), tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
  end
  local v = redis.call('INCR', k('desired'))
  redis.call('PUBLISH', k('hints'), cjson.encode({version = v, adapter = name, change = change}))
  return v
end
local function finalize(name)
  for _, id in ipairs(redis.call('HKEYS', k('resident', name))) do
    redis.call('SREM', k('replica', id, 'adapters'), name)
  end
  redis.call('DEL', k('adapter', name), k('grants', name), k('resident', name))
  redis.call('SREM', k('adapters'), name)
  redis.call('SREM', k('draining'), name)
  redis.call('HDEL', k('pins'), name)
  redis.call('HDEL', k('warm'), name)
  bump(name, 'removed')
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

_BODIES: dict[str, str] = {
    # ARGV: ns, name, replace, owner, public ('1'/'0', '' = keep), content_hash, path,
    #       rank, base_model, target_modules (JSON), created, owner given ('1'/'0').
    # A replace is a new version of the same adapter: owner and public are kept unless
    # given, and so are its grants. A draining name was unregistered: registering it again
    # makes a new adapter, so the old grants go (they must not open it to old grantees).
    "register_adapter": r"""
local name, owner, public = ARGV[2], ARGV[4], ARGV[5]
if owner ~= '' and redis.call('EXISTS', k('tenant', owner)) == 0 then
  return ret('no_tenant', owner)
end
local old = hmap(redis.call('HGETALL', k('adapter', name)))
local exists = old.name ~= nil
local draining = old.state == 'draining'
if exists and ARGV[3] ~= '1' and not draining then
  return ret('exists', old.version)
end
if draining then
  redis.call('DEL', k('grants', name))
elseif exists then
  if ARGV[12] ~= '1' then owner = old.owner or '' end
  if public == '' then public = old.public or '0' end
end
if public == '' then public = '0' end
local v = redis.call('INCR', k('version', name))
redis.call('DEL', k('adapter', name))
redis.call('HSET', k('adapter', name), 'name', name, 'version', v, 'content_hash', ARGV[6],
  'path', ARGV[7], 'rank', ARGV[8], 'base_model', ARGV[9], 'target_modules', ARGV[10],
  'owner', owner, 'public', public, 'created', ARGV[11], 'state', 'active')
redis.call('SADD', k('adapters'), name)
if exists then
  redis.call('SREM', k('draining'), name)
  bump(name, 'replaced')
end
return ret('ok', v, owner, public)
""",
    # ARGV: ns, name
    "unregister_adapter": r"""
local name = ARGV[2]
if redis.call('EXISTS', k('adapter', name)) == 0 then return ret('not_found') end
if #locations(name, nil) == 0 then
  finalize(name)
  return ret('ok', 'removed')
end
redis.call('HSET', k('adapter', name), 'state', 'draining')
redis.call('SADD', k('draining'), name)
redis.call('HDEL', k('pins'), name)
redis.call('HDEL', k('warm'), name)
bump(name, 'draining')
return ret('ok', 'draining')
""",
    # ARGV: ns, name, key_hash ('' = no key), require_key ('1'/'0')
    "resolve_request": r"""
local name, tenant = ARGV[2], false
if ARGV[3] ~= '' then
  tenant = redis.call('GET', k('apikey', ARGV[3]))
  if not tenant then return ret('unauthorized') end
elseif ARGV[4] == '1' then
  return ret('unauthorized')
end
local rec = hmap(redis.call('HGETALL', k('adapter', name)))
if not rec.name then return ret('not_found') end
if tenant and not allowed(rec, tenant) then return ret('not_found') end
if rec.state == 'draining' then return ret('draining') end
return ret('ok', rec, tenant or '', locations(name, rec.version))
""",
    # ARGV: ns, name
    "locations": r"""
local version = redis.call('HGET', k('adapter', ARGV[2]), 'version')
if not version then return ret('not_found') end
return ret('ok', locations(ARGV[2], version))
""",
    # ARGV: ns, tenant, adapter
    "authorize": r"""
local rec = hmap(redis.call('HGETALL', k('adapter', ARGV[3])))
if not rec.name or rec.state == 'draining' then return ret('ok', false) end
if redis.call('EXISTS', k('tenant', ARGV[2])) == 0 then return ret('ok', false) end
return ret('ok', allowed(rec, ARGV[2]))
""",
    # ARGV: ns, tenant, created
    "create_tenant": r"""
if redis.call('EXISTS', k('tenant', ARGV[2])) == 1 then return ret('exists') end
redis.call('HSET', k('tenant', ARGV[2]), 'name', ARGV[2], 'created', ARGV[3])
redis.call('SADD', k('tenants'), ARGV[2])
return ret('ok')
""",
    # ARGV: ns, tenant, key_hash, created
    "issue_api_key": r"""
if redis.call('EXISTS', k('tenant', ARGV[2])) == 0 then return ret('no_tenant', ARGV[2]) end
redis.call('SET', k('apikey', ARGV[3]), ARGV[2])
redis.call('SADD', k('tenant', ARGV[2], 'keys'), ARGV[3])
redis.call('HSET', k('tenant', ARGV[2], 'key_created'), ARGV[3], ARGV[4])
return ret('ok')
""",
    # ARGV: ns, tenant
    "list_api_keys": r"""
if redis.call('EXISTS', k('tenant', ARGV[2])) == 0 then return ret('no_tenant', ARGV[2]) end
local out = {}
for _, h in ipairs(redis.call('SMEMBERS', k('tenant', ARGV[2], 'keys'))) do
  out[#out + 1] = {h, redis.call('HGET', k('tenant', ARGV[2], 'key_created'), h) or ''}
end
return ret('ok', out)
""",
    # ARGV: ns, tenant, key id prefix ('' = every key of tenant). 'no_key' when the
    # prefix matches none of tenant's keys, 'ambiguous' (with the matching hashes) when
    # it matches several; nothing is deleted then. The apikey mapping and the set member
    # go together, so a revoked key stops resolving at once.
    "revoke_api_keys": r"""
local tenant, prefix = ARGV[2], ARGV[3]
if redis.call('EXISTS', k('tenant', tenant)) == 0 then return ret('no_tenant', tenant) end
local hit = {}
for _, h in ipairs(redis.call('SMEMBERS', k('tenant', tenant, 'keys'))) do
  if string.sub(h, 1, #prefix) == prefix then hit[#hit + 1] = h end
end
if prefix ~= '' and #hit == 0 then return ret('no_key') end
if prefix ~= '' and #hit > 1 then return ret('ambiguous', hit) end
for _, h in ipairs(hit) do
  redis.call('DEL', k('apikey', h))
  redis.call('SREM', k('tenant', tenant, 'keys'), h)
  redis.call('HDEL', k('tenant', tenant, 'key_created'), h)
end
return ret('ok', hit)
""",
    # ARGV: ns, tenant. Deletes the tenant, every key of it (they stop resolving at once)
    # and every grant to it, so a tenant created later under the same name inherits
    # nothing. 'owns' (sorted names) when it owns active adapters: deleting it would leave
    # them an owner that a new tenant of that name would become; nothing is deleted then.
    # O(adapters): one SREM per adapter, an admin action, never on the request path.
    "delete_tenant": r"""
local tenant = ARGV[2]
if redis.call('EXISTS', k('tenant', tenant)) == 0 then return ret('no_tenant', tenant) end
local names, owned = redis.call('SMEMBERS', k('adapters')), {}
for _, name in ipairs(names) do
  local owner, state = unpack(redis.call('HMGET', k('adapter', name), 'owner', 'state'))
  if owner == tenant and state ~= 'draining' then owned[#owned + 1] = name end
end
if #owned > 0 then
  table.sort(owned)
  return ret('owns', owned)
end
local keys = redis.call('SMEMBERS', k('tenant', tenant, 'keys'))
for _, h in ipairs(keys) do redis.call('DEL', k('apikey', h)) end
local grants = 0
for _, name in ipairs(names) do
  grants = grants + redis.call('SREM', k('grants', name), tenant)
end
redis.call('DEL', k('tenant', tenant), k('tenant', tenant, 'keys'),
  k('tenant', tenant, 'key_created'))
redis.call('SREM', k('tenants'), tenant)
return ret('ok', #keys, grants)
""",
    # ARGV: ns, tenant, adapter, '1' grant / '0' revoke
    "grant": r"""
if redis.call('EXISTS', k('tenant', ARGV[2])) == 0 then return ret('no_tenant', ARGV[2]) end
if redis.call('EXISTS', k('adapter', ARGV[3])) == 0 then return ret('not_found') end
if ARGV[4] == '1' then
  return ret('ok', redis.call('SADD', k('grants', ARGV[3]), ARGV[2]))
end
return ret('ok', redis.call('SREM', k('grants', ARGV[3]), ARGV[2]))
""",
    # ARGV: ns, id, pool, deployment, slot_capacity, ttl_ms, now
    "register_replica": r"""
local id = ARGV[2]
local e = redis.call('INCR', k('epoch', id))
redis.call('SET', k('lease', id), e, 'PX', ARGV[6])
redis.call('HSET', k('replica', id), 'id', id, 'pool', ARGV[3], 'deployment', ARGV[4],
  'slot_capacity', ARGV[5], 'epoch', e, 'registered', ARGV[7])
redis.call('SADD', k('replicas'), id)
-- a new incarnation holds nothing until it reports again
for _, name in ipairs(redis.call('SMEMBERS', k('replica', id, 'adapters'))) do
  redis.call('HDEL', k('resident', name), id)
end
redis.call('DEL', k('replica', id, 'adapters'))
return ret('ok', e)
""",
    # ARGV: ns, id, epoch, ttl_ms
    "heartbeat": r"""
local f = fence(ARGV[2], ARGV[3])
if f then return ret(f, redis.call('GET', k('epoch', ARGV[2])) or '0') end
redis.call('PEXPIRE', k('lease', ARGV[2]), ARGV[4])
return ret('ok')
""",
    # ARGV: ns, id, epoch. A stopping replica removes its own record, residency and lease
    # at once, and finishes unregistering the draining adapters only it held. 'stale'
    # (nothing removed) when a newer registration of id exists: that record is not ours.
    "deregister_replica": r"""
local id = ARGV[2]
local cur = redis.call('GET', k('epoch', id))
if cur ~= ARGV[3] then return ret('stale', cur or '0') end
local held = redis.call('SMEMBERS', k('replica', id, 'adapters'))
forget(id)
redis.call('DEL', k('lease', id))
for _, name in ipairs(held) do
  if redis.call('SISMEMBER', k('draining'), name) == 1 and #locations(name, nil) == 0 then
    finalize(name)
  end
end
return ret('ok')
""",
    # ARGV: ns, id, epoch, name, version, tier, ref_key
    "report_resident": r"""
local id, name = ARGV[2], ARGV[4]
local f = fence(id, ARGV[3])
if f then return ret(f, redis.call('GET', k('epoch', id)) or '0') end
local rec = redis.call('HMGET', k('adapter', name), 'version', 'content_hash')
if not rec[1] then return ret('not_found') end
-- A copy of the current version number with other content (weights registered before
-- Redis restarted empty, when numbering started over) is not the current adapter.
local hash = string.match(ARGV[7], ':(%x+)$')
if rec[1] == ARGV[5] and hash and string.sub(rec[2], 1, #hash) ~= hash then
  return ret('ok')
end
-- One entry per replica and name: a replica still caching an older version beside a
-- newer one keeps the newer entry (requests resolve to the newest version, so an old
-- copy's report must not hide it from routing).
local cur = redis.call('HGET', k('resident', name), id)
if cur then
  local _, ver = split_resident(cur)
  if tonumber(ver) > tonumber(ARGV[5]) then return ret('ok') end
end
-- the pool is copied in: it is fixed per epoch, so reads need no replica lookup
local pool = redis.call('HGET', k('replica', id), 'pool') or ''
redis.call('HSET', k('resident', name), id,
  ARGV[6] .. '|' .. ARGV[5] .. '|' .. ARGV[3] .. '|' .. pool .. '|' .. ARGV[7])
redis.call('SADD', k('replica', id, 'adapters'), name)
return ret('ok')
""",
    # ARGV: ns, id, epoch, name, version ('' = any), ref_key ('' = any content)
    "remove_resident": r"""
local id, name = ARGV[2], ARGV[4]
local f = fence(id, ARGV[3])
if f then return ret(f, redis.call('GET', k('epoch', id)) or '0') end
local cur = redis.call('HGET', k('resident', name), id)
local removed = 0
if cur then
  local _, ver, _, _, key = split_resident(cur)
  -- same number, other content (a copy from before Redis restarted empty): not this entry
  key = key or ''
  local same = ARGV[6] == '' or key == '' or key == ARGV[6]
  if (ARGV[5] == '' or ver == ARGV[5]) and same then
    removed = redis.call('HDEL', k('resident', name), id)
    redis.call('SREM', k('replica', id, 'adapters'), name)
  end
end
if redis.call('SISMEMBER', k('draining'), name) == 1 and #locations(name, nil) == 0 then
  finalize(name)
end
return ret('ok', removed)
""",
    # ARGV: ns, name, pool ('' = unpin). 'refused' (slots, names pinned) when the pin
    # would leave replicas no evictable GPU slot.
    "pin": r"""
local name = ARGV[2]
local state = redis.call('HGET', k('adapter', name), 'state')
if not state then return ret('not_found') end
if ARGV[3] == '' then
  local removed = redis.call('HDEL', k('pins'), name)
  if removed == 1 then bump(name, 'unpin') end
  return ret('ok', removed)
end
if state == 'draining' then return ret('draining') end
-- checked here, in the write's own script, so concurrent pins cannot both pass
local over = pin_overflow(name)
if over then return ret('refused', over[1], over[2]) end
redis.call('HSET', k('pins'), name, ARGV[3])
bump(name, 'pin')
return ret('ok')
""",
    # ARGV: ns, name, replicas, pool
    "warm": r"""
local name = ARGV[2]
local state = redis.call('HGET', k('adapter', name), 'state')
if not state then return ret('not_found') end
if ARGV[3] == '0' then
  if redis.call('HDEL', k('warm'), name) == 1 then bump(name, 'warm') end
  return ret('ok')
end
if state == 'draining' then return ret('draining') end
redis.call('HSET', k('warm'), name, ARGV[3] .. '|' .. ARGV[4])
bump(name, 'warm')
return ret('ok')
""",
    # ARGV: ns
    "desired_state": r"""
local pins = hmap(redis.call('HGETALL', k('pins')))
local warm = hmap(redis.call('HGETALL', k('warm')))
local refs = {}
for _, tbl in ipairs({pins, warm}) do
  for name, _ in pairs(tbl) do
    refs[name] = hmap(redis.call('HGETALL', k('adapter', name)))
  end
end
return ret('ok', tonumber(redis.call('GET', k('desired')) or '0'), pins, warm,
  redis.call('SMEMBERS', k('draining')), refs)
""",
    # ARGV: ns, 'all' | 'names', name...
    "list_adapters": r"""
local names = {unpack(ARGV, 3)}
if ARGV[2] == 'all' then names = redis.call('SMEMBERS', k('adapters')) end
local out = {}
for _, name in ipairs(names) do
  local rec = hmap(redis.call('HGETALL', k('adapter', name)))
  if rec.name then
    out[#out + 1] = {rec, redis.call('HGET', k('pins'), name) or '',
      redis.call('HGET', k('warm'), name) or '', locations(name, rec.version)}
  end
end
return ret('ok', out)
""",
    # ARGV: ns, tenant ('' = no tenant: every active adapter), 'all' | 'names', name...
    # The `/v1/models` read: identity fields of the active adapters tenant may use, no
    # residency (no lease reads) and one script instead of one `authorize` per adapter.
    "visible_adapters": r"""
local tenant, names = ARGV[2], {unpack(ARGV, 4)}
if ARGV[3] == 'all' then names = redis.call('SMEMBERS', k('adapters')) end
local out = {}
for _, name in ipairs(names) do
  local v = redis.call('HMGET', k('adapter', name), 'version', 'content_hash', 'path', 'rank',
    'base_model', 'owner', 'public', 'state')
  if v[1] and v[8] ~= 'draining'
      and (tenant == '' or allowed({name = name, owner = v[6], public = v[7]}, tenant)) then
    out[#out + 1] = {name, v[1], v[2], v[3], v[4], v[5] or ''}
  end
end
return ret('ok', out)
""",
    # ARGV: ns
    "list_replicas": r"""
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', k('replicas'))) do
  local rec = hmap(redis.call('HGETALL', k('replica', id)))
  if rec.id then
    local live = redis.call('GET', k('lease', id)) == rec.epoch
    local gpu, cpu = 0, 0
    for _, name in ipairs(redis.call('SMEMBERS', k('replica', id, 'adapters'))) do
      local v = redis.call('HGET', k('resident', name), id)
      if v then
        if split_resident(v) == 'gpu' then gpu = gpu + 1 else cpu = cpu + 1 end
      end
    end
    out[#out + 1] = {rec, live, gpu, cpu}
  end
end
return ret('ok', out)
""",
    # ARGV: ns. Idempotent: replicas run it periodically, concurrently; each run removes
    # what is lapsed at its instant, and a second run finds nothing left.
    "reap": r"""
local dead = 0
for _, id in ipairs(redis.call('SMEMBERS', k('replicas'))) do
  local epoch = redis.call('HGET', k('replica', id), 'epoch')
  if not epoch or redis.call('GET', k('lease', id)) ~= epoch then
    forget(id)
    dead = dead + 1
  end
end
local drained = 0
for _, name in ipairs(redis.call('SMEMBERS', k('draining'))) do
  if #locations(name, nil) == 0 then
    finalize(name)
    drained = drained + 1
  end
end
return ret('ok', dead, drained)
""",
    # ARGV: ns
    "status": r"""
local live, total = {prefill = 0, decode = 0, mixed = 0}, 0
for _, id in ipairs(redis.call('SMEMBERS', k('replicas'))) do
  local rec = hmap(redis.call('HGETALL', k('replica', id)))
  if rec.id then
    total = total + 1
    if redis.call('GET', k('lease', id)) == rec.epoch then
      live[rec.pool] = (live[rec.pool] or 0) + 1
    end
  end
end
return ret('ok', redis.call('SCARD', k('adapters')), redis.call('SCARD', k('draining')),
  redis.call('SCARD', k('tenants')), redis.call('HLEN', k('pins')),
  redis.call('HLEN', k('warm')), tonumber(redis.call('GET', k('desired')) or '0'), total, live)
""",
}

SCRIPTS: dict[str, str] = {name: _HELPERS + body for name, body in _BODIES.items()}
