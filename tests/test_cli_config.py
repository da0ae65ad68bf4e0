"""``tiersync store-node`` takes each flag not typed from ``TIERSYNC_STORE_NODE_<FLAG>``, else from
the ``[store_node]`` table of the file named by ``TIERSYNC_CONFIG_FILE``, else its default; a bad
value is one line naming the variable or the file's key (exit 2). Real processes, real files."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from tiersync import cli


def _env(**variables: str) -> dict[str, str]:
    """This environment without any TIERSYNC_* variable, plus ``variables``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TIERSYNC_")}, **variables}


def _store_node(*flags: str, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tiersync", "store-node", *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(**variables),
    )


def _usage_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == cli.EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def _listening_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and select.select([proc.stdout], [], [], left)[0]:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on" in line:
            return line
    raise AssertionError(f"no 'listening on' line within {timeout} s: {proc.stderr.read() if proc.poll() else ''}")


def test_flag_over_environment_over_file_over_default(tmp_path):
    path = tmp_path / "tiersync.toml"
    path.write_text('[store_node]\ncapacity = "8MiB"\nport = 0\nblock_size = "2MiB"\nhost = "127.0.0.1"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiersync", "store-node", "--capacity", "4MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(TIERSYNC_CONFIG_FILE=str(path), TIERSYNC_STORE_NODE_BLOCK_SIZE="512KiB"),
    )
    try:
        line = _listening_line(proc)
        # capacity: the flag (4MiB, not the file's 8MiB); block size: the variable (not the file's 2MiB);
        # port and host: the file
        assert "listening on 127.0.0.1:" in line and "(8 blocks x 524288 B)" in line, line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_a_bad_variable_is_named(tmp_path):
    line = _usage_line(_store_node("--capacity", "4MiB", TIERSYNC_STORE_NODE_PORT="99999"))
    assert line.startswith("tiersync store-node: TIERSYNC_STORE_NODE_PORT: must be a port"), line
    line = _usage_line(_store_node("--port", "0", TIERSYNC_STORE_NODE_CAPACITY="512KiB"))  # < one block
    assert line.startswith("tiersync store-node: TIERSYNC_STORE_NODE_CAPACITY: "), line


def test_a_port_in_use_from_the_file_names_the_files_key(tmp_path):
    path = tmp_path / "node.toml"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        path.write_text(f'[store_node]\ncapacity = "4MiB"\nport = {busy.getsockname()[1]}\n')
        line = _usage_line(_store_node(TIERSYNC_CONFIG_FILE=str(path)))
    assert line.startswith(f"tiersync store-node: {path}: store_node.port: port ") and "already in use" in line


def test_unknown_key_in_the_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[store_node]\ncapacity = "4MiB"\nport = 0\nblok_size = "2MiB"\n')
    line = _usage_line(_store_node(TIERSYNC_CONFIG_FILE=str(path)))
    assert str(path) in line and "'blok_size'" in line, line


def test_a_required_flag_set_nowhere_names_the_flag_and_where_else_it_may_be_set(tmp_path):
    line = _usage_line(_store_node("--port", "0"))
    assert line.startswith("tiersync store-node: --capacity: required") and "TIERSYNC_STORE_NODE_CAPACITY" in line
    line = _usage_line(_store_node("--capacity", "4MiB", TIERSYNC_CONFIG_FILE=str(tmp_path / "none.toml")))
    assert line.startswith("tiersync store-node: TIERSYNC_CONFIG_FILE: cannot read"), line


@pytest.mark.parametrize("value", ["true", "[1, 2]"])
def test_a_file_value_that_is_not_a_string_or_number_is_refused(tmp_path, value):
    path = tmp_path / "node.toml"
    path.write_text(f'[store_node]\ncapacity = "4MiB"\nport = 0\nstore_id = {value}\n')
    line = _usage_line(_store_node(TIERSYNC_CONFIG_FILE=str(path)))
    assert line == f"tiersync store-node: {path}: store_node.store_id: must be a string or a number", line
