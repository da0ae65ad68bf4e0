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
    with pytest.raises(RemoteError, match="does not hold"):  # an older version
        relay.provide(2, "w", (0,), LANDED)
    relay.drop()  # the version failed: its waiting GETs are woken (then refused)
    assert other_woken.is_set()
    with pytest.raises(RemoteError, match="does not hold"):
        relay.provide(3, "w", (1,), LANDED)


def test_a_get_of_a_version_its_relay_has_not_begun_waits_a_moment_for_it_then_is_refused(monkeypatch):
    """A reader's sync may begin a moment before its relay's: a GET of the next version waits
    for the relay to begin it (it was refused, and the reader dropped the relay for that whole
    sync), then for its chunk. The wait is short (``_BEGIN_WAIT_S`` from the version's first
    GET): a relay that lags more, gave the version up (its sync failed) or moved past it
    refuses, the waiting GETs as soon as it did, and its readers go elsewhere."""
    from tiersync.weights import relay_chunks

    monkeypatch.setattr(relay_chunks, "_BEGIN_WAIT_S", 0.3)
    relay, buf = RelayChunks(), np.arange(4096, dtype=np.uint8)
    relay.begin(3, {"w": buf})
    early, woken = relay.provide(4, "w", (0,), LANDED), threading.Event()
    assert callable(early)
    early(woken.set)
    assert not woken.is_set()
    relay.begin(4, {"w": buf})
    assert woken.is_set()  # asked again: now a watch of its chunk, then served once it landed
    assert callable(relay.provide(4, "w", (0,), LANDED))
    relay.landed([_job((0,), LANDED)])
    arr, _ = relay.provide(4, "w", (0,), LANDED)
    assert np.shares_memory(arr, buf)
    lagging, ended = relay.provide(6, "w", (0,), LANDED), threading.Event()
    lagging(ended.set)
    relay.begin(5, {"w": buf})  # a version in between: 6's GETs wait on, in the window they had
    assert not ended.is_set()
    assert ended.wait(10)  # the relay did not begin 6 within its wait: asked again, refused
    with pytest.raises(RemoteError, match="does not hold"):
        relay.provide(6, "w", (0,), LANDED)
    given_up, refused = relay.provide(7, "w", (0,), LANDED), threading.Event()
    given_up(refused.set)
    relay.give_up(7)
    assert refused.is_set()
    for version in (7, 4):  # given up; moved past
        with pytest.raises(RemoteError, match="does not hold"):
            relay.provide(version, "w", (0,), LANDED)
    relay.landed([_job((0,), LANDED)])
    arr, _ = relay.provide(5, "w", (0,), LANDED)  # the version it landed is still served
    assert np.shares_memory(arr, buf)
    relay.begin(1, {"w": buf})  # a restarted trainer numbers its versions again: 2 is ahead
    assert callable(relay.provide(2, "w", (0,), LANDED))
