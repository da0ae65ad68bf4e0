"""tiersync.weights.links: what a sampler waits for from its trainer shards."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import numpy as np
import pytest

from _lines import LineChild
from _sync_helpers import digests, fsdp
from tiersync.errors import RemoteError
from tiersync.net.errors import RequestError
from tiersync.net.socket_io import Deadline
from tiersync.net.tcp import TcpTransport
from tiersync.weights.config import PublisherConfig, ReceiverConfig, TransportKind
from tiersync.weights.links import TrainerLinks
from tiersync.weights.ops import WEIGHTS, Get, Ready
from tiersync.weights.publisher import WeightPublisher
from tiersync.weights.receiver import WeightReceiver
from tiersync.weights.segment import SEGMENT_PREFIX
from tiersync.weights.spans import StridedSpan
from tiersync.weights.version_queue import Announced

TOKEN = "restart-test-token-0123456789"


def test_a_version_superseded_while_queued_fails_at_once_instead_of_at_the_sync_deadline():
    """Shards announce in order, and a shard keeps only its last manifests: a sampler that fell
    behind and asks for a version a shard announced later ones than, but no longer has, is told
    so at once (it used to wait the whole sync timeout for each such version)."""
    links = _links(((6, 7, 8, 9, 10), (6, 7, 8)))
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="superseded"):
        links.manifests(_now(links, 3), Deadline(30.0, "sync"))
    assert time.monotonic() - t0 < 5  # not the 30 s deadline
    with pytest.raises(Exception, match="timed out"):  # 9: shard 1 has not announced it yet, so wait
        links.manifests(_now(links, 9), Deadline(0.3, "sync"))


def _links(announced: tuple[tuple[int, ...], ...]) -> TrainerLinks:
    links = TrainerLinks(["127.0.0.1:1", "127.0.0.1:2"], 1.0, lambda got: None)
    for shard, versions in zip(links._shards, announced):  # no trainer here: stand for what shards announced
        shard.alive, shard.incarnation, shard.registration = True, 0xA1, 1
        shard.manifests = dict.fromkeys(versions)
    return links


def _now(links: TrainerLinks, version: int) -> Announced:
    """``version`` as announced with the shards as they are now."""
    return Announced(version, 0, tuple(s.state() for s in links._shards))


def test_a_shard_up_when_a_version_was_announced_fails_it_once_gone_and_a_shard_down_is_waited_for():
    """A version announced while a shard was up is never complete once that shard died or
    registered again without announcing it (a restarted process announces anew; a version in
    flight is not announced again): it fails at once. A version announced while a shard was down
    is waited for: the shard may come back (a whole trainer restarting, shard by shard)."""
    links = _links(((5, 6), (5,)))
    shard0, shard1 = links._shards
    before = _now(links, 6)
    shard1.incarnation, shard1.registration, shard1.manifests = 0xB2, 2, {}  # restarted
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="restarted"):
        links.manifests(before, Deadline(30.0, "sync"))
    assert time.monotonic() - t0 < 5
    shard0.alive, shard0.manifests = False, {}  # shard 0 died too and has not registered again yet
    shard1.manifests = dict.fromkeys((1,))
    new = _now(links, 1)
    with pytest.raises(Exception, match="timed out"):  # not "went away": shard 0 may come back
        links.manifests(new, Deadline(0.3, "sync"))
    shard0.alive, shard0.incarnation, shard0.registration = True, 0xB3, 2
    links._check_coming(new)  # back as another process, 1 not announced yet: still awaited
    shard1.registration, shard1.manifests = 3, {}  # shard 1's link dropped and it registered again
    with pytest.raises(RemoteError, match="went away"):
        links.manifests(Announced(2, 0, (None, (0xB2, 2))), Deadline(30.0, "sync"))


class _Trainer(LineChild):
    """A trainer shard process (``_trainer_child.py``) driven over stdin."""

    def __init__(self, listen: str, seed: int, shm: bool, rank: int = 0, count: int = 1) -> None:
        args = [listen, str(seed), "shm" if shm else "tcp", TOKEN, str(rank), str(count)]
        super().__init__("_trainer_child.py", args, 60, stdin=True)
        self.address = self.expect("READY").split()[1]

    def command(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def publish(self, version: int) -> dict[str, int]:
        self.command(f"publish {version}")
        return self.published(version)

    def published(self, version: int) -> dict[str, int]:
        _, got, ok, blob = self.expect("PUBLISHED").split(" ", 3)
        assert (int(got), ok) == (version, "1")
        return {k: int(v) for k, v in json.loads(blob).items()}

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        for path in glob.glob(f"/dev/shm/{SEGMENT_PREFIX}{self.proc.pid}-*"):  # what SIGKILL left
            os.unlink(path)


@pytest.mark.parametrize("shm", [True, False])
def test_a_sampler_follows_a_trainer_restarted_on_its_address_and_syncs_its_numbers_again(shm):
    """The trainer process is SIGKILLed after version 2 and a new one (another model: a restart
    from a checkpoint) listens on the same address. The sampler registers again by itself and
    syncs the new process's version 1, bitwise, although it synced a version 1 before; until
    then it keeps serving the old version 2."""
    first = _Trainer("127.0.0.1:0", 10, shm)
    second = None
    rec = WeightReceiver(fsdp(1), ReceiverConfig((first.address,), token=TOKEN))
    try:
        first.command("wait 1")
        first.expect("SAMPLERS")
        first.publish(1)
        want = first.publish(2)
        assert rec.receive(2).result(60).version == 2
        first.kill()
        second = _Trainer(first.address, 500, shm)
        second.command("wait 1")
        second.expect("SAMPLERS")  # the sampler came back on its own
        with rec.acquire(10) as lease:
            assert (lease.version, digests(lease.tensors)) == (2, want)
        want = second.publish(1)
        result = rec.receive(1).result(60)
        with rec.acquire(10) as lease:
            assert (result.version, lease.version, digests(lease.tensors)) == (1, 1, want)
        assert rec.transports() == (TransportKind.SHM if shm else TransportKind.TCP,)
    finally:
        rec.close()
        for t in (first, second):
            if t is not None and t.proc.poll() is None:
                t.kill()


def test_a_whole_two_shard_trainer_restarted_shard_by_shard_is_followed_without_a_failed_version():
    """Both trainer shards are SIGKILLed and come back one after the other on their addresses
    (another model). The first one back announces version 1 while the other is still down:
    the sampler waits for the second (it may come back, and does) instead of failing version 1,
    so both shards' publishes of it succeed and the sampler holds the new model bitwise."""
    old = [_Trainer("127.0.0.1:0", 10, False, r, 2) for r in range(2)]
    new: list[_Trainer] = []
    rec = WeightReceiver(fsdp(1), ReceiverConfig(tuple(t.address for t in old), token=TOKEN))
    try:
        for t in old:
            t.command("wait 1")
            t.expect("SAMPLERS")
        for t in old:
            t.command("publish 1")
        assert old[0].published(1) == old[1].published(1)
        assert rec.receive(1).result(60).version == 1
        for t in old:
            t.kill()
        for t in old:  # shard 0 is back and publishes before shard 1 even started
            new.append(_Trainer(t.address, 700, False, len(new), 2))
            new[-1].command("wait 1")
            new[-1].expect("SAMPLERS")
            new[-1].command("publish 1")
        want = new[0].published(1)  # ok: the sampler's answer to shard 0 was no failure
        assert new[1].published(1) == want
        assert rec.receive(1).result(60).version == 1
        with rec.acquire(10) as lease:
            assert digests(lease.tensors) == want
    finally:
        rec.close()
        for t in old + new:
            if t.proc.poll() is None:
                t.kill()


