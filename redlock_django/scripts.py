"""The Lua scripts run on each Redis node, and nothing else.

A lock is one hash per node, so its holder metadata lives and dies with it:
``token`` (the random owner value), ``meta`` (JSON: host, pid, thread, label...),
and ``fence`` (the fencing token, when one was asked for). Every script declares all
the keys it touches in KEYS, so ACL key patterns apply to them.

Every script the lock runs reads the owner the same way (``_READ_OWNER``): a key of
another type counts as held by someone else, an ACL error is returned as the error it
is. The operator's forced release (``FORCE_RELEASE_SCRIPT``) compares a digest of the
token instead, and leaves anything unexpected alone.

Numbers go to ``redis.call`` and into strings as ``string.format('%d', n)``: Redis
before 7.2 turns a Lua number argument into text with ``"%.17g"`` (about 2,400
instructions each under callgrind), and Lua's own concatenation uses ``"%.14g"``;
the fair lock's scripts pass some ten a call (``python -m benchmarks.scripts``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = [
    "ACQUIRE_SCRIPT",
    "DEQUEUE_SCRIPT",
    "ENQUEUE_SCRIPT",
    "EXTEND_SCRIPT",
    "FAIR_ACQUIRE_SCRIPT",
    "FENCE_SCRIPT",
    "FORCE_RELEASE_SCRIPT",
    "PTTL_SCRIPT",
    "QUEUED_RELEASE_SCRIPT",
    "RELEASE_SCRIPT",
    "WITHDRAW_SCRIPT",
    "Script",
]


@dataclass(frozen=True)
class Script:
    """A Lua source with its SHA1, so nodes can run it by EVALSHA."""

    name: str
    source: str = field(repr=False)
    sha: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()
        object.__setattr__(self, "sha", digest)


# The owner check every script starts with (Lua scripts cannot share functions
# under EVAL, so the source is shared here): ``owner`` is the token on the lock, or
# false when there is no lock; a key of another type (WRONGTYPE: not ours) reads as
# a foreign owner that no token equals; any other error (an ACL NOPERM, say) is
# returned as the error reply it is, so the node reports why instead of seeming busy.
_READ_OWNER = """
local owner = redis.pcall('hget', KEYS[1], 'token')
if type(owner) == 'table' then
  if string.sub(owner.err or '', 1, 9) ~= 'WRONGTYPE' then
    return owner
  end
  owner = ' foreign value'
end
"""


# The fencing counter check that ACQUIRE and FAIR_ACQUIRE start with: KEYS[n] is the
# counter (absent: no fencing); one that is not a non-negative integer is an error
# reply, given before anything is written (a negative one would make the reply
# look like a refusal, and token 0 like no fencing).
def _read_fence(n: int | str) -> str:
    counter = f"KEYS[{n}]" if isinstance(n, int) else n
    return f"""
local fence = 0
if {counter} then
  local raw = redis.call('get', {counter}) or '0'
  if not string.match(raw, '^%d+$') then
    return redis.error_reply('fencing counter ' .. {counter} .. ' is not a number')
  end
  fence = tonumber(raw)
end
"""


# Refuses (-1) a key held by any token but ours or an earlier attempt of ours.
_TAKE_OVER = """
if owner and owner ~= ARGV[1] then
  local base, attempt = string.match(ARGV[1], '^(.*)%.(%d+)$')
  local held, earlier = string.match(owner, '^(.*)%.(%d+)$')
  if not (base and held == base and tonumber(earlier) < tonumber(attempt)) then
    return -1
  end
end
"""


# Writes the lock; with a fencing counter (KEYS[n]) it raises it by one and records
# the new value on the lock. Returns that value (0 without fencing). GET and SET,
# not INCR: the app user's ACL of earlier versions has no INCR.
def _grant(n: int | str) -> str:
    counter = f"KEYS[{n}]" if isinstance(n, int) else n
    return f"""
if {counter} then
  fence = fence + 1
  local counted = string.format('%d', fence)
  redis.call('set', {counter}, counted)
  redis.call('hset', KEYS[1], 'token', ARGV[1], 'meta', ARGV[3], 'fence', counted)
else
  redis.call('hset', KEYS[1], 'token', ARGV[1], 'meta', ARGV[3])
