"""Registry scripts for adapter demand: what replicas' requests use now (the autoscaling
share, and the hot adapters a new replica loads first, under prefetch claims) and claims
on warm-target copies (see `cluster.scripts`)."""

from __future__ import annotations

BODIES: dict[str, str] = {
    # ARGV: ns, id, epoch, name, in-flight requests, name, in-flight requests, ...
    # Replaces what id reported active before (names not given are no longer active there)
    # and returns, per given name in order, on how many live replicas of id's deployment
    # it is active now (this one included): the publisher's adapter share is the sum of
    # 1 / that count, and the autoscaler sums shares per deployment, so a copy in another
    # deployment (another pool) must not count.
    "report_active": r"""
local id, epoch = ARGV[2], ARGV[3]
local f = fence(id, epoch)
if f then return f end
local me = redis.call('HMGET', k('replica', id), 'pool', 'deployment')
local tag = '|' .. (me[1] or '') .. '|' .. (me[2] or '') .. '|' .. epoch
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
  redis.call('HSET', k('active', name), id, ARGV[i + 1] .. tag)
  redis.call('SADD', k('replica', id, 'active'), name)
  redis.call('SADD', k('active_names'), name)
  local n = 0
  for _, e in ipairs(live_entries(k('active', name))) do
    local _, _, deployment = split_active(e[2])
    if deployment == me[2] then n = n + 1 end
  end
  copies[#copies + 1] = n
end
return ret('ok', copies)
""",
    # ARGV: ns, id, epoch, claim_ms, name... (warm targets id does not hold in a GPU slot).
    # Grants id a claim on a name's next warm copy when live GPU copies in the target's
    # pools plus other replicas' unexpired claims (warm claims, and prefetch claims of
    # replicas in the target's pools: copies about to be loaded either way) are below the
    # target; a claim ends when it expires, when its replica's lease does, or when that
    # replica reports the copy (report_resident). One script, so concurrent replicas never
    # claim past the target. An unexpired claim of id's own (warm or prefetch) is granted
    # again (its load is retried), not extended. Returns the names granted.
    "claim_warm": r"""
local id, epoch = ARGV[2], ARGV[3]
local f = fence(id, epoch)
if f then return f end
local pool = redis.call('HGET', k('replica', id), 'pool') or ''
local now = now_ms()
local claim_ms = tonumber(ARGV[4])
local granted = {}
for i = 5, #ARGV do
  local name = ARGV[i]
  local raw = redis.call('HGET', k('warm'), name)
  local version = redis.call('HGET', k('adapter', name), 'version')
  local want, target_pool
  if raw then want, target_pool = string.match(raw, '^(%d+)|(.*)$') end
  if version and want and binds(target_pool, pool) then
    local gpu, n = {}, 0
    for _, loc in ipairs(locations(name, version)) do
      if loc[2] == 'gpu' and binds(target_pool, loc[3]) then
        gpu[loc[1]] = true
        n = n + 1
      end
    end
    local mine, claimed = false, {}
    for _, c in ipairs(live_entries(k('warm_claims', name))) do
      if tonumber(c[2]) > now and not gpu[c[1]] then claimed[c[1]] = true end
    end
    for _, c in ipairs(live_entries(k('prefetch_claims', name))) do
      if tonumber(c[2]) > now and not gpu[c[1]]
          and binds(target_pool, redis.call('HGET', k('replica', c[1]), 'pool') or '') then
        claimed[c[1]] = true
      end
    end
    for claimer in pairs(claimed) do
      if claimer == id then mine = true else n = n + 1 end
    end
    if not gpu[id] and (mine or n < tonumber(want)) then
      if not mine then
        local key = k('warm_claims', name)
        redis.call('HSET', key, id, (now + claim_ms) .. '|' .. epoch)
        if redis.call('PTTL', key) < claim_ms then redis.call('PEXPIRE', key, claim_ms) end
      end
      granted[#granted + 1] = name
    end
  end
end
return ret('ok', granted)
""",
    # ARGV: ns, id, epoch, limit, claim_ms. The active adapters id neither serves nor holds
    # in a GPU slot nor claimed for a warm copy, most requests in flight per copy first
    # (copies: live replicas where the adapter is active or GPU-resident, or that hold an
    # unexpired prefetch or warm claim on it; ties by name; requests and copies only on replicas whose pool overlaps id's,
    # so a prefill replica ranks by prefill demand and copies), at most limit of them:
    # what a new replica loads before traffic finds it. Each one returned gets a prefetch claim by id lasting claim_ms, so
    # replicas starting together spread over the hot adapters instead of all loading the
    # top ones (one script: each sees the claims of those ranked before it). Each row:
    # name, version, content_hash, path, rank, base_model, requests in flight, copies.
    # Draining adapters are left out. Reads every active adapter's entries: a new replica
    # runs it once, not every tick.
    "hot_adapters": r"""
local id, epoch = ARGV[2], ARGV[3]
local f = fence(id, epoch)
if f then return f end
local limit, claim_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local pool = redis.call('HGET', k('replica', id), 'pool') or ''
local pools = {}
local function near(replica)  -- whether replica's pool overlaps id's (memoized)
  if pools[replica] == nil then
    pools[replica] = overlaps(pool, redis.call('HGET', k('replica', replica), 'pool') or '')
  end
  return pools[replica]
end
local now = now_ms()
local rows = {}
for _, name in ipairs(redis.call('SMEMBERS', k('active_names'))) do
  local v = redis.call('HMGET', k('adapter', name), 'version', 'content_hash', 'path', 'rank',
    'base_model', 'state')
  if v[1] and v[6] ~= 'draining' then
    local on, copies, in_flight = {}, 0, 0
    for _, e in ipairs(live_entries(k('active', name))) do
      local n, p = split_active(e[2])
      if overlaps(pool, p) then
        on[e[1]] = true
        in_flight = in_flight + n
      end
    end
    for _, loc in ipairs(locations(name, v[1])) do
      if loc[2] == 'gpu' and overlaps(pool, loc[3]) then on[loc[1]] = true end
    end
    -- id's own prefetch claim (a retried call) is no copy: it would hide the adapter
    -- from id; its own warm claim is (it loads that copy anyway)
    for _, c in ipairs(live_entries(k('prefetch_claims', name))) do
      if c[1] ~= id and tonumber(c[2]) > now and near(c[1]) then on[c[1]] = true end
    end
    for _, c in ipairs(live_entries(k('warm_claims', name))) do
      if tonumber(c[2]) > now and (c[1] == id or near(c[1])) then on[c[1]] = true end
    end
    for _ in pairs(on) do copies = copies + 1 end
    if in_flight > 0 and not on[id] then
      rows[#rows + 1] = {name, v[1], v[2], v[3], v[4], v[5] or '', in_flight, copies}
    end
  end
end
table.sort(rows, function(a, b)
  local x, y = a[7] / math.max(1, a[8]), b[7] / math.max(1, b[8])
  if x ~= y then return x > y end
  return a[1] < b[1]
end)
local out = {}
for i = 1, math.min(limit, #rows) do
  out[i] = rows[i]
  local key = k('prefetch_claims', rows[i][1])
  redis.call('HSET', key, id, (now + claim_ms) .. '|' .. epoch)
  if redis.call('PTTL', key) < claim_ms then redis.call('PEXPIRE', key, claim_ms) end
end
return ret('ok', out)
""",
}
