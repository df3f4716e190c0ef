-- loraplex quota finish: refund unused tokens and release the lease in one round trip.
-- KEYS: 1 tokens tat, 2 leases, 3 day budget key (or "" when none)
-- ARGV: 1 token interval (0 = off), 2 tokens to refund, 3 lease id (or ""), 4 lease ttl (renew when > 0)
-- Returns 1 if the lease existed (released or renewed), else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tok_T, units, lease_id, renew_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
if units > 0 then
  if tok_T > 0 then
    local tat = tonumber(redis.call('GET', KEYS[1]))
    if tat then
      local new_tat = math.max(tat - units * tok_T, now)
      if new_tat <= now then
        redis.call('DEL', KEYS[1])
      else
        redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1000)
      end
    end
  end
  if KEYS[3] ~= '' and redis.call('EXISTS', KEYS[3]) == 1 then
    local left = redis.call('DECRBY', KEYS[3], units)
    if left < 0 then redis.call('SET', KEYS[3], 0, 'KEEPTTL') end
  end
end
if lease_id == '' then return 0 end
if renew_ttl > 0 then
  return redis.call('ZADD', KEYS[2], 'XX', 'CH', now + renew_ttl, lease_id)
end
return redis.call('ZREM', KEYS[2], lease_id)
