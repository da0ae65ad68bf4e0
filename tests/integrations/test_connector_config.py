"""The connector's settings come from ``kv_connector_extra_config``, then ``TIERSYNC_<KEY>``, then
the ``[connector]`` table of the file named by ``TIERSYNC_CONFIG_FILE``, then the defaults; a bad
value's UsageError names where it came from, as the user wrote it. No vLLM needed: the config
is built as the connector builds it (``ConnectorConfig.from_extra``), in this process with an
explicit environment, and in a fresh interpreter started with the variables set."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tiersync.errors import UsageError
from tiersync.integrations.vllm.config import ConnectorConfig
from tiersync.settings import layered

MODEL = "/models/tiny-llama"
TOKEN = "connector-config-test-token-0001"  # >= 16 bytes


def _file(tmp_path, text: str, name: str = "tiersync.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _refused(extra: dict | None, environ: dict) -> UsageError:
    with pytest.raises(UsageError) as info:
        ConnectorConfig.from_extra(extra, MODEL, environ)
    return info.value


def test_extra_over_environment_over_file_over_defaults(tmp_path):
    path = _file(
        tmp_path, '[connector]\nhost_bytes = "2GiB"\ntransfer_workers = 4\neviction = "s3fifo"\nload_timeout_s = 30\n'
    )
    env = {"TIERSYNC_CONFIG_FILE": path, "TIERSYNC_HOST_BYTES": "3GiB", "TIERSYNC_TRANSFER_WORKERS": "5"}
    cfg = ConnectorConfig.from_extra({"transfer_workers": 6}, MODEL, env)
    assert cfg.transfer_workers == 6  # extra over environment over file
    assert cfg.host_bytes == 3 << 30  # environment over file
    assert cfg.eviction == "s3fifo" and cfg.load_timeout_s == 30  # file over defaults
    assert cfg.weights_version == "0" and cfg.model_id == "tiny-llama" and cfg.async_disk_loads is True
    keys = {"host_bytes", "transfer_workers", "eviction", "load_timeout_s", "pd_port"}
    got = layered(
        "connector", keys, {"transfer_workers": 6}, explicit_origin="kv_connector_extra_config.{}".format, environ=env
    )
    assert got.origins == {
        "transfer_workers": "kv_connector_extra_config.transfer_workers",
        "host_bytes": "TIERSYNC_HOST_BYTES",
        "eviction": f"{path}: connector.eviction",
        "load_timeout_s": f"{path}: connector.load_timeout_s",
    }
    assert got.values == {"transfer_workers": 6, "host_bytes": "3GiB", "eviction": "s3fifo", "load_timeout_s": 30}
    assert "pd_port" not in got.values  # set nowhere: the component's default applies


def test_no_file_no_variables_is_the_defaults():
    assert ConnectorConfig.from_extra(None, MODEL, {}) == ConnectorConfig(model_id="tiny-llama")


def test_environment_strings_are_read_as_the_extra_configs_are(tmp_path):
    env = {
        "TIERSYNC_HOST_BYTES": "512MiB",
        "TIERSYNC_STORAGE_DIR": str(tmp_path),
        "TIERSYNC_PD_PORT": "7001",
        "TIERSYNC_LOAD_TIMEOUT_S": "2.5",
        "TIERSYNC_ASYNC_DISK_LOADS": "false",
        "TIERSYNC_MODEL_ID": "m1",
    }
    cfg = ConnectorConfig.from_extra({}, MODEL, env)
    assert (cfg.host_bytes, cfg.storage_dir, cfg.pd_port, cfg.load_timeout_s) == (512 << 20, str(tmp_path), 7001, 2.5)
    assert cfg.async_disk_loads is False and cfg.model_id == "m1"
    for text, value in (("TRUE", True), ("1", True), ("0", False), (" False ", False)):
        assert ConnectorConfig.from_extra({}, MODEL, {"TIERSYNC_ASYNC_DISK_LOADS": text}).async_disk_loads is value
    assert ConnectorConfig.from_extra({"host_bytes": "4096", "async_disk_loads": "0"}, MODEL, {}).host_bytes == 4096
    assert ConnectorConfig.from_extra({}, MODEL, {}).huge_pages is True
    assert ConnectorConfig.from_extra({}, MODEL, {"TIERSYNC_HUGE_PAGES": "false"}).huge_pages is False
    assert ConnectorConfig.from_extra({}, MODEL, {}).share_kv is True
    assert ConnectorConfig.from_extra({"share_kv": "0"}, MODEL, {}).share_kv is False


def test_other_tiersync_variables_are_not_connector_keys():
    env = {
        "TIERSYNC_TOKEN": TOKEN,
        "TIERSYNC_VLLM_PYTHON": "/nowhere/python",
        "TIERSYNC_REQUIRE_NATIVE": "1",
        "TIERSYNC_ROLE": "producer",
        "TIERSYNC_STORE_NODE_CAPACITY": "banana",
        "TIERSYNC_NO_SUCH_KEY": "x",
    }
    cfg = ConnectorConfig.from_extra({}, MODEL, env)
    assert cfg.pd_token == TOKEN.encode() and cfg.host_bytes == 1 << 30  # $TIERSYNC_TOKEN keeps its meaning


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[connector]\nhost_byte = "4GiB"\n', ["host_byte"]),  # a typo in the connector's table
        ('host_bytes = "4GiB"\n', ["host_bytes"]),  # a key outside any table
        ('[conector]\nhost_bytes = "4GiB"\n', ["conector"]),  # a typo in a table's name
    ],
)
def test_unknown_file_key_is_refused_naming_it_and_the_file(tmp_path, text, named):
    path = _file(tmp_path, text)
    err = _refused({}, {"TIERSYNC_CONFIG_FILE": path})
    assert path in err.argument and err.context["unknown"] == named and repr(named[0]) in str(err)


def test_a_table_that_is_not_a_table_is_refused(tmp_path):
    path = _file(tmp_path, 'connector = "4GiB"\n')
    assert _refused({}, {"TIERSYNC_CONFIG_FILE": path}).argument == f"{path}: connector"


@pytest.mark.parametrize(
    ("where", "key", "value", "expected"),
    [
        ("env", "host_bytes", "lots", "must be a size"),
        ("env", "async_disk_loads", "maybe", "true or false"),
        ("env", "transfer_workers", "two", "integer"),
        ("env", "eviction", "fifo", "unknown eviction policy"),  # refused by the config's own checks
        ("env", "pd_token", "short", "at least 16 bytes"),
        ("file", "host_bytes", '"lots"', "must be a size"),
        ("file", "transfer_workers", "0", "positive int"),
        ("file", "load_timeout_s", '"soon"', "must be a number"),
        ("extra", "host_bytes", "lots", "must be a size"),
        ("extra", "pd_route", "carrier-pigeon", "'auto', 'local' or 'tcp'"),
        ("env", "huge_pages", "often", "true or false"),
        ("extra", "huge_pages", "yes", "true or false"),
        ("env", "share_kv", "sometimes", "true or false"),
    ],
)
def test_a_bad_value_names_where_it_came_from(tmp_path, where, key, value, expected):
    path = _file(tmp_path, "[connector]\n" + (f"{key} = {value}\n" if where == "file" else ""))
    env = {"TIERSYNC_CONFIG_FILE": path, **({f"TIERSYNC_{key.upper()}": value} if where == "env" else {})}
    err = _refused({key: value} if where == "extra" else {}, env)
    origin = {
        "env": f"TIERSYNC_{key.upper()}",
        "file": f"{path}: connector.{key}",
        "extra": f"kv_connector_extra_config.{key}",
    }[where]
    assert err.argument == origin and str(err).startswith(f"{origin}: ") and expected in str(err)
    assert key != "pd_token" or value not in str(err)  # a secret is never echoed


def test_a_token_file_that_cannot_be_read_names_the_variable(tmp_path):
    err = _refused({}, {"TIERSYNC_PD_TOKEN_FILE": str(tmp_path / "missing")})
    assert err.argument == "TIERSYNC_PD_TOKEN_FILE"


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("missing.toml", None, "cannot read"),
        ("broken.toml", "[connector]\nhost_bytes = \n", "not valid TOML"),
        ("binary.toml", b"\xff\xfe[connector]", "not valid TOML"),
    ],
)
def test_a_config_file_that_cannot_be_read_names_the_variable(tmp_path, name, text, expected):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    err = _refused({}, {"TIERSYNC_CONFIG_FILE": str(path)})
    assert err.argument == "TIERSYNC_CONFIG_FILE" and expected in str(err) and str(path) in str(err)


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML is not installed")
def test_a_yaml_file_is_read_as_yaml(tmp_path):
    path = _file(tmp_path, "connector:\n  host_bytes: 2GiB\n  async_disk_loads: false\n", "tiersync.yaml")
    cfg = ConnectorConfig.from_extra({}, MODEL, {"TIERSYNC_CONFIG_FILE": path})
    assert cfg.host_bytes == 2 << 30 and cfg.async_disk_loads is False
    bad = _file(tmp_path, "connector: [host_bytes\n", "bad.yaml")
    assert _refused({}, {"TIERSYNC_CONFIG_FILE": bad}).argument == "TIERSYNC_CONFIG_FILE"


PRINT_CONFIG = (
    "import dataclasses, json, sys; from tiersync.integrations.vllm.config import ConnectorConfig; "
    "print(json.dumps(dataclasses.asdict(ConnectorConfig.from_extra(json.loads(sys.argv[1]), "
    "'/models/tiny-llama')), default=repr))"
)


def _print_config(extra: dict, **variables: str) -> subprocess.CompletedProcess:
    """Build the config as the connector does, in a fresh interpreter whose environment has no
    TIERSYNC_* variable but ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSYNC_")}
    return subprocess.run(
        [sys.executable, "-c", PRINT_CONFIG, json.dumps(extra)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, **variables},
    )


def test_a_process_started_with_a_config_file_builds_its_config_from_it(tmp_path):
    path = _file(
        tmp_path,
        f'[connector]\nhost_bytes = "256MiB"\nstorage_dir = "{tmp_path}"\neviction = "s3fifo"\npd_port = 7003\n',
    )
    proc = _print_config(
        {"pd_port": 7004}, TIERSYNC_CONFIG_FILE=path, TIERSYNC_EVICTION="lru", TIERSYNC_WEIGHTS_VERSION="7"
    )
    assert proc.returncode == 0, proc.stderr
    expected = dataclasses.asdict(
        ConnectorConfig(
            model_id="tiny-llama",
            host_bytes=256 << 20,
            storage_dir=str(tmp_path),
            eviction="lru",
            weights_version="7",
            pd_port=7004,
        )
    )
    assert json.loads(proc.stdout) == expected
    bad = _print_config({}, TIERSYNC_CONFIG_FILE=str(tmp_path / "nowhere.toml"))
    assert bad.returncode != 0 and "UsageError: TIERSYNC_CONFIG_FILE: cannot read" in bad.stderr
