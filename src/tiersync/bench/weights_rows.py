"""The report rows of ``tiersync bench weights``: one per contender and case against gloo, a
``-tcp-vs-raw`` row against the raw-socket figure, and the issue's targets."""

from __future__ import annotations

from typing import Any

from tiersync.bench.common import median, row, throughput

__all__ = ["BASELINE", "RAW_BASELINE", "case_rows", "targets"]

BASELINE = "torch.distributed.broadcast (gloo)"
RAW_BASELINE = "raw loopback sockets (sendmsg -> recv_into, one sender thread per sampler)"


def _secs(prefix: str, t: list[float]) -> dict[str, float]:
    return {
        f"{prefix}seconds": round(median(t), 4),
        f"{prefix}seconds_min": round(min(t), 4),
        f"{prefix}seconds_max": round(max(t), 4),
    }


def case_rows(nbytes: int, shards: int, n: int, times: dict[str, list[float]], raw: list[float], buffers: int) -> list:
    """One row per contender against gloo; with one trainer, TCP again against the raw sockets."""
    rawt = throughput(nbytes, raw)
    common = dict(
        shards=shards,
        samplers=n,
        nbytes=nbytes,
        **_secs("raw_socket_", raw),
        raw_socket_gbps=round(rawt["gbps"], 4),
        raw_socket_aggregate_gbps=round(rawt["gbps"] * n, 4),
        buffers=buffers,
        roundtrip="ok",
    )
    out = [
        _row(
            f"weights-{shards}t-{n}s-{_NAMES[who]}",
            nbytes,
            times[who],
            BASELINE,
            times["gloo"],
            _TRANSPORTS[who],
            common,
        )
        for who in ("shm", "zc", "tcp")
        if times[who]
    ]
    if shards == 1 and times["tcp"]:
        out.append(
            _row(
                f"weights-1t-{n}s-tcp-vs-raw",
                nbytes,
                times["tcp"],
                RAW_BASELINE,
                raw,
                _TRANSPORTS["tcp"],
                common,
                gloo_gbps=round(throughput(nbytes, times["gloo"])["gbps"], 4),
            )
        )
    return out


def _row(
    name: str,
    nbytes: int,
    ours_t: list[float],
    baseline: str,
    base_t: list[float],
    transport: str,
    common: dict,
    **extra: Any,
) -> dict[str, Any]:
    ours, base, n = throughput(nbytes, ours_t), throughput(nbytes, base_t), common["samplers"]
    return row(
        name,
        ours,
        baseline,
        base,
        **common,
        transport=transport,
        **_secs("", ours_t),
        **_secs("baseline_", base_t),
        aggregate_gbps=round(ours["gbps"] * n, 4),
        baseline_aggregate_gbps=round(base["gbps"] * n, 4),
        samples=len(ours_t),
        **extra,
    )


_NAMES = {"shm": "shm", "zc": "shm-zerocopy", "tcp": "tcp"}
_TRANSPORTS = {
    "shm": "auto (shm), copied into sampler buffers",
    "zc": "auto (shm), zero-copy leases on the segment",
    "tcp": "tcp forced",
}


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at 4 samplers from 1 trainer: shm >= 4x gloo (copy and zero-copy rows
    each), tcp forced >= 1.5x."""
    out: dict[str, Any] = {}
    for who, need in (("shm", 4.0), ("shm-zerocopy", 4.0), ("tcp", 1.5)):
        r = next((r for r in results if r["name"] == f"weights-1t-4s-{who}"), None)
        if r is not None:
            out[who] = {"min_ratio": need, "ratio": r["ratio"], "met": r["ratio"] >= need}
    return out
