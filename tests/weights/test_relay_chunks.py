"""tiersync.weights.relay_chunks: a relaying sampler serves a chunk of the version it lands only
once that chunk landed, and only the span it landed in (the rest of its buffer may still hold
an older version: serving it would hand out stale bytes and leave their checksum cached)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tiersync.errors import RemoteError
from tiersync.weights.config import TransportKind
from tiersync.weights.fetch import Job, Source
from tiersync.weights.relay_chunks import RelayChunks
from tiersync.weights.spans import StridedSpan

LANDED = StridedSpan(0, 4096)


def _job(key: tuple[int, ...], span: StridedSpan) -> Job:
    return Job("w", 0, key, 0, span, (Source(TransportKind.TCP, span, address="127.0.0.1:1"),))


def test_a_relay_serves_a_landed_chunk_in_the_span_it_landed_only():
    relay, buf = RelayChunks(), np.arange(8192, dtype=np.uint8)
    relay.begin(3, {"w": buf})
    watch = relay.provide(3, "w", (0,), LANDED)  # not landed yet: a watch of it
    assert callable(watch)
    other, woken, other_woken = relay.provide(3, "w", (1,), LANDED), threading.Event(), threading.Event()
    watch(woken.set)
    other(other_woken.set)
    relay.landed([_job((0,), LANDED)])
    assert woken.is_set() and not other_woken.is_set()  # the landing of chunk (0,) wakes its GETs only
    arr, release = relay.provide(3, "w", (0,), LANDED)
    assert np.shares_memory(arr, buf)
    release()
    for span in (StridedSpan(4096, 4096), StridedSpan(0, 8192), None):  # another span of the buffer
        with pytest.raises(RemoteError, match="not the span"):
            relay.provide(3, "w", (0,), span)
    with pytest.raises(RemoteError, match="does not hold"):  # another version
        relay.provide(4, "w", (0,), LANDED)
    relay.drop()  # the version failed: its waiting GETs are woken (then refused)
    assert other_woken.is_set()
    with pytest.raises(RemoteError, match="does not hold"):
        relay.provide(3, "w", (1,), LANDED)