def test_a_get_naming_another_incarnation_is_refused():
    """A GET names the incarnation of the trainer process whose manifest the sampler read: a
    process restarted on the same address (which numbers its versions again, with other
    bytes) refuses it instead of serving its own bytes under the old manifest."""
    g = {"w": np.arange(4096, dtype=np.float32)}
    pub = WeightPublisher(g, fsdp(1), config=PublisherConfig(shm=False, token=TOKEN, publish_timeout_s=5))
    channel = TcpTransport(ReceiverConfig((pub.address,), token=TOKEN).tcp_config(), WEIGHTS).connect(pub.address)
    try:
        assert pub.publish(1).result(30).ok
        span = StridedSpan(0, 4096 * 4, (), ())
        into = bytearray(4096 * 4)
        channel.request(Get(channel.new_request_id(), 1, "w", (0,), span, pub.incarnation), timeout=10, into=into)
        assert bytes(into) == g["w"].tobytes()
        with pytest.raises(RequestError, match="restarted"):
            channel.request(Get(channel.new_request_id(), 1, "w", (0,), span, pub.incarnation ^ 1), timeout=10)
    finally:
        channel.close()
        pub.close()


def test_a_ready_for_a_version_never_announced_ends_the_link_and_the_sampler_registers_again():
    """READYs come only for the versions a registration announced, so the sampler keeps one
    count per announced version. A trainer sending READYs for versions it never announced (or
    counting past a version's tensors) is refused as malformed: the link ends, the sampler
    registers again, keeps no such count, and still syncs the next version bitwise."""
    g = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(64, np.float32)}
    pub = WeightPublisher(g, fsdp(1), config=PublisherConfig(token=TOKEN, publish_timeout_s=30))
    rec = WeightReceiver(fsdp(1), ReceiverConfig((pub.address,), token=TOKEN))
    links, shard = rec._links, rec._links._shards[0]
    try:
        pub.wait_for_samplers(1, 30)
        assert pub.publish(1).result(60).ok and rec.receive(1).result(60).version == 1
        for bad, registration in ((Ready(10_000 + k, 1) for k in range(100)), 2), ((Ready(1, 3),), 3):
            for event in bad:
                for s in pub._registry.live():
                    pub._registry.send(s, event)
            with links._cond:  # the link ended on the first one and registered again
                assert links._cond.wait_for(lambda n=registration: shard.alive and shard.registration >= n, 30)
                assert all(v < 10_000 for v in shard.ready) and shard.ready.get(1, 0) <= len(g)
            pub.wait_for_samplers(1, 30)
        assert pub.publish(2).result(60).ok and rec.receive(2).result(60).version == 2
        with rec.acquire(10) as lease:
            assert lease.version == 2 and digests(lease.tensors) == digests(g)
    finally:
        rec.close()
        pub.close()
