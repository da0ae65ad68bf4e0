"""Every bad input and fault gets a clear answer: the ``tiersync`` command, run as a real
subprocess, answers a user's mistake or a problem of this host with one line naming the
flag as typed (exit 2, no traceback), and its servers stop on SIGTERM as on Ctrl-C (exit 0).
"""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from tiersync import cli

NOT_HERE = "203.0.113.7"  # TEST-NET-3 (RFC 5737): never an address of this host
HAS_GRPC = importlib.util.find_spec("grpc") is not None
needs_grpc = pytest.mark.skipif(not HAS_GRPC, reason="registry needs grpcio (the net extra)")
# (subcommand and its required flags, the flag naming the listen address)
SERVERS = [
    pytest.param(["store-node", "--capacity", "4MiB"], "--host", id="store-node"),
    pytest.param(["registry"], "--host", id="registry", marks=needs_grpc),
    pytest.param(["metrics"], "--addr", id="metrics"),
    pytest.param(
        ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "--host", id="router"
    ),
]


def _tiersync(*args: str, timeout: float = 60, code: str = "pass") -> subprocess.CompletedProcess:
    """Run ``tiersync ARGS`` in a fresh interpreter (after ``code``, e.g. hiding a module)."""
    run = f"import sys; {code}; from tiersync.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, cli.TINY_ENV: "1"}
    env.pop("TIERSYNC_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-c", run, *args], check=False, capture_output=True, text=True, timeout=timeout, env=env
    )


def _assert_clear(proc: subprocess.CompletedProcess, flag: str, *, not_named: str = "") -> str:
    """Exit 2, no traceback, and the last line of stderr names ``flag``; returns that line."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tiersync ") and flag in last, proc.stderr
    assert not not_named or not_named not in proc.stderr, proc.stderr
    return last


@pytest.fixture
def busy_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


@pytest.mark.parametrize(("command", "host_flag"), SERVERS)
def test_port_in_use_names_port(command, host_flag, busy_port):
    line = _assert_clear(_tiersync(*command, "--port", str(busy_port)), "--port")
    assert "already in use" in line and str(busy_port) in line


@pytest.mark.parametrize(("command", "host_flag"), SERVERS)
def test_address_not_on_this_host_names_the_host_flag(command, host_flag):
    line = _assert_clear(_tiersync(*command, "--port", "0", host_flag, NOT_HERE), host_flag)
    assert "not an address of this host" in line


@pytest.mark.parametrize(("command", "host_flag"), SERVERS)
def test_port_out_of_range_names_port(command, host_flag):
    _assert_clear(_tiersync(*command, "--port", "99999"), "--port", not_named="address:")


@pytest.mark.parametrize(
    ("args", "flag", "internal"),
    [
        (["registry", "--port", "0", "--store-ttl-s", "-1"], "--store-ttl-s", "heartbeat_interval_s"),
        (["registry", "--port", "0", "--block-ttl-s", "0"], "--block-ttl-s", "block_ttl_s"),
        (["registry", "--port", "0", "--block-ttl-s", "600"], "--block-ttl-s", "block_ttl_s"),
        (["registry", "--port", "0", "--token-file", "/nonexistent/token"], "--token-file", ": token:"),
        (["store-node", "--capacity", "banana", "--port", "0"], "--capacity", ": size:"),
        (["store-node", "--capacity", "4MiB", "--block-size", "0", "--port", "0"], "--block-size", ": size:"),
        (["store-node", "--capacity", "4MiB", "--block-size", "3", "--port", "0"], "--block-size", ": block_size:"),
        (["store-node", "--capacity", "512KiB", "--port", "0"], "--capacity", ": capacity:"),
        (["store-node", "--capacity", "4MiB", "--port", "0", "--heartbeat-s", "-1"], "--heartbeat-s", "heartbeat_s"),
        (
            ["store-node", "--capacity", "4MiB", "--port", "0", "--registry", "127.0.0.1:99999"],
            "--registry",
            ": registry:",
        ),
        (
            ["store-node", "--capacity", "4MiB", "--port", "0", "--kv-events-endpoint", "5557"],
            "--kv-events-endpoint",
            ": endpoint:",
        ),
        (
            ["store-node", "--capacity", "4MiB", "--port", "0", "--kv-events-replay", "tcp://127.0.0.1:0"],
            "--kv-events-replay",
            ": replay_endpoint:",
        ),
        (
            ["router", "--prefill", "localhost:8000", "--decode", "http://127.0.0.1:2", "--port", "0"],
            "--prefill",
            ": prefill:",
        ),
        (
            [
                "router",
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
                "--port",
                "0",
                "--timeout-s",
                "0",
            ],
            "--timeout-s",
            ": timeout_s:",
        ),
        (
            ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"]
            + ["--max-body", "512MiB"],
            "--max-body",
            ": max_body:",
        ),
        (
            ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"]
            + ["--max-connections", "0"],
            "--max-connections",
            ": max_connections:",
        ),
    ],
)
def test_bad_value_names_the_flag_not_the_field(args, flag, internal):
    _assert_clear(_tiersync(*args), flag, not_named=internal)


def test_capacity_beyond_memory_names_capacity():
    # ~195 PiB: more than any address space, so mmap fails (ENOMEM) whatever the overcommit policy
    line = _assert_clear(
        _tiersync("store-node", "--capacity", "200000TiB", "--block-size", "1GiB", "--port", "0"), "--capacity"
    )
    assert "memory" in line


@needs_grpc
def test_bad_redis_url_names_redis():
    pytest.importorskip("redis")
    _assert_clear(_tiersync("registry", "--port", "0", "--redis", "notaurl"), "--redis")


@pytest.mark.parametrize(
    "args",
    [["registry", "--port", "0"], ["store-node", "--capacity", "4MiB", "--port", "0", "--registry", "127.0.0.1:1"]],
)
def test_missing_net_extra_says_what_to_install(args):
    proc = _tiersync(*args, code="sys.modules['grpc'] = None")  # import grpc raises ModuleNotFoundError
    line = _assert_clear(proc, "pip install 'tiersync[net]'")
    assert "ModuleNotFoundError" not in proc.stderr, line


def test_bench_cases_matching_nothing_is_refused_before_any_process():
    t0 = time.monotonic()
    line = _assert_clear(_tiersync("bench", "weights", "--cases", "nomatch", timeout=30), "--cases")
    assert "no case matches" in line and "1t-2s" in line  # the tiny cases are listed
    assert time.monotonic() - t0 < 20  # refused up front: no model built, no process spawned


def test_bench_runner_refuses_an_empty_report_under_cases(monkeypatch):
    import types

    from tiersync import bench
    from tiersync.errors import UsageError

    fake = types.ModuleType("tiersync_fake_suite")
    fake.run = lambda config: {"suite": "fake", "results": []}
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(bench.SUITES, "fake", fake.__name__)
    config = types.SimpleNamespace(suite="fake", cases="nomatch")
    with pytest.raises(UsageError, match="--cases: no case matches"):
        bench.run_suite(config)
    config.cases = None
    assert bench.run_suite(config)["results"] == []


def _wait_for(stream, needle: str, timeout: float = 60) -> str:
    """The first line of ``stream`` containing ``needle`` (the server's startup line)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and select.select([stream], [], [], left)[0]:
        line = stream.readline()
        if not line:
            break
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r} within {timeout} s")


