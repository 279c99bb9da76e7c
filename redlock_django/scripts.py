"""The Lua scripts run on each Redis node, and nothing else.

A lock is one hash per node, so its holder metadata lives and dies with it:
``token`` (the random owner value), ``meta`` (JSON: host, pid, thread, label...),
and ``fence`` (the fencing token, when one was asked for). Every script declares all
the keys it touches in KEYS, so ACL key patterns apply to them.

Every script the lock runs reads the owner the same way (``_READ_OWNER``): a key of
another type counts as held by someone else, an ACL error is returned as the error it
is. The operator's forced release (``FORCE_RELEASE_SCRIPT``) compares a digest of the
token instead, and leaves anything unexpected alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = [
    "ACQUIRE_SCRIPT",
    "EXTEND_SCRIPT",
    "FENCE_SCRIPT",
    "FORCE_RELEASE_SCRIPT",
    "PTTL_SCRIPT",
    "RELEASE_SCRIPT",
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

# KEYS[1] lock key; KEYS[2] (optional) fencing counter key
# ARGV[1] token of this attempt, "<base>.<attempt>" (attempt k of one acquisition
# writes base.k); ARGV[2] lease in ms; ARGV[3] holder metadata (JSON)
# returns the fencing counter (0 when absent or not asked for) when it wrote ARGV[1]:
# the key was free, held ARGV[1] itself (a resent command), or held an earlier
# attempt of the same base (same base, lower attempt number): a leftover whose
# clean-up was lost, which must not block the next attempt. Returns -1, writing
# nothing, when any other token holds it: a later attempt of ours (a late ACQUIRE
# must not take a node a later attempt counted), another base, a token without an
# attempt number, or a foreign value. A counter that is not an integer is an
# error reply, checked before anything is written, so that node just votes no.
ACQUIRE_SCRIPT = Script(
    "acquire",
    """
local fence = 0
if KEYS[2] then
  fence = tonumber(redis.call('get', KEYS[2]) or '0')
  if not fence then
    return redis.error_reply('fencing counter ' .. KEYS[2] .. ' is not a number')
  end
end
"""
    + _READ_OWNER
    + """
if owner and owner ~= ARGV[1] then
  local base, attempt = string.match(ARGV[1], '^(.*)%.(%d+)$')
  local held, earlier = string.match(owner, '^(.*)%.(%d+)$')
  if not (base and held == base and tonumber(earlier) < tonumber(attempt)) then
    return -1
  end
end
redis.call('hset', KEYS[1], 'token', ARGV[1], 'meta', ARGV[3])
redis.call('pexpire', KEYS[1], ARGV[2])
return fence
""",
)

# KEYS[1] lock key
# ARGV[1] token; ARGV[2] (optional) release id, published on the channel named
# like the key so that waiters wake at once (see wake.py)
# returns 0 when the key held another token (it is never touched) or nothing;
# else deletes it and returns 1 + the number of subscribers that heard it. PUBLISH
# runs by pcall: an ACL user without channel rights still releases.
RELEASE_SCRIPT = Script(
    "release",
    """
"""
    + _READ_OWNER
    + """
if owner ~= ARGV[1] then
  return 0
end
local deleted = redis.call('del', KEYS[1])
if ARGV[2] then
  local heard = redis.pcall('publish', KEYS[1], ARGV[2])
  if type(heard) == 'number' then
    return deleted + heard
  end
end
return deleted
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

# KEYS[1] lock key
# ARGV[1] a prefix of the SHA1 of the token to evict (lowercase hex)
# returns 1 when the key held a token whose SHA1 starts with ARGV[1] and it was
# deleted, else 0: a lock that changed hands since the operator saw it, a key that
# is gone, or a value of another type is left alone. The fencing counter is not
# touched: it already covers the evicted holder's token on a quorum, so the next
# holder gets a greater one. Run by the listing's forced release (listing.py), not
# by the lock.
FORCE_RELEASE_SCRIPT = Script(
    "force_release",
    """
local token = redis.pcall('hget', KEYS[1], 'token')
if type(token) ~= 'string' then
  return 0
end
if string.sub(redis.sha1hex(token), 1, string.len(ARGV[1])) ~= ARGV[1] then
  return 0
end
return redis.call('del', KEYS[1])
""",
)
