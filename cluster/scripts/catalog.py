"""Registry scripts for the adapter catalog, tenants, API keys and grants (see
`cluster.scripts`)."""

from __future__ import annotations

BODIES: dict[str, str] = {
    # ARGV: ns, name, replace, owner, public ('1'/'0', '' = keep), content_hash, path,
    #       rank, base_model, target_modules (JSON), created, owner given ('1'/'0').
    # 'served' when name is the served base model's id (checked here, in the same script
    # as the write, so a cluster starting meanwhile cannot leave the adapter shadowed;
    # publish_served is its twin). A replace is a new version of the same adapter: owner
    # and public are kept unless given, and so are its grants. A draining name was
    # unregistered: registering it again makes a new adapter, so the old grants go (they
    # must not open it to old grantees).
    "register_adapter": r"""
local name, owner, public = ARGV[2], ARGV[4], ARGV[5]
if owner ~= '' and redis.call('EXISTS', k('tenant', owner)) == 0 then
  return ret('no_tenant', owner)
end
local served = redis.call('GET', k('served'))
if served and cjson.decode(served).model_id == name then return ret('served', name) end
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
    # ARGV: ns, model id, ServedBase JSON. Publishes the served base model unless an
    # adapter record (active or draining) holds its id: requests naming that adapter
    # would get the base model. Refused: ('exists', version, state), nothing written.
    # One script with register_adapter's served check: either one sees the other's write.
    "publish_served": r"""
local rec = redis.call('HMGET', k('adapter', ARGV[2]), 'version', 'state')
if rec[1] then return ret('exists', rec[1], rec[2]) end
redis.call('SET', k('served'), ARGV[3])
return ret('ok')
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
  k('tenant', tenant, 'key_created'), k('rate', tenant))
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
}
