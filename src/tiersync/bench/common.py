"""What every bench suite shares: its config, statistics, the row contract, output.

Contract of a suite (``tiersync bench SUITE``): a module with
``run(config: BenchConfig) -> dict`` returning the report built by :func:`report`:
one JSON-able object whose ``results`` is a list of rows, each at least
``{"name", "gbps", "baseline", "baseline_gbps", "ratio"}`` with
``ratio = gbps / baseline_gbps`` (1.0 = level with the baseline), plus the
top-level fields ``suite``, ``kernel``, ``machine``, ``units``, ``iterations``
and ``warmups``. Throughputs are decimal GB/s (1e9 bytes per second).

A suite that cannot prove its data arrived byte-exact raises
:class:`RoundTripError` instead of reporting; the check is never waived.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from tiersync.errors import IntegrityError, UsageError

UNITS = "decimal GB/s"
GATE_K = 3.5  # the reference's gate: median - 3.5 x 1.4826 x MAD
MAD_SCALE = 1.4826


class RoundTripError(IntegrityError):
    """The byte-exact round trip that must precede any report failed: nothing is reported."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """How one suite runs.

    ``quick`` shrinks the shapes so the suite ends in well under a minute;
    ``tiny`` (tests only) shrinks them to a few MiB. ``iterations`` and
    ``warmups`` of None mean the defaults of the mode (20/5/2 timed, 3/3/1 warm-up).
    ``inject_corruption`` (tests only) flips a byte mid round trip, which must
    make the suite refuse. ``progress`` draws a tqdm bar on stderr.
    """

    suite: str
    quick: bool = False
    tiny: bool = False
    workers: int = 2
    iterations: int | None = None
    warmups: int | None = None
    seed: int = 0
    inject_corruption: bool = False
    progress: bool = False
    cases: str | None = None  # run only cases whose name contains this substring

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers <= 0:
            raise UsageError("must be a positive int", argument="--workers", value=self.workers)
        for name in ("iterations", "warmups"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < (1 if name == "iterations" else 0)):
                raise UsageError("out of range", argument=f"--{name}", value=v)

    @property
    def mode(self) -> str:
        return "tiny" if self.tiny else "quick" if self.quick else "full"

    @property
    def n_iterations(self) -> int:
        return self.iterations if self.iterations is not None else {"full": 20, "quick": 5, "tiny": 2}[self.mode]

    @property
    def n_warmups(self) -> int:
        return self.warmups if self.warmups is not None else {"full": 3, "quick": 3, "tiny": 1}[self.mode]


# -- statistics --------------------------------------------------------------
def same_tokens(served: dict[str, list[dict]], what: str, reference: str = "recompute") -> None:
    """Correct before fast for engine suites: every mode served as many requests as
    ``reference`` with the same greedy ``tokens`` each, else RoundTripError naming ``what``."""
    ref = served[reference]
    for mode, reqs in served.items():
        bad = [i for i, (a, b) in enumerate(zip(reqs, ref)) if a["tokens"] != b["tokens"]]
        if bad or len(reqs) != len(ref):
            raise RoundTripError(f"{what}: {mode}'s greedy tokens differ from {reference}'s", requests=bad[:8])


def from_child(conn: Any, proc: Any, what: str, timeout: float) -> Any:
    """The next message on ``conn`` (a Pipe end) from child process ``proc``; RoundTripError
    naming ``what`` as soon as the child exits without one (its own error is above, on
    stderr), or when ``timeout`` seconds pass without one."""
    from multiprocessing.connection import wait

    ready = wait([conn, proc.sentinel], timeout)
    if conn in ready:
        try:
            return conn.recv()
        except EOFError:
            pass
    if not ready:
        raise RoundTripError(f"the {what} process sent nothing within {timeout:g} s")
    proc.join(5)
    raise RoundTripError(f"the {what} process ended before answering (its error is above)", exitcode=proc.exitcode)


def median(values: Sequence[float]) -> float:
    """Median (mean of the two middle values for an even count). ValueError when empty."""
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] (numpy's default method)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def gate_floor(values: Sequence[float]) -> float:
    """The reference's performance-gate floor: ``median - 3.5 x 1.4826 x MAD``."""
    m = median(values)
    mad = median([abs(v - m) for v in values])
    return m - GATE_K * MAD_SCALE * mad


def throughput(nbytes: int, seconds: Sequence[float]) -> dict[str, float]:
    """Summary of timed transfers of ``nbytes`` each: median GB/s, gate floor, latency (ms)."""
    gbps = [nbytes / s / 1e9 for s in seconds]
    return {
        "gbps": median(gbps),
        "gate_floor_gbps": gate_floor(gbps),
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p90_ms": percentile(seconds, 90) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
    }


def row(name: str, ours: dict[str, float], baseline: str, base: dict[str, float], **extra: Any) -> dict[str, Any]:
    """One result row; ``ratio`` = ours / baseline throughput (computed before rounding)."""
    out: dict[str, Any] = {
        "name": name,
        "gbps": round(ours["gbps"], 4),
        "baseline": baseline,
        "baseline_gbps": round(base["gbps"], 4),
        "ratio": round(ours["gbps"] / base["gbps"], 4),
        "gate_floor_gbps": round(ours["gate_floor_gbps"], 4),
        "baseline_gate_floor_gbps": round(base["gate_floor_gbps"], 4),
    }
    out.update({k: round(ours[k], 4) for k in ("p50_ms", "p90_ms", "p99_ms")})
    out.update(extra)
    return out


# -- report ------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """Where the numbers were taken (no framework is imported for this)."""
    import numpy as np

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
    return info


def report(config: BenchConfig, results: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The suite's top-level JSON object around ``results``."""
    from tiersync.transfer.kernel import KERNEL

    out: dict[str, Any] = {
        "suite": config.suite,
        "kernel": KERNEL,
        "mode": config.mode,
        "units": UNITS,
        "iterations": config.n_iterations,
        "warmups": config.n_warmups,
        "machine": machine_info(),
        "config": asdict(config),
        "results": results,
    }
    out.update(extra)
    return out


def dump_json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=None, sort_keys=False, separators=(",", ":"))


TABLE_COLUMNS = ("name", "gbps", "baseline_gbps", "ratio", "gate_floor_gbps", "p50_ms", "p99_ms")


def render_table(rep: dict[str, Any]) -> str:
    """A readable table of ``rep["results"]`` with a one-line header."""
    rows = [[_fmt(r.get(c, "")) for c in TABLE_COLUMNS] for r in rep["results"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(TABLE_COLUMNS)]
    baseline = rep["results"][0]["baseline"] if rep["results"] else "-"
    head = (
        f"tiersync bench {rep['suite']} ({rep['mode']}, kernel={rep['kernel']}, {rep['units']}, "
        f"median of {rep['iterations']} after {rep['warmups']} warm-ups, ratio = ours / {baseline})"
    )
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(TABLE_COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


@contextmanager
def progress(total: int, enabled: bool, desc: str) -> Iterator[Any]:
    """A tqdm bar on stderr (or a no-op object with ``update``) for ``total`` steps."""
    if not enabled:
        yield _NoBar()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit="it")
    try:
        yield bar
    finally:
        bar.close()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``."""

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
