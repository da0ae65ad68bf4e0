"""The ceilings of ``tiersync bench weights``, measured in the same run: the loopback raw-socket
figure (the driver ``sendmsg``s the model's bytes to each receiver process, one thread each, and
they ``recv_into`` them; checked byte-exact) and one-thread ``np.copyto`` of the model's bytes."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import xxhash

from tiersync.bench.common import RoundTripError, median

__all__ = ["memcpy_gbps", "raw_seconds"]


def memcpy_gbps(nbytes: int, rounds: int = 3) -> float:
    """Median GB/s of one-thread ``np.copyto`` of ``nbytes`` between warm buffers."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


def raw_seconds(model: Any, pool: list, n: int, rounds: int, expect: Any, trim: bool) -> list[float]:
    """Seconds per round of the raw figure to the first ``n`` pool workers (after one warm-up)."""
    listener = socket.create_server(("127.0.0.1", 0))
    workers, socks = pool[:n], []
    try:
        for p, c in workers:
            c.send(("raw", listener.getsockname()[1], model.nbytes))
            expect(c, "ready", p)
            s, _ = listener.accept()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
            socks.append(s)
        views = [memoryview(a.reshape(-1).view(np.uint8)) for a in model.raw.values()]
        times = []
        for i in range(rounds + 1):
            for _, c in workers:
                c.send(("round",))
            t0 = time.perf_counter()
            threads = [threading.Thread(target=_raw_send, args=(s, views)) for s in socks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.perf_counter() - t0)
            if i == 0:
                h = xxhash.xxh3_64()
                for v in views:
                    h.update(v)
                for p, c in workers:
                    c.send(("rawdigest",))
                    if expect(c, "digest", p)[1] != h.intdigest():
                        raise RoundTripError("raw socket receiver got other bytes; refusing to report")
        return times[1:]
    finally:
        for s in socks:
            s.close()
        listener.close()
        for _, c in workers:
            c.send(("rawclose",))
            if trim:
                c.send(("trim",))


def _raw_send(sock: socket.socket, views: list[memoryview]) -> None:
    for v in views:
        sock.sendall(v)
    sock.recv(1)
