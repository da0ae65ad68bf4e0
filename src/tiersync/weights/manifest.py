"""What a trainer shard announces for one version, as JSON-able values.

A :class:`Manifest` names the tensors in write order (their global specs and source
shardings), where this shard's bytes of each live in its segment, the planner options
every party must plan with, and the relay addresses of the registered samplers.
:func:`sharding_to_json`/:func:`sharding_from_json` carry a :class:`Sharding` over the
wire. :func:`host_id` identifies this machine and boot (same host = shared memory works).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiersync.errors import UsageError
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.weights.sharding import Mesh, Sharding
from tiersync.weights.transfer_plan import PlanOptions, TensorSpec

__all__ = ["Manifest", "destination_layout", "host_id", "sharding_from_json", "sharding_to_json"]


def host_id() -> str:
    """``machine-id/boot-id`` of this host (hostname when those files are missing)."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    if not parts:
        import socket

        parts.append(socket.gethostname())
    return "/".join(parts)


def sharding_to_json(s: Sharding) -> dict[str, Any]:
    m = s.mesh
    return {
        "shape": list(m.shape),
        "axes": list(m.axis_names),
        "ranks": list(m.rank_ids),
        "spec": [list(d) for d in s.spec],
    }


def sharding_from_json(obj: Any) -> Sharding:
    """Inverse of :func:`sharding_to_json`; ProtocolError (MALFORMED) on bad input."""
    try:
        mesh = Mesh(tuple(obj["shape"]), tuple(obj["axes"]), tuple(obj["ranks"]))
        return Sharding(mesh, tuple(tuple(d) for d in obj["spec"]))
    except (KeyError, TypeError, UsageError) as exc:
        raise ProtocolError(f"bad sharding: {exc}", fault=ProtocolFault.MALFORMED) from exc


@dataclass(frozen=True, slots=True)
class Manifest:
    """Version ``version`` of source rank ``source_rank`` (of ``source_ranks`` shards).

    ``names[i]``/``specs[i]``/``source[i]``: the i-th tensor in write order, its global spec and
    source sharding. ``offsets[i]``: its local shard's file offset in ``segment`` (None: no
    segment, TCP only); ``payload_bytes``: the segment's payload size. ``host``: the trainer's
    :func:`host_id`. ``peers``: destination rank -> relay address of one registered sampler of that rank
    (several engines' samplers share ranks). ``incarnation``: the publishing process's random id
    (a trainer restarted on the same address republishes version numbers with other bytes: its
    GETs carry the incarnation they read, and another process refuses them).
    """

    version: int
    source_rank: int
    source_ranks: int
    names: tuple[str, ...]
    specs: tuple[TensorSpec, ...]
    source: tuple[Sharding, ...]
    offsets: tuple[int, ...]
    payload_bytes: int
    segment: str | None
    host: str
    options: PlanOptions
    peers: dict[int, str]
    incarnation: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source_rank": self.source_rank,
            "source_ranks": self.source_ranks,
            "tensors": [[n, list(s.shape), s.dtype] for n, s in zip(self.names, self.specs)],
            "source": [sharding_to_json(s) for s in self.source],
            "offsets": list(self.offsets),
            "payload_bytes": self.payload_bytes,
            "segment": self.segment,
            "host": self.host,
            "fanout": self.options.fanout,
            "segment_bytes": self.options.segment_bytes,
            "peers": {str(k): v for k, v in self.peers.items()},
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        """Decode; ProtocolError (MALFORMED) on anything missing or ill-typed."""
        try:
            tensors = obj["tensors"]
            m = cls(
                version=int(obj["version"]),
                source_rank=int(obj["source_rank"]),
                source_ranks=int(obj["source_ranks"]),
                names=tuple(str(t[0]) for t in tensors),
                specs=tuple(TensorSpec(tuple(t[1]), t[2]) for t in tensors),
                source=tuple(sharding_from_json(s) for s in obj["source"]),
                offsets=tuple(int(o) for o in obj["offsets"]),
                payload_bytes=int(obj["payload_bytes"]),
                segment=obj["segment"],
                host=str(obj["host"]),
                options=PlanOptions(int(obj["fanout"]), obj["segment_bytes"]),
                peers={int(k): str(v) for k, v in obj["peers"].items()},
                incarnation=_u64(obj["incarnation"]),
            )
            _check_chunks(m)
            return m
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
            raise ProtocolError(f"bad manifest: {exc!r}", fault=ProtocolFault.MALFORMED) from exc

    def index(self) -> dict[str, int]:
        """Tensor name -> write position."""
        return {n: i for i, n in enumerate(self.names)}

    def same_model(self, other: Manifest) -> bool:
        """True when ``other`` describes the same tensors, shardings and options."""
        return (self.names, self.specs, self.source, self.options, self.source_ranks) == (
            other.names,
            other.specs,
            other.source,
            other.options,
            other.source_ranks,
        )


MAX_CHUNKS = 1 << 18
"""Most chunks a manifest may cut its tensors into (each costs the sampler's planner tens of
microseconds and a job): a trainer's ``segment_bytes`` of a few bytes must not make a sampler
plan for hours. 2^18 chunks of the default 16 MiB are 4 TiB."""


def _check_chunks(m: Manifest) -> None:
    seg = m.options.segment_bytes
    chunks = sum(-(-spec.nbytes // seg) if seg else 1 for spec in m.specs)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"its tensors would be cut into {chunks} chunks (at most {MAX_CHUNKS})")


def _u64(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ValueError(f"not a u64: {value!r}")
    return value


def destination_layout(destination: Sharding | Mapping[str, Sharding], m: Manifest) -> Mapping[str, Sharding]:
    """A sampler's destination sharding of every tensor ``m`` names; UsageError (``destination``)
    when one is missing."""
    if isinstance(destination, Sharding):
        return dict.fromkeys(m.names, destination)
    missing = [n for n in m.names if n not in destination]
    if missing:
        raise UsageError(f"no destination sharding for {missing[:3]}", argument="destination")
    return destination
