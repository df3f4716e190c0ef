"""The Lua scripts of ``RedisQuotaStore`` (kept in Python so every packaging of the platform ships them).
The arithmetic is ``gcra.py``'s, in microseconds; ``memory_store.py`` mirrors ``ACQUIRE`` line by line."""

ACQUIRE = r"""
-- loraplex quota check: one round trip, all-or-nothing (see gcra.py for the arithmetic; times in microseconds).
-- KEYS: 1 requests tat, 2 tokens tat, 3 leases (zset: lease id -> expiry), 4 day budget prefix (":<day>" appended)
-- ARGV: 1 request interval (0 = off), 2 request burst, 3 token interval (0 = off), 4 token burst, 5 cost (tokens),
--       6 max concurrency (0 = off), 7 lease id, 8 lease ttl, 9 tokens per day (0 = off)
-- Returns {reason (0 = allowed), retry_after, req_remaining, req_reset, tok_remaining, tok_reset, day}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local req_T, req_B = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_T, tok_B = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local max_conc, lease_id, ttl = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local day_limit = tonumber(ARGV[9])
local day = math.floor(now / 86400000000)
local day_key = KEYS[4] .. ':' .. day

local function gcra(key, T, B, n)
  local tat = tonumber(redis.call('GET', key))
  local base = now
  if tat and tat > now then base = tat end
  local tau = B * T
  local new_tat = base + n * T
  local excess = new_tat - now - tau
  if excess > 0.001 then
    return false, base, excess, math.max(0, math.floor((tau - (base - now)) / T + 1e-6)), base - now
  end
  return true, new_tat, 0, math.max(0, math.floor((tau - (new_tat - now)) / T + 1e-6)), new_tat - now
end

local reason, retry = 0, 0
local function deny(code, wait)
  if reason == 0 then reason = code end
  if wait > retry then retry = wait end
end

if tok_T > 0 and cost > tok_B then
  return {5, 0, -1, 0, -1, 0, day}
end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)  -- leases of dead holders
  if redis.call('ZCARD', KEYS[3]) >= max_conc then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    deny(3, math.min(1000000, tonumber(first[2]) - now))
  end
end
local req_ok, req_tat, req_wait, req_rem, req_reset = true, 0, 0, -1, 0
if req_T > 0 then
  req_ok, req_tat, req_wait, req_rem, req_reset = gcra(KEYS[1], req_T, req_B, 1)
  if not req_ok then deny(1, req_wait) end
end
local tok_ok, tok_tat, tok_wait, tok_rem, tok_reset = true, 0, 0, -1, 0
if tok_T > 0 then
  tok_ok, tok_tat, tok_wait, tok_rem, tok_reset = gcra(KEYS[2], tok_T, tok_B, cost)
  if not tok_ok then deny(2, tok_wait) end
end
if day_limit > 0 then
  local used = tonumber(redis.call('GET', day_key)) or 0
  if used + cost > day_limit then deny(4, (day + 1) * 86400000000 - now) end
end
if reason ~= 0 then
  return {reason, retry, req_rem, req_reset, tok_rem, tok_reset, day}
end

if req_T > 0 then
  redis.call('SET', KEYS[1], string.format('%.0f', req_tat), 'PX', math.ceil((req_tat - now) / 1000) + 1000)
end
if tok_T > 0 and cost > 0 then
  redis.call('SET', KEYS[2], string.format('%.0f', tok_tat), 'PX', math.ceil((tok_tat - now) / 1000) + 1000)
end
if max_conc > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, lease_id)
  local keep_ms = math.ceil(ttl / 1000) + 1000
  if redis.call('PTTL', KEYS[3]) < keep_ms then redis.call('PEXPIRE', KEYS[3], keep_ms) end
end
if day_limit > 0 and cost > 0 then
  redis.call('INCRBY', day_key, cost)
  redis.call('EXPIRE', day_key, 172800)
end
return {0, 0, req_rem, req_reset, tok_rem, tok_reset, day}
"""

FINISH = r"""
-- loraplex quota finish: refund unused tokens (or charge tokens used past the reservation) and release the lease in
-- one round trip. Idempotent, so a release
-- retried after a timeout (Redis stalled; the first attempt may or may not have run) never refunds twice: when a
-- lease is named, its tokens are refunded only by the call that removed it.
-- KEYS: 1 tokens tat, 2 leases, 3 day budget key (or "" when none)
-- ARGV: 1 token interval (0 = off), 2 tokens to refund (< 0: to charge), 3 lease id (or ""), 4 lease ttl (renew
--       when > 0)
-- Returns 1 if the lease existed (released or renewed), else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tok_T, units, lease_id, renew_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
if lease_id ~= '' and renew_ttl > 0 then
  local expiry = tonumber(redis.call('ZSCORE', KEYS[2], lease_id))
  if not expiry then return 0 end
  if expiry <= now then  -- expired before its holder renewed it: gone
    redis.call('ZREM', KEYS[2], lease_id)
    return 0
  end
  redis.call('ZADD', KEYS[2], 'XX', now + renew_ttl, lease_id)
  return 1
end
local removed = 0
if lease_id ~= '' then removed = redis.call('ZREM', KEYS[2], lease_id) end
-- units > 0: a refund (never below now: a full bucket holds no credit); units < 0: a charge of -units tokens used
-- past the reservation (no check; later requests wait for them)
if units ~= 0 and (lease_id == '' or removed == 1) then
  if tok_T > 0 then
    local tat = tonumber(redis.call('GET', KEYS[1]))
    if units < 0 and (not tat or tat < now) then tat = now end
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
return removed
"""
