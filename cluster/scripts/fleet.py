"""Registry scripts for replicas and leases, residency, pins, warm targets, the
desired state and the listings (see `cluster.scripts`)."""

from __future__ import annotations

BODIES: dict[str, str] = {
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
drop_activity(id)
return ret('ok', e)
""",
    # ARGV: ns, id, epoch, ttl_ms
    "heartbeat": r"""
local f = fence(ARGV[2], ARGV[3])
if f then return f end
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
if f then return f end
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
-- a warm claim ends with the copy it was taken for (`claim_warm`)
if ARGV[6] == 'gpu' then
  redis.call('HDEL', k('warm_claims', name), id)
  redis.call('HDEL', k('prefetch_claims', name), id)
end
return ret('ok')
""",
    # ARGV: ns, id, epoch, name, version ('' = any), ref_key ('' = any content)
    "remove_resident": r"""
local id, name = ARGV[2], ARGV[4]
local f = fence(id, ARGV[3])
if f then return f end
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
