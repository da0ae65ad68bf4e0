"""Redis registry backend (``redis`` package, imported here only).

Data model (prefix ``config.key_prefix``)::

    <p>stores            hash  store id -> JSON {address, free_blocks, pool_group, expires_at,
                               incarnation (hex)}
    <p>blk:<16 raw bytes> zset  incarnation (8 bytes, big-endian) + store id -> expires_at

Expiry times come from ``clock`` (wall-clock seconds by default, shared by all
processes using the same Redis). Ownership keys also get a Redis PEXPIRE of
``block_ttl_s`` so abandoned keys are garbage-collected by Redis itself, and a publish drops
the owners of each key it touches whose entry ran out; :meth:`RedisRegistry.sweep` (the
registry process runs it) drops the records of stores whose time ran out.
Redis failures raise :class:`RegistryUnavailableError` (a RemoteError), except in
``lookup`` and ``placement_targets``, which never raise on an outage: they log,
count (``failures``) and answer ``()`` per key / ``[]`` (a shorter answer).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from tiersync.net.registry.base import Registry, RegistryConfig, StoreInfo, check_keys, rank_targets
from tiersync.net.registry.errors import RegistryUnavailableError

log = logging.getLogger(__name__)


def _member(info: StoreInfo) -> bytes:
    """A store's member of a block's owner set: its incarnation, then its id."""
    return info.incarnation.to_bytes(8, "big") + info.store_id.encode()


def shown_url(url: str) -> str:
    """``url`` as logs and errors show it: a password in it (``user:password@`` up to the last
    ``@``, unescaped characters included, or a ``password=`` query parameter) replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, host = rest.rpartition("@")
        if at and ":" in userinfo:
            rest = f"{userinfo.partition(':')[0]}:***@{host}"
        url = f"{scheme}{sep}{rest}"
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url, flags=re.IGNORECASE)


_T = TypeVar("_T")


# Drops every record of KEYS[1] (the stores hash) whose expires_at <= ARGV[1]; a record that is
# not JSON or has no number there is left alone. Atomic: no register runs in between.
_SWEEP = """
local dropped = 0
local all = redis.call('HGETALL', KEYS[1])
local now = tonumber(ARGV[1])
for i = 1, #all, 2 do
  local ok, rec = pcall(cjson.decode, all[i + 1])
  if ok and type(rec) == 'table' then
    local at = tonumber(rec['expires_at'])
    if at ~= nil and at <= now then
      redis.call('HDEL', KEYS[1], all[i])
      dropped = dropped + 1
    end
  end
end
return dropped
"""

# A heartbeat in one step: refreshes KEYS[1][ARGV[1]] (free_blocks ARGV[3], expires_at ARGV[4])
# only while its record is there and live at ARGV[2] (a remove_store in between is not undone).
_HEARTBEAT = """
local blob = redis.call('HGET', KEYS[1], ARGV[1])
if not blob then return 0 end
local ok, rec = pcall(cjson.decode, blob)
if not ok or type(rec) ~= 'table' then return 0 end
local at = tonumber(rec['expires_at'])
if at == nil or at <= tonumber(ARGV[2]) then return 0 end
rec['free_blocks'] = tonumber(ARGV[3])
rec['expires_at'] = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(rec))
return 1
"""


