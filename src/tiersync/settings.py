"""Where a component's settings come from, besides the code that builds it. The first that has
a key wins: the settings given explicitly (vLLM's ``kv_connector_extra_config``, the flags
typed), the environment, the config file named by ``$TIERSYNC_CONFIG_FILE``, the component's
defaults (the table, with how each source names a bad value, is in
:mod:`tiersync.integrations.vllm.config` and the README's "Configuration").

Each component has a table in the file and a prefix in the environment (:data:`SECTIONS`):
``[connector]`` / ``TIERSYNC_<KEY>`` for the vLLM connector, ``[store_node]`` /
``TIERSYNC_STORE_NODE_<KEY>`` for ``tiersync store-node``. Only a component's own keys are
read from the environment (other ``TIERSYNC_*`` variables are not settings of it, and are left
alone). In the file, a table other than these, or a key of the component's table that is not
one of its settings, is refused by name (a typo must not be ignored). The file is TOML
(:mod:`tomllib`), or YAML when its name ends in ``.yaml``/``.yml`` and PyYAML is installed.

This module merges and records origins; the component converts and validates the values,
naming the origin recorded here. It imports nothing from tiersync but :mod:`tiersync.errors`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from tiersync.errors import UsageError

__all__ = ["CONFIG_FILE_ENV", "SECTIONS", "Layered", "env_name", "layered", "read_section"]

CONFIG_FILE_ENV = "TIERSYNC_CONFIG_FILE"
SECTIONS = {"connector": "TIERSYNC_", "store_node": "TIERSYNC_STORE_NODE_"}  # file table -> env prefix


@dataclass(frozen=True, slots=True)
class Layered:
    """The merged settings of one component: ``values`` (key -> value as found: the
    environment's are strings) and ``origins`` (key -> where it came from, as the user wrote
    it: ``kv_connector_extra_config.host_bytes``, ``TIERSYNC_HOST_BYTES``,
    ``tiersync.toml: connector.host_bytes``). Keys set nowhere are absent from both."""

    values: dict[str, Any]
    origins: dict[str, str]


MAX_CONFIG_BYTES = 1 << 20


def env_name(section: str, key: str) -> str:
    """The environment variable of ``key`` for the component of ``section``."""
    return SECTIONS[section] + key.upper()


def layered(
    section: str,
    keys: Collection[str],
    explicit: Mapping[str, Any] | None = None,
    *,
    explicit_origin: Callable[[str], str] = str,
    environ: Mapping[str, str] | None = None,
) -> Layered:
    """Merge, for the component of ``section`` with settings ``keys``: ``explicit`` (named by
    ``explicit_origin(key)``) over ``environ`` (default :data:`os.environ`) over the file named
    by ``$TIERSYNC_CONFIG_FILE`` in ``environ``. ``explicit`` is taken as given (the caller
    refuses its unknown keys, naming them as its user knows them)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    path = env.get(CONFIG_FILE_ENV)
    if path:
        for key, value in read_section(path, section, keys).items():
            values[key], origins[key] = value, f"{path}: {section}.{key}"
    for key in keys:
        name = env_name(section, key)
        if name in env:
            values[key], origins[key] = env[name], name
    for key, value in (explicit or {}).items():
        values[key], origins[key] = value, explicit_origin(key)
    return Layered(values, origins)


def read_section(path: str, section: str, keys: Collection[str]) -> dict[str, Any]:
    """The ``[section]`` table of the config file at ``path`` ({} when it has none). Raises
    UsageError naming ``TIERSYNC_CONFIG_FILE`` when the file cannot be read or parsed, and
    naming the path and the table for a table or key that is not a setting."""
    doc = _load(path)
    if not isinstance(doc, dict):
        raise UsageError(f"{path} must hold tables such as [connector]", argument=CONFIG_FILE_ENV, path=path)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise UsageError(
            "unknown table(s) or key(s) outside a table: settings go in [connector] or [store_node]",
            argument=path,
            unknown=unknown,
            known=sorted(SECTIONS),
        )
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise UsageError("must be a table", argument=f"{path}: {section}")
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UsageError("unknown key(s)", argument=f"{path}: {section}", unknown=unknown, known=sorted(keys))
    return dict(table)


def _load(path: str) -> Any:
    """The parsed file: TOML, or YAML for a ``.yaml``/``.yml`` name (None for an empty YAML file)."""
    if not os.path.isfile(path) and os.path.exists(path):  # a FIFO or a device would block or never end
        raise UsageError(f"{path} is not a regular file", argument=CONFIG_FILE_ENV, path=path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", argument=CONFIG_FILE_ENV, path=path) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(
            f"{path} is over {MAX_CONFIG_BYTES} bytes: not a config file", argument=CONFIG_FILE_ENV, path=path
        )
    if path.endswith((".yaml", ".yml")):
        return _load_yaml(raw, path)
    import tomllib

    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}", argument=CONFIG_FILE_ENV, path=path) from None


def _load_yaml(raw: bytes, path: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise UsageError(
            f"{path} is YAML, which needs PyYAML (pip install pyyaml); or write it as TOML",
            argument=CONFIG_FILE_ENV,
            path=path,
        ) from None
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {exc}", argument=CONFIG_FILE_ENV, path=path) from None
    return {} if doc is None else doc
