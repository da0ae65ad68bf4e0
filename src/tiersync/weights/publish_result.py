"""What :meth:`~tiersync.weights.publisher.WeightPublisher.publish` reports: one
:class:`SamplerOutcome` per sampler in a :class:`PublishResult`."""

from __future__ import annotations

from dataclasses import dataclass

from tiersync.weights.config import SyncStatus, TransportKind

__all__ = ["PublishResult", "SamplerOutcome"]


@dataclass(frozen=True, slots=True)
class SamplerOutcome:
    """One sampler's answer for one version. ``error`` is None when ``status`` is OK.
    ``moved``: bytes that sampler fetched for the version (from every trainer shard and its
    relays; a delta sync fetches only changed chunks), as it reported them."""

    sampler: str
    rank: int
    status: SyncStatus
    transport: TransportKind
    error: str | None = None
    seconds: float | None = None
    moved: int = 0


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of :meth:`WeightPublisher.publish`: per sampler, and the wall time.
    ``nbytes``: this trainer shard's bytes of the version; :attr:`moved`: bytes the samplers fetched."""

    version: int
    outcomes: tuple[SamplerOutcome, ...]
    seconds: float
    nbytes: int

    @property
    def ok(self) -> bool:
        """True when every sampler that was registered at announce time switched to the version."""
        return all(o.status is SyncStatus.OK for o in self.outcomes)

    @property
    def failed(self) -> tuple[SamplerOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status is not SyncStatus.OK)

    @property
    def moved(self) -> int:
        """Bytes every sampler together fetched for this version (their reports; every trainer
        shard's result carries the same total)."""
        return sum(o.moved for o in self.outcomes)
