"""Server processes for the networking tests (loopback only): block servers, store nodes, registries, Redis."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from tiersync.bench.engine_server import free_port

TOKEN = "store-node-test-token-0123456789"


def run_block_server(config, blocks, address_q, stop, clock_rate: float = 1.0, address: str = "127.0.0.1:0") -> None:
    """Serve ``blocks`` with ``config`` on ``address``; report the address; wait for ``stop``.
    ``clock_rate``: how much faster than real time the server's lease clock runs."""
    from tiersync.net.source import MemoryBlockSource
    from tiersync.net.tcp import TcpTransport

    source = MemoryBlockSource(blocks, clock=lambda: time.monotonic() * clock_rate)
    server = TcpTransport(config).serve(address, source)
    address_q.put(server.address)
    stop.wait(60)
    server.close()


@contextlib.contextmanager
def block_server(config, blocks, address: str = "127.0.0.1:0"):
    """:func:`run_block_server` in a spawned process for the ``with`` block; its address."""
    ctx = multiprocessing.get_context("spawn")
    address_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=run_block_server, args=(config, blocks, address_q, stop, 1.0, address), daemon=True)
    proc.start()
    try:
        yield address_q.get(timeout=30)
    finally:
        stop.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def blocked_reader(channel) -> tuple[threading.Thread, list[BaseException]]:
    """A thread waiting on ``channel`` for an answer to a request never sent, started and seen
    inside its read (past the channel's open check); what it raised lands in the list."""
    outcome: list[BaseException] = []

    def wait_for_an_answer() -> None:
        try:
            channel.next_answer(99, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    reader = threading.Thread(target=wait_for_an_answer, daemon=True)
    reader.start()
    assert wait_until(lambda: channel._framed._users._count > 0, interval=0.005)
    return reader, outcome


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` passes (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class Proc:
    """A subprocess; waits (bounded) for a stdout line containing ``marker``.

    A thread reads its output all along (so the pipe never fills); ``tail`` keeps the last lines.
    """

    def __init__(self, cmd: list[str], marker: str, timeout: float = 60.0) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.tail: deque[str] = deque(maxlen=200)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.line = self.wait_for(marker, timeout)

    def _drain(self) -> None:
        try:
            for line in self.proc.stdout:
                self.tail.append(line)
                self._lines.put(line)
        except (OSError, ValueError):
            pass
        self._lines.put(None)

    def wait_for(self, marker: str, timeout: float) -> str:
        """The first line from now on containing ``marker``; kills the process and fails without one."""
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(end - time.monotonic(), 0.001))
            except queue.Empty:
                line = None
            if line is None:
                break
            if marker in line:
                return line
        self.kill()
        raise AssertionError(f"{self.cmd[:4]} did not print {marker!r}: {''.join(self.tail)[-2000:]}")

    def address_after(self, marker: str) -> str:
        return self.line.split(marker)[1].split()[0]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(10)


class StoreNodeProc(Proc):
    """`tiersync store-node` on 127.0.0.1, port 0; ``address`` from its stdout."""

    def __init__(
        self,
        capacity: str = "4MiB",
        *,
        block: int = 256 << 10,
        token: str | None = TOKEN,
        registry: str | None = None,
        heartbeat_s: float | None = None,
        store_id: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tiersync.cli",
            "store-node",
            "--capacity",
            capacity,
            "--port",
            "0",
            "--block-size",
            str(block),
        ] + (["--token", token] if token else [])
        if registry:
            cmd += ["--registry", registry]
        if heartbeat_s is not None:
            cmd += ["--heartbeat-s", str(heartbeat_s)]
        if store_id:
            cmd += ["--store-id", store_id]
        super().__init__(cmd + list(extra), "listening on ")
        self.address = self.address_after("listening on ")
        self.store_id = store_id or self.address


class RegistryProc(Proc):
    """`tiersync registry` on 127.0.0.1 (``port`` 0 picks one); ``address`` from its stdout."""

    def __init__(
        self,
        port: int = 0,
        *,
        redis: str | None = None,
        store_ttl_s: float = 900.0,
        token_file: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        cmd = (
            [
                sys.executable,
                "-m",
                "tiersync.cli",
                "registry",
                "--port",
                str(port),
                "--store-ttl-s",
                str(store_ttl_s),
            ]
            + (["--redis", redis] if redis else [])
            + (["--token-file", token_file] if token_file else [])
            + list(extra)
        )
        super().__init__(cmd, "listening on ")
        self.address = self.address_after("listening on ")
        self.port = int(self.address.rpartition(":")[2])


class RedisProc(Proc):
    """A throwaway `redis-server` on 127.0.0.1 (no persistence; ``password``: requirepass);
    ``url`` to reach it."""

    def __init__(self, workdir: str, port: int | None = None, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        self.port = port or free_port()
        auth = ["--requirepass", password] if password else []
        super().__init__(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                *auth,
            ],
            "Ready to accept connections",
        )
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.shown = self.url.replace(f":{password}@", ":***@") if password else self.url