end
redis.call('pexpire', KEYS[1], ARGV[2])
return fence
"""


# KEYS[1] lock key; KEYS[2] (optional) fencing counter key; last (with ARGV[4]) the
# lock's waiting list (``_WAITING``)
# ARGV[1] token of this attempt, "<base>.<attempt>" (attempt k of one acquisition
# writes base.k); ARGV[2] lease in ms; ARGV[3] holder metadata (JSON); ARGV[4]
# (optional) "<waiter id> <the list's life, ms> <1 once an earlier attempt of this
# waiter was refused, else 0> <its place on the list: its arrival, ms>", in one
# argument: a client that did not authenticate may send at most 10, and gets a
# clear NOAUTH for a command no longer than that (a longer one is a protocol error)
# returns the fencing counter after its increment (0 without fencing) when it wrote
# ARGV[1]: the key was free, held ARGV[1] itself (a resent command), or held an earlier
# attempt of the same base (same base, lower attempt number): a leftover whose
# clean-up was lost, which must not block the next attempt. Returns -1, writing
# nothing, when any other token holds it: a later attempt of ours (a late ACQUIRE
# must not take a node a later attempt counted), another base, a token without an
# attempt number, or a foreign value. A counter that is not an integer is an
# error reply, checked before anything is written, so that node just votes no.
# With a waiter id, a refusal also puts the waiter on the lock's waiting list (if
# not on it yet), so that a release wakes it by name, and a grant to a waiter that
# was refused before takes it off.
ACQUIRE_SCRIPT = Script(
    "acquire",
    """
