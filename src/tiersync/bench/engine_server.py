"""A vLLM engine behind a minimal HTTP endpoint, and the prefill -> decode router.

``python -m tiersync.bench.engine_server engine '<json spec>' PORT [HOST]`` starts an engine
(spec as in :mod:`tiersync.bench.serve_engine`) and serves ``POST /generate`` with a JSON
body ``{"prompt_token_ids", "max_tokens", "kv_transfer_params"?}``, answering the
:func:`~tiersync.bench.serve_engine.generate` row. It prints ``READY <port> <host>`` once the
engine is up. ``... router PREFILL_URL DECODE_URL PORT`` serves the same endpoint as
``tiersync router`` does: each request goes to the prefill engine (one token,
``do_remote_decode``), whose token is the first of the answer; then, unless that was the
last, the prompt followed by that token goes to the decode engine with the prefill engine's
``kv_transfer_params`` for the remaining tokens. Its answer adds ``prefill`` (the prefill
row), ``ttft_seconds`` (when the router had the first token: a streaming router sends it
then), ``decode_seconds`` (the decode engine's own time; 0 without it) and
``decode_tokens``; ``seconds`` covers both hops, ``cached_tokens`` is the decode engine's.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

MAX_BODY = 16 << 20  # a request body larger than this is refused


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range: the server binds it
    later, and a port of that range may meanwhile go to an outgoing connection of the engines
    (then the server fails with "Address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(max(1024, low - 8000), low), min(256, max(1, low - 1024))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one taken: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _handler(fn: Callable[[dict], dict]) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if self.path != "/generate" or not 0 < n <= MAX_BODY:
                self.send_error(404 if self.path != "/generate" else 413)
                return
            try:
                out = json.dumps(fn(json.loads(self.rfile.read(n)))).encode()
            except Exception as exc:  # noqa: BLE001 - report any failure to the client
                self.send_error(500, explain=repr(exc)[:500])
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            return

    return Handler


def serve_engine(spec: dict, port: int, host: str = "127.0.0.1") -> None:
    from tiersync.bench.serve_engine import build_engine, generate, make_prompt

    llm = build_engine(spec)
    generate(llm, make_prompt(300, 12345, spec.get("vocab", 4096)), 2)  # warm-up

    def handle(body: dict) -> dict:
        return generate(
            llm, list(body["prompt_token_ids"]), int(body.get("max_tokens", 16)), body.get("kv_transfer_params")
        )

    _serve(handle, port, host)


def serve_router(prefill: str, decode: str, port: int) -> None:
    def handle(body: dict) -> dict:
        t0 = time.perf_counter()
        prompt, max_tokens = list(body["prompt_token_ids"]), int(body.get("max_tokens", 16))
        first = post(
            prefill + "/generate",
            {"prompt_token_ids": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        ttft = time.perf_counter() - t0
        if max_tokens <= 1:
            out = {**first, "decode_seconds": 0.0, "decode_tokens": 0}
        else:
            out = post(
                decode + "/generate",
                {
                    "prompt_token_ids": prompt + first["tokens"],
                    "max_tokens": max_tokens - 1,
                    "kv_transfer_params": first.get("kv_transfer_params"),
                },
            )
            out["decode_seconds"], out["decode_tokens"] = out["seconds"], len(out["tokens"])
            out["tokens"], out["logprobs"] = first["tokens"] + out["tokens"], first["logprobs"] + out["logprobs"]
        out["prefill"], out["ttft_seconds"], out["seconds"] = first, ttft, time.perf_counter() - t0
        return out

    _serve(handle, port)


class Server:
    """A started engine or router process (its own process group) and its URL."""

    def __init__(self, proc: Any, url: str, log: str) -> None:
        self.proc, self.url, self.log = proc, url, log

    def __repr__(self) -> str:
        return f"Server({self.url}, pid={self.proc.pid})"

    def generate(self, prompt: list[int], max_tokens: int = 16, kv_transfer_params: dict | None = None) -> dict:
        """The server's answer plus ``client_seconds``: the POST's wall time seen from here."""
        body = {"prompt_token_ids": prompt, "max_tokens": max_tokens}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        t0 = time.perf_counter()
        out = post(self.url + "/generate", body)
        out["client_seconds"] = time.perf_counter() - t0
        return out

    def kill(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group (the engine's core and worker processes too): SIGTERM
        first, so vLLM's processes exit and Python's resource tracker (which ignores SIGTERM)
        removes the shared memory they leave in /dev/shm (a SIGKILL of the group left 400 MB
        of ``psm_*`` per engine); SIGKILL whatever is left after ``grace_s``."""
        import os
        import signal
        import time

        group = self.proc.pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            self.proc.poll()  # reap the leader: a zombie still counts as a member
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def start(args: list[str], log: str, python: str, timeout: float = 600, prefix: list[str] | None = None) -> Server:
    """Start ``python -m tiersync.bench.engine_server ARGS`` and wait for its READY line; its
    output is copied to ``log`` by a thread. RuntimeError with the log's tail when it exits
    first or does not start within ``timeout``."""
    import os
    import subprocess
    import threading

    from tiersync.bench.serve_engine import engine_env

    env = engine_env(json.loads(args[1])) if args[0] == "engine" else dict(os.environ)
    cmd = [*(prefix or []), python, "-m", "tiersync.bench.engine_server", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        text=True,
        errors="replace",
    )
    ready = threading.Event()
    port: list[str] = []

    def pump() -> None:
        with open(log, "w") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if line.startswith("READY ") and not port:
                    port.append(line.split()[2] + ":" + line.split()[1])
                    ready.set()
        ready.set()  # EOF: the process exited

    threading.Thread(target=pump, daemon=True, name="engine-log").start()
    if ready.wait(timeout) and port:
        return Server(proc, f"http://{port[0]}", log)
    Server(proc, "", log).kill()
    with open(log, errors="replace") as f:
        tail = "".join(f.readlines()[-30:])
    raise RuntimeError(f"{args[0]} did not start:\n{tail}")


def _serve(handle: Callable[[dict], dict], port: int, host: str = "127.0.0.1") -> None:
    server = HTTPServer((host, port), _handler(handle))
    print(f"READY {server.server_port} {host}", flush=True)
    server.serve_forever()


def main(argv: list[str]) -> int:
    if argv[:1] == ["engine"] and len(argv) in (3, 4):
        import os

        spec = json.loads(argv[1])
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 1)))
        serve_engine(spec, int(argv[2]), *argv[3:])
    elif argv[:1] == ["router"] and len(argv) == 4:
        serve_router(argv[1], argv[2], int(argv[3]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
