"""Store layer: the Redis tier's data in one Redis database shared by machines,
and the client that keeps it (``remote_tier`` adds back-off and backfill).

Values are the encoded entries (``format.encode``), byte for byte what the
disk tier holds, so a Redis hit is checked exactly like a disk hit. All keys
start with ``blend:``, so the store can share a database with other data:

    blend:chunk:<key>   the entry's bytes
    blend:lru           sorted set: key -> last access (a logical clock)
    blend:size          hash: key -> size of its value in bytes
    blend:bytes         sum of blend:size (the tier's footprint)
    blend:clock         the logical clock, INCR'd on every write and hit
    blend:record:<name> a record (``format.encode_record``): a plain value,
                        outside the index, the count and eviction


Size limit and eviction: Redis can only enforce ``maxmemory`` for the whole
server, so the store keeps its own byte count. Every write and every hit runs
one Lua script, atomic in Redis, that updates the value, the recency index and
the byte count together, and a write then evicts least recently used entries
until the footprint fits the writer's limit (never the entry just written).
Several processes and machines can therefore write at once without the count
drifting or the footprint overshooting, and a writer killed mid-command
leaves nothing behind: Redis runs a command only once it has received all of
it. The clock is a counter in Redis, not wall time, so machines with skewed
clocks agree on the order. The count covers value bytes, not Redis's
per-key overhead (about 100 bytes against entries of megabytes).

If a value disappears behind the store's back (``DEL`` by hand, Redis's own
``maxmemory`` eviction), the next hit on it, or its eviction, removes it from
the index using the size recorded there, so the count stays right.

The scripts touch value keys they do not declare (the ones they evict), which
a single Redis server allows and Redis Cluster does not: this tier is for a
single server (or a primary with replicas), not a cluster.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

PREFIX = "blend:"
VALUE_PREFIX = PREFIX + "chunk:"
RECORD_PREFIX = PREFIX + "record:"
LRU, SIZES, TOTAL, CLOCK = (PREFIX + name for name in ("lru", "size", "bytes", "clock"))
SCHEMES = ("redis", "rediss", "unix")

# Lua helper shared by the scripts: forget one entry (value, index, count).
# KEYS[1..3] are always LRU, SIZES, TOTAL.
_FORGET = """
local function forget(member)
  redis.call('UNLINK', ARGV[1] .. member)
  redis.call('ZREM', KEYS[1], member)  -- unconditionally: eviction loops on ZRANGE
  local size = redis.call('HGET', KEYS[2], member)
  if size then
    redis.call('HDEL', KEYS[2], member)
    redis.call('DECRBY', KEYS[3], size)
  end
end
"""

# KEYS: LRU, SIZES, TOTAL, CLOCK, value key; ARGV: value prefix, member, data, limit (-1: none)
_PUT = (
    _FORGET
    + """
local member, size, limit = ARGV[2], string.len(ARGV[3]), tonumber(ARGV[4])
local old = tonumber(redis.call('HGET', KEYS[2], member) or 0)
redis.call('SET', KEYS[5], ARGV[3])
redis.call('HSET', KEYS[2], member, size)
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), member)
local total = redis.call('INCRBY', KEYS[3], size - old)
while limit >= 0 and total > limit do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not oldest or oldest == member then break end
  forget(oldest)
  total = tonumber(redis.call('GET', KEYS[3]))
end
return total
"""
)

# KEYS: LRU, SIZES, TOTAL, CLOCK, value key; ARGV: value prefix, member
_GET = (
    _FORGET
    + """
local data = redis.call('GET', KEYS[5])
if data then
  redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[4]), ARGV[2])
  return data
end
forget(ARGV[2])  -- gone behind our back: keep the index and the count right
return false
"""
)

# KEYS: LRU, CLOCK; ARGV: member (a read in parts, with GETRANGE, ends with this)
_TOUCH = """
redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), ARGV[1])
return 0
"""

# KEYS: LRU, SIZES, TOTAL; ARGV: value prefix, members...
_FORGET_ALL = (
    _FORGET
    + """
