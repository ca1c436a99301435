"""The Lua scripts of ``RedisStore``: each runs atomically in Redis, so a check and the
write it guards cannot interleave with another router's.

Keys (``ns`` the namespace): ``ns:meta`` (hash: ``epoch``, the marker a restarted-empty
Redis lacks; ``space``, the key space), ``ns:slots`` (hash: slot -> ``"<state> <deadline ms>
<sidecar>"``, state ``loading``, ``live`` or ``dead``), ``ns:free`` (sorted set of reusable
slots), ``ns:next`` (the next new slot), ``ns:sc:<sidecar>`` (hash: ``slot``,
``generation``, ``last_seq``: the sidecar's cursor) and ``ns:b:<32-byte key>`` (the block's
holder mask as a bit string; member bit j at bit offset ``8 * (j // 8) + 7 - j % 8``, so
that ``int.from_bytes(value, "little")`` is the mask).

Deadlines are Redis's clock (``TIME``), so routers on other hosts agree on them.
"""

from __future__ import annotations

#: The scripts ``RedisStore`` registers, by name.
SCRIPTS = (
    "BIND",
    "CLAIM",
    "WRITE",
    "ACTIVATE",
    "APPLY",
    "RENEW",
    "SWEEP_BEGIN",
    "SWEEP_KEYS",
    "SWEEP_END",
    "UNLOCK",
)

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: KEYS: meta. ARGV: new epoch, key space JSON. Creates the marker and the key space unless
#: present; returns {epoch, key space}.
BIND = """
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[1])
redis.call('HSETNX', KEYS[1], 'space', ARGV[2])
return redis.call('HMGET', KEYS[1], 'epoch', 'space')
"""

#: KEYS: slots, free, next. ARGV: sidecar, lease ms, max slots. A fresh slot in state
#: ``loading`` (the lowest free one, else a new one); -1 when all ``max slots`` are taken;
#: -3 when the slot has a record already (``ns:next`` or ``ns:free`` was lost, e.g. evicted:
#: the router's Redis needs ``maxmemory-policy noeviction``); that slot is then skipped, so a
#: retry claims another.
CLAIM = (
    _NOW
    + """
local popped = redis.call('ZPOPMIN', KEYS[2])
local slot
if #popped > 0 then
  slot = tonumber(popped[1])
else
  slot = redis.call('INCR', KEYS[3]) - 1
  if slot >= tonumber(ARGV[3]) then
    redis.call('DECR', KEYS[3])
    return -1
  end
end
if redis.call('HEXISTS', KEYS[1], slot) == 1 then
  return -3
end
redis.call('HSET', KEYS[1], slot, 'loading ' .. (now + tonumber(ARGV[2])) .. ' ' .. ARGV[1])
return slot
"""
)

#: KEYS: slots, then the block keys. ARGV: slot, sidecar, lease ms, then (bit offset, count)
#: pairs, one per run of keys. Sets the bits while the slot is still this sidecar's load
#: (renewing its lease); 0 (nothing written) once it is not, e.g. reclaimed after a stall.
WRITE = (
    _NOW
    + """
local rec = redis.call('HGET', KEYS[1], ARGV[1]) or ''
local head = string.match(rec, '^loading %d+ ')
if not head or rec ~= head .. ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], 'loading ' .. (now + tonumber(ARGV[3])) .. ' ' .. ARGV[2])
local k = 2
for i = 4, #ARGV, 2 do
  local offset = tonumber(ARGV[i])
  for j = k, k + tonumber(ARGV[i + 1]) - 1 do
    redis.call('SETBIT', KEYS[j], offset, 1)
  end
  k = k + tonumber(ARGV[i + 1])
end
return 1
"""
)

#: KEYS: slots, the sidecar's cursor. ARGV: slot, sidecar, generation, last_seq, lease ms,
#: and for an ``all_blocks_cleared`` the cursor it follows (slot, generation). Makes a loaded
#: slot the sidecar's and its previous slot dead (its bits stop counting now; ``SWEEP_KEYS``
#: clears them later). Returns the previous slot (-1: none), -2 when the slot is no longer
#: this sidecar's load, or -3 when the stored cursor is not the one the clear follows (another
#: router moved it: another slot or generation, or already at or past the clear); the
#: claimed slot is then dead.
ACTIVATE = (
    _NOW
    + """
local rec = redis.call('HGET', KEYS[1], ARGV[1]) or ''
local head = string.match(rec, '^loading %d+ ')
if not head or rec ~= head .. ARGV[2] then
  return -2
end
local cur = redis.call('HMGET', KEYS[2], 'slot', 'generation', 'last_seq')
if ARGV[6] and (cur[1] ~= ARGV[6] or cur[2] ~= ARGV[7]
    or tonumber(cur[3]) >= tonumber(ARGV[4])) then
  redis.call('HSET', KEYS[1], ARGV[1], 'dead 0 ' .. ARGV[2])
  return -3
end
local old = cur[1]
if old and old ~= ARGV[1] and redis.call('HEXISTS', KEYS[1], old) == 1 then
  redis.call('HSET', KEYS[1], old, 'dead 0 ' .. ARGV[2])
end
redis.call('HSET', KEYS[1], ARGV[1], 'live ' .. (now + tonumber(ARGV[5])) .. ' ' .. ARGV[2])
redis.call('HSET', KEYS[2], 'slot', ARGV[1], 'generation', ARGV[3], 'last_seq', ARGV[4])
return tonumber(old or -1)
"""
)

