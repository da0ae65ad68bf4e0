"""A decode rank's read that fails before it reached every prefill rank of the request tells
the ranks it never reached (KV_DROP) to free the request at once, not at their timeout_s
(real producers in this process, real sockets)."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import numpy as np
import pytest

from tiersync.disagg import DisaggConfig, KVConsumer, KVOrder, KVProducer, PagedKVLayout, RequestState, SourceSpec
from tiersync.disagg.ops import KV
from tiersync.net.service import Service
from tiersync.net.tcp import TcpTransport

SRC = PagedKVLayout(
    num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, num_blocks=16, dtype="float16", tp_size=2,
    order=KVOrder.KV_MAJOR,
)  # fmt: skip
DST = dataclasses.replace(SRC, tp_size=1)  # decode rank 0 reads from both prefill ranks
TOKEN = b"f" * 32


class _GatedLink:
    """A TCP forwarder to ``target`` that passes nothing until :attr:`gate` is set: a slow link
    to a prefill rank (the kernel accepts the connections; no byte moves meanwhile)."""

    def __init__(self, target: str) -> None:
        self.gate = threading.Event()
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.gate.wait()
        host, port = self.target.rsplit(":", 1)
        while True:
            try:
                conn, _ = self._server.accept()
                up = socket.create_connection((host, int(port)), timeout=10)
            except OSError:  # closed
                return
            self._socks += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._server.close()
        for s in self._socks:
            s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"127.0.0.1:{s.getsockname()[1]}"


def _freed(producer: KVProducer, request_id: str, within: float) -> bool:
    """Whether ``producer`` reports ``request_id`` failed (its blocks freed) within ``within`` s."""
    end = time.monotonic() + within
    while (left := end - time.monotonic()) > 0:
        producer.wait_progress(left)
        if request_id in producer.poll().failed_sending:
            return True
    return False


def _reported_failed(consumer: KVConsumer, request_id: str, within: float) -> bool:
    """Whether ``consumer`` reports ``request_id`` failed within ``within`` s: a failed read is
    reported once none of its threads still runs (one may still be talking to a rank that
    freed the request when it saw the read's connection close)."""
    end = time.monotonic() + within
    while (left := end - time.monotonic()) > 0:
        if request_id in consumer.poll().failed_receiving:
            return True
        consumer.wait_progress(min(left, 0.05))
    return False


@pytest.mark.parametrize("first", ["refuses", "is gone"])
def test_a_read_that_fails_at_the_first_rank_frees_the_request_at_the_ranks_it_never_reached(first):
    """Prefill rank 0 refuses the read (it does not know the request) or is gone; the link to
    rank 1 is slow, so the read failed before it reached rank 1. Rank 1 (timeout_s 600) frees
    the request within 10 s: the consumer dropped it there. Before, it kept the blocks 600 s."""
    config = DisaggConfig(timeout_s=600, token=TOKEN)
    landing = [np.zeros(DST.layer_nbytes, np.uint8) for _ in range(DST.num_layers)]
    with KVProducer(SRC, 0, config) as rank0, KVProducer(SRC, 1, config) as rank1:
        rank1.register("r", [1, 2], 20, [np.zeros(SRC.layer_nbytes, np.uint8) for _ in range(SRC.num_layers)])
        address0 = rank0.address if first == "refuses" else _closed_port()
        link = _GatedLink(rank1.address)
        try:
            with KVConsumer(DST, 0, config) as consumer:
                source = SourceSpec(SRC, (address0, link.address), (1, 2), 20)
                handle = consumer.start_read("r", source, [3, 4], landing)
                assert handle.wait(20) is RequestState.FAILED
                assert rank1.state("r") is RequestState.PENDING  # the read never reached it
                link.gate.set()
                assert _freed(rank1, "r", within=10), "rank 1 still holds the request"
                assert _reported_failed(consumer, "r", within=10)  # once its pulling threads ended
            assert rank1.state("r") is RequestState.FAILED
        finally:
            link.close()


def test_a_read_that_succeeds_tells_no_rank_anything():
    config = DisaggConfig(timeout_s=60, token=TOKEN)
    layers = [np.zeros(SRC.layer_nbytes, np.uint8) for _ in range(SRC.num_layers)]
    landing = [np.zeros(DST.layer_nbytes, np.uint8) for _ in range(DST.num_layers)]
    with KVProducer(SRC, 0, config) as rank0, KVProducer(SRC, 1, config) as rank1:
        for rank in (rank0, rank1):
            rank.register("ok", [1, 2], 20, layers)
            for layer in range(SRC.num_layers):
                rank.layer_ready("ok", layer)
        with KVConsumer(DST, 0, config) as consumer:
            handle = consumer.start_read(
                "ok", SourceSpec(SRC, (rank0.address, rank1.address), (1, 2), 20), [3, 4], landing
            )
            assert handle.wait(20) is RequestState.DONE, handle.error
            assert consumer._dropper is None  # no drop sender was even started


class _Unanswering(Service):
    """A prefill rank that takes a KV_DROP and never answers it (its handler waits for ``gate``)."""

    vocabulary = KV

    def __init__(self) -> None:
        self.gate, self.asked = threading.Event(), threading.Event()

    def handle(self, session, event):
        self.asked.set()
        self.gate.wait(30)
        return []


def test_closing_a_consumer_gives_hanging_drops_connect_timeout_in_all():
    """A failed read's drop to a rank that takes it and never answers holds a sender for the
    drop's ``io_timeout_s`` (20 s). close() gives the drops ``connect_timeout_s`` (2 s) in all;
    it used to wait that long for them to be sent and then as long again for the dropper to
    stop (4 s)."""
    config = DisaggConfig(token=TOKEN, connect_timeout_s=2.0, io_timeout_s=20.0)
    rank = _Unanswering()
    server = TcpTransport(config.tcp_config(server=True), KV).serve("127.0.0.1:0", rank)
    consumer = KVConsumer(DST, 0, config)
    try:
        dropper = consumer._drop_sender()
        assert dropper is not None
        dropper.drop("r-close", (server.address,))
        assert rank.asked.wait(10)
        t0 = time.monotonic()
        consumer.close()
        took = time.monotonic() - t0
        assert 1.8 < took < 3.2, took  # the drop had its 2 s, and no more
    finally:
        rank.gate.set()
        server.close()
