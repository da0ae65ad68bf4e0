"""``tiersync router`` started as users start it (tiersync.cli_router): the request bounds are flags."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.fixture
def router():
    """A router process whose bodies may be 1 KiB and whose clients have 1 s for a request."""
    command = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"]
    command += ["--max-body", "1KiB", "--max-bodies", "1MiB", "--client-timeout-s", "1", "--max-connections", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiersync.cli", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        host, port = line.split("listening on ", 1)[1].split()[0].rsplit(":", 1)
        yield host, int(port)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_flags_bound_bodies_and_clients(router):
    """A 2 KiB body is answered 413 (--max-body 1KiB); a client that sends nothing is closed
    once --client-timeout-s passed, long before the 20 s this test waits (the default is 30 s)."""
    with socket.create_connection(router, timeout=20) as sock:
        body = b"{" + b" " * 2046 + b"}"
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 413")
    with socket.create_connection(router, timeout=20) as sock:
        assert sock.recv(64) in (b"", b"HTTP/1.1 408")  # closed (or told) without a byte from us


@pytest.mark.parametrize("ca", ["/nonexistent/ca.pem", __file__])
def test_an_unusable_upstream_ca_is_refused_naming_the_flag(ca):
    """``--upstream-ca`` that is no file, or holds no certificate: exit 2, the flag named, no traceback."""
    command = ["router", "--prefill", "https://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "tiersync.cli", *command, "--upstream-ca", ca],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--upstream-ca" in proc.stderr and "Traceback" not in proc.stderr
