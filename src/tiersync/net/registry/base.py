"""The registry interface, its config and the store record."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tiersync.errors import UsageError
from tiersync.net.config import coerce_token
from tiersync.net.tls import TlsConfig

KEY_SIZE = 16


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Registry timing and limits (seconds, counts).

    ``heartbeat_interval_s``: how often stores should heartbeat (default 300).
    ``store_ttl_s``: a store not heard from for this long is dead (its blocks
    are no longer reported). ``block_ttl_s``: an ownership entry not re-published
    for this long expires. ``batch_size``: most keys per lookup call over the
    wire. ``rpc_timeout_s``: deadline of one gRPC call. ``token``: the gRPC registry's
    shared secret (str or bytes, >= 16 bytes; stored as bytes): a server given one refuses
    every call that does not prove it, a client proves it on every call
    (:mod:`tiersync.net.registry.auth`); None: calls carry no proof. ``tls``: a
    :class:`~tiersync.net.tls.TlsConfig` to reach a registry served over TLS (its ``cafile``
    verifies the registry; ``certfile``/``keyfile`` for one that requires client certificates;
    ``server_hostname`` overrides the name checked); None: plaintext.
    """

    heartbeat_interval_s: float = 300.0
    store_ttl_s: float = 900.0
    block_ttl_s: float = 3600.0
    batch_size: int = 256
    rpc_timeout_s: float = 2.0
    key_prefix: str = "tiersync:"
    token: str | bytes | None = field(default=None, repr=False)
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token", coerce_token(self.token, "token"))
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise UsageError("must be a TlsConfig or None", argument="tls")
        for name in ("heartbeat_interval_s", "store_ttl_s", "block_ttl_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise UsageError("must be > 0", argument=name)
        if self.store_ttl_s < self.heartbeat_interval_s:
            raise UsageError("must be >= heartbeat_interval_s", argument="store_ttl_s")
        if not 1 <= self.batch_size <= 65536:
            raise UsageError("must be in [1, 65536]", argument="batch_size")


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """A store node: where it listens, how many free blocks it has (of ``capacity_blocks``;
    0: not reported), its pool group. ``incarnation``: the node process's random id; a node
    restarted under the same id (empty) is not reported as the owner of what the process
    before it published."""

    store_id: str
    address: str
    free_blocks: int
    pool_group: str = ""
    capacity_blocks: int = 0
    incarnation: int = 0

    def __post_init__(self) -> None:  # lengths in UTF-8 bytes, as the wire bounds them
        if not isinstance(self.store_id, str) or not self.store_id or len(self.store_id.encode()) > 256:
            raise UsageError("must be a non-empty str (<= 256 bytes in UTF-8)", argument="store_id")
        if not isinstance(self.address, str) or len(self.address.encode()) > 512:
            raise UsageError("must be a str (<= 512 bytes in UTF-8)", argument="address")
        if not isinstance(self.free_blocks, int) or self.free_blocks < 0:
            raise UsageError("must be an int >= 0", argument="free_blocks")
        if not isinstance(self.pool_group, str) or len(self.pool_group.encode()) > 256:
            raise UsageError("must be a str (<= 256 bytes in UTF-8)", argument="pool_group")
        if not isinstance(self.capacity_blocks, int) or self.capacity_blocks < 0:
            raise UsageError("must be an int >= 0", argument="capacity_blocks")
        if (
            isinstance(self.incarnation, bool)
            or not isinstance(self.incarnation, int)
            or not 0 <= self.incarnation < 1 << 64
        ):
            raise UsageError("must be an int in [0, 2**64)", argument="incarnation")


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise UsageError unless every key is 16 bytes."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_SIZE:
            raise UsageError("keys must be 16-byte bytes", argument="keys")


def rank_targets(
    stores: Iterable[StoreInfo], pool_group: str, count: int, exclude: Iterable[str] = ()
) -> list[StoreInfo]:
    """Same pool group first, then most free blocks first; ties by store id. Full stores are skipped."""
    skip = set(exclude)
    live = [s for s in stores if s.store_id not in skip and s.free_blocks > 0]
    live.sort(key=lambda s: (s.pool_group != pool_group, -s.free_blocks, s.store_id))
    return live[:count]


class Registry(ABC):
    """Block ownership and store membership. Implementations are thread-safe.

    Owners of dead stores (no heartbeat within ``store_ttl_s``) and expired
    ownership entries are never reported.
    """

    @abstractmethod
    def register_store(self, info: StoreInfo) -> None:
        """Add or replace a store record; counts as a heartbeat. Another ``incarnation`` than
        the record's: what the store published before is no longer reported."""

    @abstractmethod
    def heartbeat(self, store_id: str, free_blocks: int) -> bool:
        """Refresh a store and its free count. False: unknown or expired (re-register)."""

    @abstractmethod
    def remove_store(self, store_id: str) -> None:
        """Forget a store (idempotent); its blocks stop being reported."""

    @abstractmethod
    def get_store(self, store_id: str) -> StoreInfo | None:
        """The live store record, or None when unknown or expired."""

    @abstractmethod
    def publish(self, store_id: str, keys: Sequence[bytes]) -> None:
        """Record that ``store_id`` holds ``keys`` (refreshes their TTL)."""

    @abstractmethod
    def unpublish(self, store_id: str, keys: Sequence[bytes]) -> None:
        """Record that ``store_id`` no longer holds ``keys`` (idempotent)."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        """Live owners per key, in input order (entries published by a store's current
        incarnation only); ``()`` means none known."""

    @abstractmethod
    def placement_targets(self, pool_group: str, count: int, exclude: Sequence[str] = ()) -> list[StoreInfo]:
        """Up to ``count`` live stores with free blocks, ranked by :func:`rank_targets`."""

    def take_once(self, name: str, ttl_s: float) -> bool:
        """Record ``name`` for ``ttl_s`` seconds where this registry keeps its state: False when it
        is recorded already. The gRPC service records there the proofs of calls that change
        state, so a registry restarted on the same state, or a second one, refuses a replayed
        call too. This default keeps nothing (a memory registry's state ends with its process,
        whose own record, :class:`~tiersync.net.registry.auth.Replays`, covers it)."""
        return True

    def close(self) -> None:  # noqa: B027 - a default hook: a registry without resources has nothing to release
        """Release resources (connections); idempotent."""