local waiting = ARGV[4] and KEYS[#KEYS]
local counter = KEYS[2] ~= waiting and KEYS[2]
local waiter, life, listed, arrived
if waiting then
  waiter, life, listed, arrived = string.match(ARGV[4], '^(%S+) (%d+) ([01]) (%d+)$')
  if not waiter then
    return redis.error_reply('bad waiter ' .. ARGV[4])
  end
end
"""
    + _read_fence("counter")
    + _READ_OWNER
    + """
local function refuse()
  if waiting then
    -- Its arrival by its own clock, the same on every node, within 100 ms of
    -- this node's: a client whose clock is behind is not always first.
    local clock = redis.call('time')
    local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    local at = math.max(now - 100, math.min(now + 100, tonumber(arrived)))
    redis.pcall('zadd', waiting, 'NX', string.format('%d', at), waiter)
    redis.pcall('pexpire', waiting, life)
  end
  return -1
end
"""
    + _TAKE_OVER.replace("return -1", "return refuse()")
    + """
if waiting and listed == '1' then
  redis.pcall('zrem', waiting, waiter)
end
"""
    + _grant("counter"),
)

# The waiting list of a lock that is not fair: a sorted set of the ids of waiters
# whose attempt a node refused, by their arrival as the waiter gave it (the same
# on every node, so the nodes name the same first waiter; ties by id), held to
# within 100 ms of the node's clock. A
# release takes the first off and names it in its wake-up, on the lock's channel:
# each waiting process hears it, and only that waiter is woken. Defines
# ``wake_next(list, release id, channel)``, which returns the subscribers that heard
# (or an error table). Every command goes by pcall: an ACL user without them
# still releases, and its waiters are woken as before (one of each process).
_WAITING = """
local function wake_next(list, release, channel)
  local first = redis.pcall('zrange', list, '0', '0')
  if type(first) == 'table' and first[1] then
    redis.pcall('zrem', list, first[1])
    return redis.pcall('publish', channel, release .. ' ' .. first[1])
  end
  return redis.pcall('publish', channel, release)
end
"""

# The wait queue of a fair lock (fairness.py), on each node: ``queue`` is a sorted
# set of waiter ids by ticket (ties by id, as ZSETs order them), ``waiters`` the same
# ids by the node's own time (ms) at which the entry expires unless refreshed, and
# ``ticket`` the counter tickets are drawn from. Scripts that read the head first
# drop expired entries (at most 16 per call, so a script stays short):
# a waiter that died stops refreshing and loses its place within its entry's life.
_NOW_MS = """
local clock = redis.call('time')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""
# A fair lock's hand-off records (FAIR_ACQUIRE): one sorted set, every member
# "<waiter id>|<record>" at score 0, so a waiter's record is found by its id with a
# lexical range and removed with ZREM (the commands of the documented ACL user, which
# has no HDEL). Ids are hex and ":", so "<id>|" starts no other waiter's member.
_RECORDS = """
local function record_of(key, id)
  return redis.call('zrange', key, '[' .. id .. '|', '[' .. id .. '|\\255',
    'BYLEX', 'LIMIT', '0', '1')[1]
end
local function drop_record(key, id)
  local member = record_of(key, id)
  if member then
    redis.call('zrem', key, member)
  end
  return member
end
"""

# Needs ``now`` (``_NOW_MS``) and KEYS[q] and KEYS[w] named by the locals q and w;
# leaves ``head`` (or false). At most 16 expired entries are dropped per call (a
# bounded script); ``capped`` says entries were left unlooked at, so the queue's
# first live entry is not known: not "empty".
# A local h (or nil) names KEYS[h], the hand-off records: a dropped entry's goes too.
_LIVE_HEAD_AT_NOW = """
local head = false
local head_until = 0
local capped = true
for _ = 1, 16 do
  head = redis.call('zrange', KEYS[q], '0', '0')[1] or false
  if not head then capped = false break end
  local until_ms = tonumber(redis.call('zscore', KEYS[w], head) or '0')
  if until_ms > now then head_until = until_ms capped = false break end
  redis.call('zrem', KEYS[q], head)
  redis.call('zrem', KEYS[w], head)
  if h and KEYS[h] then
    drop_record(KEYS[h], head)
  end
  head = false
end
if capped and redis.call('zcard', KEYS[q]) == 0 then
  capped = false
end
"""
_LIVE_HEAD = _NOW_MS + _LIVE_HEAD_AT_NOW

# Publishes a wake-up that names the waiter ``member``: on its process's channel
# (``head`` followed by the tag of a ``<id>:<tag>`` member), so that no other
# process is disturbed, or on ``fallback`` (the lock key) for a member without a
# tag (an older client's) or no ``head``. By pcall: an ACL user without channel
# rights still releases. Returns the subscribers that heard it, or an error table.
_TELL = """
local function tell(member, message, head, fallback)
  local tag = string.match(member, ':(%x+)$')
  local channel = fallback
  if tag and head and head ~= '' then
    channel = head .. tag
  end
  return redis.pcall('publish', channel, message)
end
"""

# KEYS[1] queue; KEYS[2] waiters; KEYS[3] ticket counter; KEYS[4] (optional) the
# hand-off records (see FAIR_ACQUIRE), which lose the dropped entries' records too
# ARGV[1] waiter id; ARGV[2] ticket (0: draw one here); ARGV[3] entry life in ms;
# ARGV[4] (optional, "1") reply as a FAIR_ACQUIRE refusal does, {0, ticket, entries
# ahead, ms until the first entry expires unless refreshed}: a waiter behind
# another learns at each refresh that the first one still refreshes its entry.
# Otherwise returns the ticket the entry was written with. Drawing INCRs the
# counter; writing a given ticket raises the counter to at least it, so a later
# draw on this node comes after it. Expired entries are dropped first; the three
# keys expire a while after the last waiter stopped refreshing.
ENQUEUE_SCRIPT = Script(
    "enqueue",
    _NOW_MS
    + _RECORDS
    + """
local dead = redis.call('zrangebyscore', KEYS[2], '-inf', string.format('%d', now),
  'LIMIT', '0', '16')
if #dead > 0 then
  redis.call('zrem', KEYS[1], unpack(dead))
  redis.call('zrem', KEYS[2], unpack(dead))
  if KEYS[4] then
    for _, id in ipairs(dead) do
      drop_record(KEYS[4], id)
    end
  end
end
local ticket = tonumber(ARGV[2])
if ticket == 0 then
  ticket = redis.call('incr', KEYS[3])
elseif tonumber(redis.call('get', KEYS[3]) or '0') < ticket then
  redis.call('set', KEYS[3], string.format('%d', ticket))
end
local life = tonumber(ARGV[3])
redis.call('zadd', KEYS[1], string.format('%d', ticket), ARGV[1])
redis.call('zadd', KEYS[2], string.format('%d', now + life), ARGV[1])
local keep = string.format('%d', life * 4)
for i = 1, #KEYS do
  redis.call('pexpire', KEYS[i], keep)
end
if ARGV[4] == '1' then
  local first = redis.call('zrange', KEYS[1], '0', '0')[1]
  local left = tonumber(redis.call('zscore', KEYS[2], first) or '0') - now
  return {0, ticket, redis.call('zrank', KEYS[1], ARGV[1]), left}
end
return ticket
""",
)

# KEYS[1] queue; KEYS[2] waiters; KEYS[3] (optional) the lock key; KEYS[4]
# (optional, with KEYS[3]) the hand-off records
# ARGV[1] waiter id; ARGV[2] (with KEYS[3]) an id for the wake-up message; ARGV[3]
# (optional) the wake-up channels' head (see _TELL); ARGV[4] (optional) the
# waiter's token base followed by its dot
# returns 1 when the entry was there. A waiter that gives up leaves at once, so a
# fair queue does not wait out its entry. A lock a release handed to it (its token
# base, ARGV[4]) is deleted. One that was first in line while the lock is free (a
# release named it, or handed the lock to it, then it gave up) wakes the next live
# waiter the way a release would, or that waiter would sleep out its retry.
DEQUEUE_SCRIPT = Script(
    "dequeue",
    _NOW_MS
    + _TELL
    + _RECORDS
    + """
local q, w, h = 1, 2, 4
"""
    + _LIVE_HEAD_AT_NOW
    + """
local was_first = head == ARGV[1]
redis.call('zrem', KEYS[2], ARGV[1])
local left = redis.call('zrem', KEYS[1], ARGV[1])
if KEYS[4] then
  drop_record(KEYS[4], ARGV[1])
end
if KEYS[3] and ARGV[4] then
  local owner = redis.pcall('hget', KEYS[3], 'token')
  if type(owner) == 'string' and string.sub(owner, 1, #ARGV[4]) == ARGV[4] then
    redis.call('del', KEYS[3])
  end
end
if KEYS[3] and was_first and redis.call('pttl', KEYS[3]) == -2 then
"""
    + _LIVE_HEAD_AT_NOW
    + """
  if head then
    tell(head, ARGV[2] .. ' ' .. head, ARGV[3], KEYS[3])
  end
end
return left
""",
)

# As ACQUIRE, for a fair lock: KEYS[1] lock key; KEYS[2] queue; KEYS[3] waiters;
# KEYS[4] ticket counter; KEYS[5] hand-off records; KEYS[6] (optional) fencing
# counter; ARGV[1-3] as ACQUIRE; ARGV[4] waiter id; ARGV[5] entry life in ms, or 0;
# ARGV[6] (optional) its ticket; ARGV[7] (optional, "1") leave a hand-off record.
# A free key is granted only when the queue's first live entry is ARGV[4] or the
# queue is empty (not while more expired entries are ahead than one call drops);
# otherwise it writes no lock (not our turn: -2). A key held by an
# earlier attempt of ours (a release handed it to us, or a clean-up was lost) is
# ours to take over whatever the queue says: while two waiters' ticket draws race,
# a release may hand the lock to one that is second in line on another node's
# count a moment later, and neither could take it otherwise until it expired.
# A refusal returns {-1 or -2, the waiter's ticket (0: not queued here), how many
# entries are ahead of it (-1: not queued), the ms until the first entry expires
# unless refreshed}.
# With ARGV[5] > 0 it also queues the waiter, or refreshes its entry, as ENQUEUE
# does: with the ticket ARGV[6] when given (a waiter that has its place), else
# drawing one (or finding its entry, a resent command). A waiter's first attempt
# takes its place in the same round trip, and each later one keeps it fresh. With
# ARGV[7] a refusal that queues also records, by waiter id, what a release needs
# to hand the lock over: "<token>|<node ms>|<lease ms>|<f or ->|<metadata>" (this
# attempt's token, when this node refused it, the lease asked for, whether the
# waiter takes a fencing token, its holder metadata).
FAIR_ACQUIRE_SCRIPT = Script(
    "fair_acquire",
    _read_fence(6)
    + _NOW_MS
    + _RECORDS
    + """
local function refuse(code, head, head_until)
  local life = tonumber(ARGV[5])
  local moved = false
  local ticket = tonumber(redis.call('zscore', KEYS[2], ARGV[4]) or '0')
  if life > 0 then
    local mine = tonumber(ARGV[6] or '0')
    if mine > 0 then
      if ticket ~= mine then
        local drawn = string.format('%d', mine)
        redis.call('zadd', KEYS[2], drawn, ARGV[4])
        if tonumber(redis.call('get', KEYS[4]) or '0') < mine then
          redis.call('set', KEYS[4], drawn)
        end
        ticket = mine
        moved = true
      end
    elseif ticket == 0 then
      ticket = redis.call('incr', KEYS[4])
      redis.call('zadd', KEYS[2], string.format('%d', ticket), ARGV[4])
    end
    redis.call('zadd', KEYS[3], string.format('%d', now + life), ARGV[4])
    -- The three keys' lives are renewed together, to 4 x life, once what is left
    -- of the queue's falls below 3 x life (or it has none): one PTTL per refresh
    -- instead of three PEXPIREs.
    if redis.call('pttl', KEYS[2]) < life * 3 then
      for i = 2, 4 do
        redis.call('pexpire', KEYS[i], string.format('%d', life * 4))
      end
    end
  end
  if ARGV[7] == '1' and ticket > 0 then
    -- What a release needs to hand the lock to this attempt (QUEUED_RELEASE): a
    -- record rewritten by every refused attempt, so it names the last one. The
    -- new one is added before the old one goes: a waiter's only record never
    -- empties the key, which keeps its life.
    local had = record_of(KEYS[5], ARGV[4])
    if life > 0 or had then
      local fenced = KEYS[6] and 'f' or '-'
      local member = ARGV[4] .. '|' .. ARGV[1] .. '|' .. string.format('%d', now)
        .. '|' .. ARGV[2] .. '|' .. fenced .. '|' .. ARGV[3]
      redis.call('zadd', KEYS[5], '0', member)
      if had and had ~= member then
        redis.call('zrem', KEYS[5], had)
      end
    end
    -- Renewed as the queue's are: a new key (no record was there to drop), or
    -- what is left of its life below 3 x life.
    if life > 0 and (not had or redis.call('pttl', KEYS[5]) < life * 3) then
      redis.call('pexpire', KEYS[5], string.format('%d', life * 4))
    end
  end
  local rank = redis.call('zrank', KEYS[2], ARGV[4]) or -1
  local left = -1
  if head and head ~= ARGV[4] and not moved then
    -- The live head read before: this call wrote no entry ahead of it (a drawn
    -- ticket comes after every ticket on this node) and touched only our own.
    left = head_until - now
  else
    local first = redis.call('zrange', KEYS[2], '0', '0')[1]
    if first then
      left = tonumber(redis.call('zscore', KEYS[3], first) or '0') - now
    end
  end
  return {code, ticket, rank, left}
end
"""
    + _READ_OWNER
    + _TAKE_OVER.replace("return -1", "return refuse(-1)")
    + """
local q, w, h = 2, 3, 5
"""
    + _LIVE_HEAD_AT_NOW
    + """
if (capped or (head and head ~= ARGV[4])) and not owner then
  return refuse(-2, not capped and head, head_until)
end
"""
    + _grant(6),
)

# Deletes KEYS[1] when our token (ARGV[1]) holds it, leaving ``deleted``; else
# returns 0, touching nothing.
_DELETE_OURS = (
    _READ_OWNER
    + """
if owner ~= ARGV[1] then
  return 0
end
local deleted = redis.call('del', KEYS[1])"""
)

# As RELEASE, for a lock with a wait queue: KEYS[1] lock key; KEYS[2] queue;
# KEYS[3] waiters; KEYS[4] (optional) hand-off records; KEYS[5] (optional) fencing
# counter; ARGV[1] token; ARGV[2] release id; ARGV[3] the holder's waiter id;
# ARGV[4] the wake-up channels' head (see _TELL); ARGV[5] (with KEYS[4]: hand
# over) the holder's fencing token, or "-" for none.
# The holder's own entry leaves the queue whatever the key holds; when our token
# held the key, it is deleted and the release is published as "<release id>
# <first live waiter>" to that waiter's process (or the id alone on the lock's
# channel, nobody waiting): only that waiter is woken.
# Handing over: when that waiter left a record (FAIR_ACQUIRE) the lock is written
# for it first, with its token and metadata, for its lease or what is left of its
# queue entry if less, and the message adds "<attempt> <lease ms> <ms since the
# refusal> [<fencing token>]". A fenced waiter gets max(counter, ARGV[5]) + 1, and
# only from a fenced holder. If nobody heard the message (the waiter's process is
# gone) the lock is deleted again: a hand-off exists only where it was heard.
QUEUED_RELEASE_SCRIPT = Script(
    "queued_release",
    _TELL
    + _RECORDS
    + """
redis.call('zrem', KEYS[2], ARGV[3])
redis.call('zrem', KEYS[3], ARGV[3])
if KEYS[4] then
  drop_record(KEYS[4], ARGV[3])
end
"""
    + _DELETE_OURS
    + """
local q, w, h = 2, 3, 4
"""
    + _LIVE_HEAD
    + """
local heard
if head then
  local message = ARGV[2] .. ' ' .. head
  local handed = false
  local record = KEYS[4] and ARGV[5] and drop_record(KEYS[4], head)
  if record then
    local token, at, ask, fenced, meta = string.match(
      record, '^[^|]+|([^|]+)|(%d+)|(%d+)|([f-])|(.*)$')
    local attempt = token and string.match(token, '%.(%d+)$')
    local lease = 0
    if attempt then
      lease = math.min(tonumber(ask), head_until - now)
    end
    local fence = nil
    if lease > 0 and fenced == 'f' then
      local raw = KEYS[5] and ARGV[5] ~= '-' and redis.call('get', KEYS[5]) or '0'
      local had = tonumber(raw)
      if KEYS[5] and ARGV[5] ~= '-' and had and tonumber(ARGV[5]) then
        fence = math.max(had, tonumber(ARGV[5])) + 1
      else
        lease = 0
      end
    end
    if lease > 0 then
      if fence then
        fence = string.format('%d', fence)
        redis.call('set', KEYS[5], fence)
        redis.call('hset', KEYS[1], 'token', token, 'meta', meta, 'fence', fence)
      else
        redis.call('hset', KEYS[1], 'token', token, 'meta', meta)
      end
      lease = string.format('%d', lease)
      redis.call('pexpire', KEYS[1], lease)
      handed = true
      message = message .. ' ' .. attempt .. ' ' .. lease .. ' '
        .. string.format('%d', now - tonumber(at))
      if fence then
        message = message .. ' ' .. fence
      end
    end
  end
  heard = tell(head, message, ARGV[4], KEYS[1])
  if handed and (type(heard) ~= 'number' or heard == 0) then
    redis.call('del', KEYS[1])
  end
else
  heard = redis.pcall('publish', KEYS[1], ARGV[2])
end
if type(heard) == 'number' then
  return deleted + heard
end
return deleted
""",
)

# KEYS[1] lock key; KEYS[2] (optional) its waiting list (``_WAITING``)
# ARGV[1] token; ARGV[2] (optional) release id, published on the channel named
# like the key so that waiters wake at once (see wake.py), followed by the first
# waiter on the list (taken off it), if any: only that one is woken
# returns 0 when the key held another token (it is never touched) or nothing;
# else deletes it and returns 1 + the number of subscribers that heard it. PUBLISH
# runs by pcall: an ACL user without channel rights still releases.
RELEASE_SCRIPT = Script(
    "release",
    _WAITING
    + _DELETE_OURS
    + """
if ARGV[2] then
  local heard
  if KEYS[2] then
    heard = wake_next(KEYS[2], ARGV[2], KEYS[1])
  else
    heard = redis.pcall('publish', KEYS[1], ARGV[2])
  end
  if type(heard) == 'number' then
    return deleted + heard
  end
end
return deleted
""",
)

# KEYS[1] lock key; KEYS[2] its waiting list (``_WAITING``)
# ARGV[1] waiter id; ARGV[2] an id for the wake-up message
# returns 1. Takes a waiter that gives up off the list at once. When the lock is
# free, a release may have named this waiter, and the wake-up went with it: the
# next waiter is woken, as a release would, or it would sleep out its retry.
WITHDRAW_SCRIPT = Script(
    "withdraw",
    _WAITING
    + """
redis.pcall('zrem', KEYS[2], ARGV[1])
if redis.call('pttl', KEYS[1]) == -2 then
  wake_next(KEYS[2], ARGV[2], KEYS[1])
end
return 1
""",
)

# KEYS[1] lock key
# ARGV[1] token; ARGV[2] new lease in ms; ARGV[3] (optional) the extension's number
# in its hold (1, 2, ...), kept on the lock as ``ext``
# returns 1 when our token still held the key and its lease was reset, else 0. A key
# that expired is never re-created, so an extension cannot revive a lost lock. An
# extension numbered below the last one applied is refused (0): one delayed in the
# network must not replace a later lease with its own, maybe shorter, one.
EXTEND_SCRIPT = Script(
    "extend",
    """
"""
    + _READ_OWNER
    + """
if owner ~= ARGV[1] then
  return 0
end
if ARGV[3] then
  local applied = tonumber(redis.call('hget', KEYS[1], 'ext') or '0') or 0
  if tonumber(ARGV[3]) < applied then
    return 0
  end
  redis.call('hset', KEYS[1], 'ext', ARGV[3])
end
return redis.call('pexpire', KEYS[1], ARGV[2])
""",
)

# KEYS[1] lock key; KEYS[2] fencing counter key
# ARGV[1] token; ARGV[2] fencing token chosen by the client
# returns 1 when our token still holds the key: the counter is raised to at least
# ARGV[2] and the token recorded on the lock; else 0 and nothing is written.
FENCE_SCRIPT = Script(
    "fence",
    """
"""
    + _READ_OWNER
    + """
if owner ~= ARGV[1] then
  return 0
end
if tonumber(redis.call('get', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('set', KEYS[2], ARGV[2])
end
redis.call('hset', KEYS[1], 'fence', ARGV[2])
return 1
""",
)

# KEYS[1] lock key
# returns the key's remaining lease in ms; -2 when nobody holds it.
PTTL_SCRIPT = Script(
    "pttl",
    """
return redis.call('pttl', KEYS[1])
""",
)

# KEYS[1] lock key; KEYS[2], KEYS[3] (optional) the resource's wait queue and its
# waiters' expiries
# ARGV[1] a prefix of the SHA1 of the token to evict (lowercase hex); ARGV[2]
# (optional) the release id to publish; ARGV[3] (with the queue keys) the wake-up
# channels' head (see _TELL)
# returns 1 when the key held a token whose SHA1 starts with ARGV[1] and it was
# deleted, else 0: a lock that changed hands since the operator saw it, a key that
# is gone, or a value of another type is left alone. The fencing counter is not
# touched: it already covers the evicted holder's token on a quorum, so the next
# holder gets a greater one. The lock's waiters are woken as by a release: on the
# lock's channel, and a fair lock's first live waiter on its process's channel
# ("<release id> <waiter>", no hand-off). Run by the listing's forced release
# (listing.py), not by the lock.
FORCE_RELEASE_SCRIPT = Script(
    "force_release",
    _TELL
    + """
local token = redis.pcall('hget', KEYS[1], 'token')
if type(token) ~= 'string' then
  return 0
end
if string.sub(redis.sha1hex(token), 1, string.len(ARGV[1])) ~= ARGV[1] then
  return 0
end
local deleted = redis.call('del', KEYS[1])
if not ARGV[2] then
  return deleted
end
-- Wake the lock's waiters, as a release does (their channel is the key).
redis.pcall('publish', KEYS[1], ARGV[2])
if not (KEYS[3] and ARGV[3]) then
  return deleted
end
local q, w, h = 2, 3, nil
"""
    + _LIVE_HEAD
    + """
if head and string.match(head, ':(%x+)$') then
  tell(head, ARGV[2] .. ' ' .. head, ARGV[3], KEYS[1])
end
return deleted
""",
)
