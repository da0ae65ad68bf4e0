"""net/background.py: long answers off the server's workers; the store node's OFFER pulls on it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from _peer import TOKEN
from _wait import until
from tiersync.errors import TierSyncError, UsageError
from tiersync.net import events as ev
from tiersync.net.background import Background
from tiersync.net.service import Park
from tiersync.net.store_node import StoreNode, StoreNodeClient, StoreNodeServer
from tiersync.net.tcp import TcpConfig

BLOCK = 1 << 20


def test_take_parks_while_the_job_runs_then_hands_its_answers_over_once():
    jobs = Background(2, "test-bg")
    gate, woken = threading.Event(), threading.Event()
    try:
        park = jobs.start("s", 7, lambda: [gate.wait(10), "done"][1:], time.monotonic() + 60)
        park.watch(woken.set)
        assert isinstance(jobs.take("s", 7, time.monotonic() + 60), Park) and not woken.is_set()
        assert jobs.take("s", 8, time.monotonic() + 60) is None  # another request: no job
        gate.set()
        assert woken.wait(10)  # the park's wake runs when the job ends
        assert jobs.take("s", 7, time.monotonic() + 60) == ["done"]
        assert jobs.take("s", 7, time.monotonic() + 60) is None and len(jobs) == 0
    finally:
        jobs.close()


def test_a_dropped_sessions_job_runs_to_its_end_and_its_answers_are_not_kept():
    jobs = Background(1, "test-bg")
    gate, ran, answers = threading.Event(), threading.Event(), []
    try:
        jobs.start("gone", 1, lambda: [gate.wait(10), ran.set()], time.monotonic() + 60)
        jobs.start("kept", 1, lambda: ["kept"], time.monotonic() + 60)  # queued behind: one thread
        jobs.drop("gone")
        gate.set()
        assert until(lambda: answers.append(jobs.take("kept", 1, 0.0)) or answers[-1] == ["kept"])
        assert ran.is_set() and len(jobs) == 0
    finally:
        jobs.close()


def test_close_waits_for_the_running_job():
    jobs = Background(1, "test-bg")
    ended = threading.Event()
    started = threading.Event()
    jobs.start("s", 1, lambda: [started.set(), time.sleep(0.3), ended.set()], time.monotonic() + 60)
    assert started.wait(10)
    jobs.close()
    assert ended.is_set()


def test_a_store_node_serves_readers_while_slow_writers_pulls_wait_and_commits_them_after():
    """Two server workers, three writers whose blocks are pulled slowly (each pull waits on a
    gate): the node answers a reader byte-exact meanwhile. When the pulls ran on the server's
    workers, two of them held both workers and the reader timed out."""
    node = StoreNode(16 * BLOCK, BLOCK, config=TcpConfig(token=TOKEN.encode(), workers=2))
    server = StoreNodeServer("127.0.0.1:0", node)
    gate, pulls, lock = threading.Event(), [], threading.Lock()

    def slow(pull: object) -> None:
        with lock:
            pulls.append(pull)
        gate.wait(30)

    stored = os.urandom(BLOCK)
    writes = {bytes([1, i]) + bytes(14): os.urandom(BLOCK - i) for i in range(3)}
    outcomes: dict[bytes, object] = {}
    try:
        writer = StoreNodeClient(server.address, token=TOKEN.encode(), timeout=10.0)
        assert writer.offer_and_push([b"S" * 16], [stored]).commit is ev.CommitStatus.COMMITTED

        def push(key: bytes) -> None:
            c = StoreNodeClient(server.address, token=TOKEN.encode(), timeout=60.0, on_pull=slow)
            outcomes[key] = c.offer_and_push([key], [writes[key]]).commit

        threads = [threading.Thread(target=push, args=(k,)) for k in writes]
        for t in threads:
            t.start()
        assert until(lambda: len(pulls) >= 2, 20)  # as many pulls as workers began, none can end
        got = bytearray(BLOCK)
        StoreNodeClient(server.address, token=TOKEN.encode(), timeout=5.0).read([b"S" * 16], [got])
        assert got == stored and not outcomes
        assert until(lambda: len(pulls) == 3, 20)  # the third one too: none waits for a worker
        gate.set()
        for t in threads:
            t.join(30)
        assert outcomes == dict.fromkeys(writes, ev.CommitStatus.COMMITTED)
        for key, data in writes.items():
            got = bytearray(len(data))
            writer.read([key], [got])
            assert got == data
    finally:
        gate.set()
        server.close()
        node.close()


def test_a_writer_that_hangs_up_while_its_pull_waits_leaves_no_block_taken():
    node = StoreNode(4 * BLOCK, BLOCK, config=TcpConfig(token=TOKEN.encode()), pull_timeout_s=3.0)
    server = StoreNodeServer("127.0.0.1:0", node)
    gate, pulled = threading.Event(), threading.Event()
    try:
        c = StoreNodeClient(
            server.address, token=TOKEN.encode(), timeout=1.0, on_pull=lambda _: [pulled.set(), gate.wait(30)]
        )
        failed: list[BaseException] = []

        def push() -> None:
            try:
                c.offer_and_push([b"H" * 16], [os.urandom(BLOCK)])
            except TierSyncError as exc:
                failed.append(exc)

        t = threading.Thread(target=push)
        t.start()
        assert pulled.wait(10) and node.free_blocks == 3
        t.join(20)  # the writer gave up (its timeout) and closed its connections
        assert len(failed) == 1
        gate.set()
        assert until(lambda: node.free_blocks == 4, 20)  # the pull failed: its landing block freed
        assert node.stored == 0
    finally:
        gate.set()
        server.close()
        node.close()


def test_pullers_is_checked_before_anything_is_made():
    with pytest.raises(UsageError, match="pullers"):
        StoreNode(4 * BLOCK, BLOCK, pullers=0)


def test_closing_a_store_node_ends_a_slow_writers_pull_at_once_and_answers_it_failed():
    """A pull waits on a writer that serves nothing (its pull_timeout_s a minute): close() ends
    it at once, its writer is answered FAILED, and the close takes seconds, not the minute.
    Before, close() waited for the pull to end."""
    node = StoreNode(4 * BLOCK, BLOCK, config=TcpConfig(token=TOKEN.encode()), pull_timeout_s=60.0)
    server = StoreNodeServer("127.0.0.1:0", node)
    gate, pulled, outcome = threading.Event(), threading.Event(), []
    try:
        c = StoreNodeClient(
            server.address, token=TOKEN.encode(), timeout=60.0, on_pull=lambda _: [pulled.set(), gate.wait(50)]
        )

        def push() -> None:
            try:
                outcome.append(c.offer_and_push([b"C" * 16], [os.urandom(BLOCK)]))
            except TierSyncError as exc:
                outcome.append(exc)

        t = threading.Thread(target=push)
        t.start()
        assert pulled.wait(10) and node.free_blocks == 3
        began = time.monotonic()
        node.close()
        assert time.monotonic() - began < 10
        t.join(20)
        assert "store node failed the write" in str(outcome[0]) and "clos" in str(outcome[0])
    finally:
        gate.set()
        server.close()
        node.close()