#: KEYS: the sidecar's cursor, then the block keys. ARGV: slot, generation, then per op
#: (seq, 1 stored / 0 removed, bit offset, count). Applies the ops above the stored
#: last_seq; returns {'ok', last_seq}, {'stale'} (another cursor or none) or {'gap', last_seq}.
#: A removal that leaves a mask empty deletes its key.
APPLY = """
local cur = redis.call('HMGET', KEYS[1], 'slot', 'generation', 'last_seq')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then
  return {'stale'}
end
local last = tonumber(cur[3])
if #ARGV >= 3 and tonumber(ARGV[3]) > last + 1 then
  return {'gap', last}
end
local k = 2
for i = 3, #ARGV, 4 do
  local seq, n = tonumber(ARGV[i]), tonumber(ARGV[i + 3])
  if seq > last then
    local offset = tonumber(ARGV[i + 2])
    if ARGV[i + 1] == '1' then
      for j = k, k + n - 1 do
        redis.call('SETBIT', KEYS[j], offset, 1)
      end
    else
      for j = k, k + n - 1 do
        if redis.call('EXISTS', KEYS[j]) == 1
            and redis.call('SETBIT', KEYS[j], offset, 0) == 1
            and redis.call('BITCOUNT', KEYS[j]) == 0 then
          redis.call('DEL', KEYS[j])
        end
      end
    end
    last = seq
  end
  k = k + n
end
redis.call('HSET', KEYS[1], 'last_seq', last)
return {'ok', last}
"""

#: KEYS: slots. ARGV: lease ms, the cursor key prefix (``ns:sc:``), then sidecars. Renews
#: the lease of the live slot each sidecar's stored cursor points at, whichever router loaded
#: it; returns the sidecars with no live cursor (swept after a lapsed lease, or never loaded):
#: their followers must load again.
RENEW = (
    _NOW
    + """
local missing = {}
for i = 3, #ARGV do
  local slot = redis.call('HGET', ARGV[2] .. ARGV[i], 'slot')
  local rec = slot and redis.call('HGET', KEYS[1], slot) or ''
  local head = string.match(rec, '^live %d+ ')
  if head and rec == head .. ARGV[i] then
    redis.call('HSET', KEYS[1], slot, 'live ' .. (now + tonumber(ARGV[1])) .. ' ' .. ARGV[i])
  else
    table.insert(missing, ARGV[i])
  end
end
return missing
"""
)

#: KEYS: slots. ARGV: the cursor key prefix (``ns:sc:``). Marks dead the slots whose lease
#: ran out (a load that stalled, a sidecar no router followed for a lease), dropping the
#: cursor of an expired live slot; returns every dead slot.
SWEEP_BEGIN = (
    _NOW
    + """
local all = redis.call('HGETALL', KEYS[1])
local dead = {}
for i = 1, #all, 2 do
  local slot, rec = all[i], all[i + 1]
  local state, deadline, name = string.match(rec, '^(%S+) (%d+) (.*)$')
  if state ~= 'dead' and tonumber(deadline) < now then
    if state == 'live' and redis.call('HGET', ARGV[1] .. name, 'slot') == slot then
      redis.call('DEL', ARGV[1] .. name)
    end
    redis.call('HSET', KEYS[1], slot, 'dead 0 ' .. name)
    state = 'dead'
  end
  if state == 'dead' then
    table.insert(dead, slot)
  end
end
return dead
"""
)

#: Sweep scripts first check that this router still holds the sweep lock (``ns:sweeping``,
#: its token): one whose lock ran out mid-scan, or whose Redis restarted empty, stops.
_LOCKED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
"""

#: KEYS: the lock, slots, then block keys. ARGV: lock token, lock ms, the slot width (bits),
#: then the dead slots of ``SWEEP_BEGIN``. Extends the lock; clears the bits of those slots
#: that are still dead now (one freed and claimed again since, by a new load, keeps its bits),
#: trims trailing zero bytes, deletes masks left empty; returns how many keys changed, or -1
#: (nothing done) when the lock is not this sweep's.
SWEEP_KEYS = (
    _LOCKED
    + """
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local width = tonumber(ARGV[3])
local keep = {}
for i = 4, #ARGV do
  local rec = redis.call('HGET', KEYS[2], ARGV[i])
  if rec and string.sub(rec, 1, 5) == 'dead ' then
    local slot = tonumber(ARGV[i])
    for b = slot * width, (slot + 1) * width - 1 do
      local p = math.floor(b / 8) + 1
      for q = #keep + 1, p do
        keep[q] = 255
      end
      keep[p] = bit.band(keep[p], bit.bnot(bit.lshift(1, b % 8)))
    end
  end
end
local changed = 0
for n = 3, #KEYS do
  local key = KEYS[n]
  local v = redis.call('GET', key)
  if v then
    local bytes = {string.byte(v, 1, #v)}
    local dirty = false
    for p = 1, math.min(#v, #keep) do
      local b = bit.band(bytes[p], keep[p])
      if b ~= bytes[p] then
        bytes[p] = b
        dirty = true
      end
    end
    if dirty then
      changed = changed + 1
      local last = #bytes
      while last > 0 and bytes[last] == 0 do
        last = last - 1
      end
      if last == 0 then
        redis.call('DEL', key)
      else
        redis.call('SET', key, string.char(unpack(bytes, 1, last)))
      end
    end
  end
end
return changed
"""
)

#: KEYS: the lock, slots, free. ARGV: lock token, then the slots swept. Frees those still
#: dead; -1 (nothing freed) when the lock is not this sweep's.
SWEEP_END = (
    _LOCKED
    + """
for i = 2, #ARGV do
  local rec = redis.call('HGET', KEYS[2], ARGV[i])
  if rec and string.sub(rec, 1, 5) == 'dead ' then
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('ZADD', KEYS[3], ARGV[i], ARGV[i])
  end
end
return 0
"""
)

#: KEYS: the lock. ARGV: lock token. Releases the lock if it is still this sweep's.
UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