class RedisRegistry(Registry):
    """:class:`Registry` over Redis at ``url`` (e.g. ``redis://127.0.0.1:6379/0``)."""

    def __init__(self, url: str, config: RegistryConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        import redis

        self.config = config or RegistryConfig()
        self._clock = clock
        self._url = shown_url(url)  # for messages only
        self._redis = redis.Redis.from_url(
            url, socket_timeout=self.config.rpc_timeout_s, socket_connect_timeout=self.config.rpc_timeout_s
        )
        self._errors = (redis.RedisError, OSError)
        self.failures = 0
        p = self.config.key_prefix.encode()
        self._stores_key, self._blk, self._once = p + b"stores", p + b"blk:", p + b"once:"
        self._sweep = self._redis.register_script(_SWEEP)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except self._errors as exc:
            raise RegistryUnavailableError(f"redis failed: {exc}", peer=self._url) from exc

    def _record(self, info: StoreInfo, expires_at: float) -> str:
        return json.dumps(
            {
                "address": info.address,
                "free_blocks": info.free_blocks,
                "pool_group": info.pool_group,
                "capacity_blocks": info.capacity_blocks,
                "expires_at": expires_at,
                "incarnation": f"{info.incarnation:x}",  # a string: Lua's numbers are doubles
            }
        )

    @staticmethod
    def _info(store_id: str, rec: dict[str, Any]) -> StoreInfo:
        incarnation = int(rec.get("incarnation", "0"), 16)
        return StoreInfo(
            store_id, rec["address"], rec["free_blocks"], rec["pool_group"], rec.get("capacity_blocks", 0), incarnation
        )

    def _parsed(self, sid: str, blob: bytes | str) -> tuple[StoreInfo, float] | None:
        """A store's record and its expiry, or None for a record that does not parse (Redis is
        shared: something else may have written it): skipped, never raised to a reader."""
        try:
            rec = json.loads(blob)
            return self._info(sid, rec), float(rec["expires_at"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # UsageError from StoreInfo too
            log.warning("registry record of store %r skipped: %r", sid, exc)
            return None

    def _live_stores(self) -> dict[str, StoreInfo]:
        raw = self._call(self._redis.hgetall, self._stores_key)
        now, out = self._clock(), {}
        for sid, blob in raw.items():
            sid = cast(bytes, sid).decode(errors="replace")  # bytes: the client does not decode responses
            parsed = self._parsed(sid, blob)
            if parsed is not None and parsed[1] > now:
                out[sid] = parsed[0]
        return out

    def register_store(self, info: StoreInfo) -> None:
        record = self._record(info, self._clock() + self.config.store_ttl_s)
        self._call(self._redis.hset, self._stores_key, info.store_id, record)

    def heartbeat(self, store_id: str, free_blocks: int) -> bool:
        now = self._clock()
        args = [store_id, repr(now), int(free_blocks), repr(now + self.config.store_ttl_s)]
        return bool(self._call(self._heartbeat, [self._stores_key], args))

    def remove_store(self, store_id: str) -> None:
        self._call(self._redis.hdel, self._stores_key, store_id)

    def get_store(self, store_id: str) -> StoreInfo | None:
        blob = self._call(self._redis.hget, self._stores_key, store_id)
        parsed = None if blob is None else self._parsed(store_id, blob)
        return None if parsed is None or parsed[1] <= self._clock() else parsed[0]

    def publish(self, store_id: str, keys: Sequence[bytes]) -> None:
        """As the memory registry: keys of a store that is not registered and live are ignored."""
        check_keys(keys)
        info = self.get_store(store_id)
        if info is None:
            return
        now, member = self._clock(), _member(info)
        expires, ttl_ms = now + self.config.block_ttl_s, int(self.config.block_ttl_s * 1000)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.zadd(self._blk + key, {member: expires})
            pipe.zremrangebyscore(self._blk + key, "-inf", repr(now))  # owners whose entry ran out
            pipe.pexpire(self._blk + key, ttl_ms)
        self._call(pipe.execute)

    def sweep(self) -> int:
        """Drop the records of stores whose time ran out (one atomic script: a store that
        re-registers meanwhile keeps its new record); returns how many went. Records that are not
        JSON or carry no expires_at number stay (readers skip them). Expired owners of a block go when it is
        published again, the block itself ``block_ttl_s`` after its last publish."""
        return int(self._call(self._sweep, [self._stores_key], [repr(self._clock())]))

    def unpublish(self, store_id: str, keys: Sequence[bytes]) -> None:
        """The current incarnation's entries (those of an earlier one are not reported, and run out)."""
        check_keys(keys)
        blob = self._call(self._redis.hget, self._stores_key, store_id)
        parsed = None if blob is None else self._parsed(store_id, blob)  # expired or not: its entries
        if parsed is None:
            return
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.zrem(self._blk + key, _member(parsed[0]))
        self._call(pipe.execute)

    def lookup(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        if not keys:
            return []
        now = self._clock()
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self._stores_key)
        for key in keys:
            pipe.zrangebyscore(self._blk + key, f"({now!r}", "+inf")
        try:
            results = self._call(pipe.execute)
        except RegistryUnavailableError as exc:
            self._degraded("lookup", exc)
            return [()] * len(keys)
        names = {sid.decode(errors="replace"): blob for sid, blob in results[0].items()}
        live = {
            _member(p[0]) for sid, blob in names.items() if (p := self._parsed(sid, blob)) is not None and p[1] > now
        }
        return [tuple(m[8:].decode() for m in members if m in live) for members in results[1:]]

    def placement_targets(self, pool_group: str, count: int, exclude: Sequence[str] = ()) -> list[StoreInfo]:
        try:
            live = self._live_stores().values()
        except RegistryUnavailableError as exc:
            self._degraded("targets", exc)
            return []
        return rank_targets(live, pool_group, count, exclude)

    def take_once(self, name: str, ttl_s: float) -> bool:
        key, ms = self._once + name.encode(), max(1, int(ttl_s * 1000))
        return bool(self._call(lambda: self._redis.set(key, b"1", nx=True, px=ms)))

    def ping(self) -> None:
        """RegistryUnavailableError unless Redis answers now."""
        self._call(self._redis.ping)

    def _degraded(self, what: str, exc: Exception) -> None:
        self.failures += 1
        log.warning("registry %s degraded: %s", what, exc)

    def close(self) -> None:
        self._redis.close()