for i = 2, #ARGV do forget(ARGV[i]) end
return 0
"""
)

# KEYS: record key; ARGV: the bytes it must still hold to be deleted
_DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: LRU, SIZES, TOTAL, CLOCK; ARGV: value prefix
_CLEAR = """
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  redis.call('UNLINK', ARGV[1] .. member)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return 0
"""


def redact(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: the one before
    the host and a ``password=`` query argument (redis-py takes both)."""
    url = re.sub(r"([?&]password=)[^&#]*", r"\1***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class RedisClient:
    """The store's operations on one Redis database. Errors (connection,
    timeout, Redis replies) are raised as they are; ``RemoteTier`` decides
    what they mean. ``errors`` is the tuple of exception types to catch."""

    def __init__(self, url: str, *, size_limit_bytes: int | None, timeout_s: float) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
            shown = redact(url) if isinstance(url, str) else url
            raise ValueError(f"remote must be a redis://, rediss:// or unix:// URL, got {shown!r}")
        db = urlsplit(url).path.strip("/")
        if urlsplit(url).scheme != "unix" and db and not db.isdigit():
            # redis-py would silently use database 0
            raise ValueError(f"bad Redis URL {redact(url)!r}: the path must be a database number, got {db!r}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(
                "ChunkStore(remote=...) needs the redis package: pip install 'blend_integrations[redis]'"
            ) from e
        self.url = url
        self.size_limit_bytes = size_limit_bytes
        self.errors = (redis.RedisError, OSError)
        self._options = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # No retries inside redis-py: a down or slow server must cost one
            # timeout, and RemoteTier backs off after a failure anyway.
            retry=Retry(NoBackoff(), 0),
        )
        try:
            self._connect()
        except ValueError as e:
            raise ValueError(f"bad Redis URL {redact(url)!r}: {e}") from None

    def _connect(self) -> None:
        """A new client (it connects on first use) and its scripts."""
        import redis

        self._client = redis.Redis.from_url(self.url, **self._options)
        self._scripts = {
            name: self._client.register_script(text)
            for name, text in (
                ("put", _PUT),
                ("get", _GET),
                ("touch", _TOUCH),
                ("forget", _FORGET_ALL),
                ("clear", _CLEAR),
                ("delete_if", _DELETE_IF),
            )
        }

    def get(self, key: str) -> bytes | None:
        """The stored bytes of ``key`` (its recency bumped), or None."""
        return self._scripts["get"](keys=[LRU, SIZES, TOTAL, CLOCK, VALUE_PREFIX + key], args=[VALUE_PREFIX, key])

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, then evict down to the size limit."""
        limit = -1 if self.size_limit_bytes is None else self.size_limit_bytes
        self._scripts["put"](keys=[LRU, SIZES, TOTAL, CLOCK, VALUE_PREFIX + key], args=[VALUE_PREFIX, key, data, limit])

    def delete(self, key: str) -> None:
        self._scripts["forget"](keys=[LRU, SIZES, TOTAL], args=[VALUE_PREFIX, key])

    def getrange(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (inclusive) of ``key``'s value; fewer
        (or none) if it is shorter (or gone)."""
        return self._client.getrange(VALUE_PREFIX + key, start, end)

    def touch(self, key: str) -> None:
        """Count a use of ``key`` (its recency), as a ``get`` does."""
        self._scripts["touch"](keys=[LRU, CLOCK], args=[key])

    def size(self, key: str) -> int:
        """Bytes stored under ``key``; 0 if there is none."""
        return int(self._client.strlen(VALUE_PREFIX + key))

    def get_record(self, name: str) -> bytes | None:
        """The stored bytes of record ``name``, or None."""
        return self._client.get(RECORD_PREFIX + name)

    def put_record(self, name: str, data: bytes) -> None:
        self._client.set(RECORD_PREFIX + name, data)

    def delete_record(self, name: str, only: bytes | None = None) -> None:
        """Remove record ``name``; with ``only``, only if it still holds
        those bytes (atomically: a record rewritten meanwhile stays)."""
        if only is None:
            self._client.delete(RECORD_PREFIX + name)
        else:
            self._scripts["delete_if"](keys=[RECORD_PREFIX + name], args=[only])

    def clear(self) -> None:
        """Remove every ``blend:`` key: the indexed entries atomically (so a
        concurrent write keeps the count right), then any stray value, and
        the records."""
        self._scripts["clear"](keys=[LRU, SIZES, TOTAL, CLOCK], args=[VALUE_PREFIX])
        for prefix in (VALUE_PREFIX, RECORD_PREFIX):
            batch = []
            for name in self._client.scan_iter(match=prefix + "*", count=1000):
                batch.append(name)
                if len(batch) == 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

    def close(self) -> None:
        """Close the pool's connections; a later call opens new ones."""
        self._client.close()

    def reset_after_fork(self) -> None:
        """In a forked child: a new client. The parent's sockets must not be
        used (or shut down) here; redis-py's pool leaves them alone."""
        self._connect()
