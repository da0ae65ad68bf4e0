"""The connector's settings: vLLM's ``kv_connector_extra_config``, the environment and a config
file (:mod:`tiersync.settings`); the first source that has a key wins:

===========================================  ============================  ========================================
source, highest first                        how a key is written          a bad value is reported as
===========================================  ============================  ========================================
``kv_connector_extra_config``                ``{"host_bytes": "4GiB"}``    ``kv_connector_extra_config.host_bytes``
the environment: ``TIERSYNC_<KEY>``          ``TIERSYNC_HOST_BYTES=4GiB``  ``TIERSYNC_HOST_BYTES``
the file named by ``$TIERSYNC_CONFIG_FILE``  table ``[connector]``:        ``PATH: connector.host_bytes``
(TOML, or YAML: ``*.yaml`` and PyYAML)       ``host_bytes = "4GiB"``
the defaults below
===========================================  ============================  ========================================

Only the keys below are read from the environment (``TIERSYNC_TOKEN`` and the other variables
are not connector keys). A string value of a size, number or boolean key is converted as
written: sizes ``"4GiB"`` / ``"4096"``, ints, floats, booleans ``true``/``false``/``1``/``0``.
Unknown keys of the extra config and of the file's ``[connector]`` table are refused by name.
``tiersync store-node`` reads the same file's ``[store_node]`` table and
``TIERSYNC_STORE_NODE_<FLAG>`` under its flags (see :mod:`tiersync.cli`).

===================  =========================================================================
key                  meaning (default)
===================  =========================================================================
``host_bytes``       host DRAM for offloaded KV per worker, int or "4GiB" ("1GiB")
``storage_dir``      directory of the disk tier; every offloaded block is also written there,
                     and it survives engine restarts (None: no disk tier)
``eviction``         host eviction policy, "lru" or "s3fifo" ("lru")
``model_id``         the model's name in cache keys (the model path's last component);
                     ``$TIERSYNC_MODEL_ID`` is also the shm tier's model name
``weights_version``  bump it on a weight update so old KV is never reused ("0")
``transfer_workers`` copy threads per worker (2)
``load_timeout_s``   deadline of one load; a late load is reported failed and recomputed (120)
``async_disk_loads`` a load that reads disk runs in the background (vLLM's ``load_async``): the
                     request waits for it, the batch does not; False: read before the forward,
                     as host hits always are (True)
``role``             prefill->decode: "producer" / "consumer" set by ``kv_role``; read-only
``pd_host``          producer: address its KV server binds and advertises ("127.0.0.1")
``pd_port``          producer: port of its KV server (0: any free port)
``pd_token``         shared secret of the prefill->decode link, >= 16 bytes (None: no check);
                     prefer ``pd_token_file`` or ``$TIERSYNC_TOKEN``: a command line is
                     readable by every local user
``pd_token_file``    file holding that secret (read once, when the engine starts)
``pd_route``         prefill->decode on one host: "auto" (copy out of the producer's memory
                     when permitted, else TCP), "local" (insist), "tcp" ("auto")
``huge_pages``       prefill->decode: collapse the engine's KV tensors into transparent huge
                     pages in the background once registered (Linux 6.1+, best effort; the
                     same-host copy ran 1.3-1.6x faster out of them) (True)
``share_kv``         prefill->decode, producer: back the engine's KV tensors by sealed memfds
                     once registered (same addresses, same bytes) so a decode engine on this
                     host maps them and copies at memory speed instead of through
                     ``process_vm_readv``; any process of the same user may then read them;
                     a tensor in malloc's heap (a pool under 32 MiB a layer) stays private (True)
===================  =========================================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiersync.errors import UsageError, check_positive_int
from tiersync.net.config import coerce_token, token_from
from tiersync.settings import layered
from tiersync.sizes import parse_size
from tiersync.tiers.eviction import check_policy

__all__ = ["ConnectorConfig"]

_KEYS = {
    "host_bytes",
    "storage_dir",
    "eviction",
    "model_id",
    "weights_version",
    "transfer_workers",
    "load_timeout_s",
    "async_disk_loads",
    "pd_host",
    "pd_port",
    "pd_token",
    "pd_token_file",
    "pd_route",
    "huge_pages",
    "share_kv",
}
_KINDS = {
    "host_bytes": "size",
    "transfer_workers": "int",
    "pd_port": "int",
    "load_timeout_s": "float",
    "async_disk_loads": "bool",
    "huge_pages": "bool",
    "share_kv": "bool",
}  # how a string value of these keys is read; the others are strings
_EXPECTED = {
    "size": "must be a size such as 4GiB, or a number of bytes",
    "int": "must be an integer",
    "float": "must be a number",
    "bool": "must be true or false (or 1 or 0)",
}
_BOOLS = {"true": True, "1": True, "false": False, "0": False}
_EXTRA = "kv_connector_extra_config"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated connector settings (see the module docstring for each key)."""

    model_id: str
    host_bytes: int = 1 << 30
    storage_dir: str | None = None
    eviction: str = "lru"
    weights_version: str = "0"
    transfer_workers: int = 2
    load_timeout_s: float = 120.0
    async_disk_loads: bool = True
    pd_host: str = "127.0.0.1"
    pd_port: int = 0
    pd_token: str | bytes | None = None
    pd_route: str = "auto"
    huge_pages: bool = True
    share_kv: bool = True

    def __post_init__(self) -> None:
        check_positive_int(self.host_bytes, "kv_connector_extra_config.host_bytes")
        check_positive_int(self.transfer_workers, "kv_connector_extra_config.transfer_workers")
        for name in ("model_id", "weights_version", "pd_host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise UsageError("must be a non-empty str", argument=f"kv_connector_extra_config.{name}")
        check_policy(self.eviction, "kv_connector_extra_config.eviction")
        if self.storage_dir is not None and (not isinstance(self.storage_dir, str) or not self.storage_dir):
            raise UsageError("must be a directory path or None", argument="kv_connector_extra_config.storage_dir")
        t = self.load_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise UsageError("must be a positive number", argument="kv_connector_extra_config.load_timeout_s")
        for name in ("async_disk_loads", "huge_pages", "share_kv"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(
                    "must be true or false", argument=f"kv_connector_extra_config.{name}", value=getattr(self, name)
                )
        if not isinstance(self.pd_port, int) or isinstance(self.pd_port, bool) or not 0 <= self.pd_port < 65536:
            raise UsageError("must be a port number", argument="kv_connector_extra_config.pd_port")
        if self.pd_route not in ("auto", "local", "tcp"):
            raise UsageError(
                "must be 'auto', 'local' or 'tcp'", argument="kv_connector_extra_config.pd_route", value=self.pd_route
            )
        coerce_token(self.pd_token, "kv_connector_extra_config.pd_token")

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any] | None, model: str, environ: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config`` over ``$TIERSYNC_<KEY>`` over the config file's
        ``[connector]`` table (``environ``: default :data:`os.environ`). Unknown keys are refused
        (a typo must not silently disable the disk tier); a bad value's UsageError names where
        it came from, as the user wrote it."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise UsageError("unknown key(s)", argument=_EXTRA, unknown=unknown, known=sorted(_KEYS))
        got = layered("connector", _KEYS, extra, explicit_origin=f"{_EXTRA}.{{}}".format, environ=environ)
        values = {key: _convert(value, _KINDS.get(key), got.origins[key]) for key, value in got.values.items()}
        values.setdefault("model_id", os.path.basename(os.path.normpath(model)) or model)
        token_file = values.pop("pd_token_file", None)
        if values.get("pd_token") is None:  # the file, else $TIERSYNC_TOKEN (read here, at the edge)
            argument = got.origins.get("pd_token_file", f"{_EXTRA}.pd_token_file")
            values["pd_token"] = token_from(token_file, None if environ is None else dict(environ), argument=argument)
        try:
            return cls(**values)
        except UsageError as exc:
            raise _named(exc, got.origins) from None


def _convert(value: Any, kind: str | None, origin: str) -> Any:
    """A string ``value`` of a size, int, float or bool key as that type (other values as they are)."""
    if kind is None or not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if kind == "size":
            return parse_size(text)
        if kind == "bool":
            return _BOOLS[text.lower()]
        return int(text) if kind == "int" else float(text)
    except (ValueError, KeyError):
        raise UsageError(_EXPECTED[kind], argument=origin, value=value) from None


def _named(exc: UsageError, origins: Mapping[str, str]) -> UsageError:
    """``exc``, raised by validation naming ``kv_connector_extra_config.KEY``, naming instead where
    KEY's value came from (``TIERSYNC_KEY``, ``PATH: connector.KEY``)."""
    key = (exc.argument or "").removeprefix(f"{_EXTRA}.")
    origin = origins.get(key)
    if exc.argument is None or origin is None:
        return exc
    return UsageError(exc.message[len(exc.argument) + 2 :], argument=origin, **exc.context)