@pytest.mark.parametrize(
    ("command", "startup", "on_stderr"),
    [
        pytest.param(["registry", "--port", "0"], "listening on", False, id="registry", marks=needs_grpc),
        pytest.param(["metrics", "--port", "0"], "serving http://", True, id="metrics"),
        pytest.param(["store-node", "--capacity", "4MiB", "--port", "0"], "listening on", False, id="store-node"),
        pytest.param(
            ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "0"],
            "listening on",
            False,
            id="router",
        ),
    ],
)
def test_sigterm_stops_a_server_as_ctrl_c_does(command, startup, on_stderr):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiersync.cli", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(proc.stderr if on_stderr else proc.stdout, startup)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and f"tiersync {command[0]}: stopped" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_python_dash_m_tiersync_is_the_command():
    ok = subprocess.run(
        [sys.executable, "-m", "tiersync", "--version"], check=False, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and ok.stdout.startswith("tiersync ")
    bad = subprocess.run(
        [sys.executable, "-m", "tiersync", "bench", "workload", "--cases", "nomatch-at-all", "--workers", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--workers" in bad.stderr


def test_shm_list_tells_a_running_publishers_weight_segment_from_a_stale_one(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=False, capture_output=True, text=True
    )
    live, stale = (tmp_path / f"tiersync-weights-{pid}-0-abcd1234-0" for pid in (os.getpid(), int(dead.stdout)))
    for path in (live, stale):
        path.write_bytes(b"\0" * 4096)
    out = _tiersync("shm", "list", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert f"pid {os.getpid()} (running)" in lines[str(live)] and "stale" in lines[str(stale)]
    refused = _tiersync("shm", "reclaim", str(live), str(stale))
    assert refused.returncode == 1 and "running process" in refused.stderr and "Traceback" not in refused.stderr
    assert live.exists() and not stale.exists()
