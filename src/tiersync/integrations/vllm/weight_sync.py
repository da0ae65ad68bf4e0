"""Live weight updates of a running vLLM engine from a trainer's :class:`~tiersync.weights.WeightPublisher`.

The engine side is a vLLM worker extension; the driver side two helpers::

    llm = LLM(model=..., worker_extension_cls="tiersync.integrations.vllm.weight_sync.WeightSyncExtension")
    join_weight_sync(llm, {"publishers": ["trainer-host:7100"]})   # once: every worker registers
    ...                                # the trainer: publisher.publish(v) of its HF-named state_dict
    update_weights(llm, v)             # between steps: version v (or a later one) is live

Each worker runs a :class:`~tiersync.weights.WeightReceiver` (destination: the whole model,
replicated on every worker of the engine, so vLLM's ``load_weights`` does its own TP split).
The receiver follows the trainer in the background: every version the trainer publishes
lands in the worker's host buffer while the engine keeps serving. :func:`update_weights`
(an RPC run by the engine core between steps, so no forward pass sees a mix of versions)
waits until version ``v`` or a later one has landed, loads it into the model through vLLM's
in-place reload (``load_weights`` with HF names: ``q/k/v_proj`` -> ``qkv_proj``,
``gate/up_proj`` -> ``gate_up_proj``, then each layer's post-load processing such as the
CPU GEMM repacking), and resets vLLM's prefix cache, so no KV computed with the old weights
is reused. It returns the version applied.

KV connectors: vLLM's prefix cache is reset; the tiersync KV connector (``kv_both``) is told
the weights changed (:func:`tell_kv_connector`): its keys follow the new weights and a load
planned under the old ones is refused. Other connectors' ``reset_cache`` is called.

vLLM's own weight-transfer API (``weight_transfer_config={"backend": "tiersync"}``,
:mod:`tiersync.integrations.vllm.weight_transfer`) does the same through vLLM's routes and
``LLM`` methods; this extension remains for what that API cannot do: an update that waits for
"version v or a later one" and reports which version it applied, with its timings.

Failures raise :class:`~tiersync.errors.UsageError` (bad config, wrong order),
:class:`~tiersync.errors.RemoteError` (the trainer went away, the sync or the load failed in
the engine; the engine's message is in ``context``). A failed load (names the model does
not know, shape mismatch) can leave the model partly updated: the worker then reports no
version until a later update succeeds. Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tiersync.errors import (
    CapacityError,
    ClosedError,
    IntegrityError,
    RemoteError,
    TierSyncError,
    UsageError,
)
from tiersync.integrations.vllm.engine_receiver import EngineReceiver, tell_kv_connector
from tiersync.net.config import token_from
from tiersync.weights.config import ReceiverConfig, TransportKind, process_label

__all__ = ["EXTENSION", "WeightSyncConfig", "WeightSyncExtension", "join_weight_sync", "update_weights"]

#: The value of ``LLM(worker_extension_cls=...)``.
EXTENSION = "tiersync.integrations.vllm.weight_sync.WeightSyncExtension"
_PREFIX = "weight_sync"


@dataclass(frozen=True, slots=True)
class WeightSyncConfig:
    """Settings of the engine side; travels to the workers as a plain dict (:meth:`to_dict`).

    ``publishers``: every trainer shard's "host:port" in source-rank order.
    ``transport``: "auto" (shared memory on the trainer's host, else TCP), "shm" or "tcp".
    ``buffers``: 1 (default: one host copy of the model per worker; a sync of the next version
    waits while an update reads it) or 2 (the next version lands while an update runs).
    ``apply_timeout_s``: how long an update waits for its version to land.
    ``sync_timeout_s``, ``connect_timeout_s``, ``io_timeout_s``, ``streams``, ``window``: the receiver's
    (:class:`~tiersync.weights.ReceiverConfig`). ``sampler_id``: each worker's label in the trainer's
    results is ``"<sampler_id>-<rank>@<host>:<pid>"`` (default ``"vllm"``; one per worker of every
    engine). ``token``: the trainer's shared secret (str or bytes, >= 16 bytes; its
    ``PublisherConfig.token``), or ``token_file``: a file holding it (read here, on
    the driver). Raises UsageError naming ``weight_sync.<field>``.
    """

    publishers: tuple[str, ...]
    transport: str = "auto"
    buffers: int = 1
    apply_timeout_s: float = 600.0
    sync_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    io_timeout_s: float = 30.0
    streams: int = 4
    window: int = 4
    sampler_id: str | None = None
    token: str | bytes | None = field(default=None, repr=False)  # never printed
    token_file: str | None = None

    def __post_init__(self) -> None:
        if self.token_file is not None:  # read once; the workers get the token itself
            if self.token is not None:
                raise UsageError("give token or token_file, not both", argument=f"{_PREFIX}.token_file")
            object.__setattr__(self, "token", token_from(self.token_file, argument=f"{_PREFIX}.token_file"))
            object.__setattr__(self, "token_file", None)
        t = self.apply_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise UsageError("must be a number of seconds > 0", argument=f"{_PREFIX}.apply_timeout_s", value=t)
        if self.transport not in {k.value for k in TransportKind}:
            raise UsageError("must be 'auto', 'shm' or 'tcp'", argument=f"{_PREFIX}.transport", value=self.transport)
        try:
            cfg = self.receiver_config(0)
        except UsageError as exc:
            raise UsageError(
                exc.message.split(": ", 1)[-1], argument=f"{_PREFIX}.{exc.argument}", **exc.context
            ) from None
        object.__setattr__(self, "publishers", cfg.publishers)

    def receiver_config(self, rank: int) -> ReceiverConfig:
        """The :class:`ReceiverConfig` of worker ``rank``."""
        return ReceiverConfig(
            self.publishers,
            rank=rank,
            transport=TransportKind(self.transport),
            buffers=self.buffers,
            streams=self.streams,
            window=self.window,
            sync_timeout_s=self.sync_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            io_timeout_s=self.io_timeout_s,
            sampler_id=process_label(self.sampler_id or "vllm", rank),
            token=self.token,
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | WeightSyncConfig) -> WeightSyncConfig:
        """Parse a dict of the fields above; unknown keys are refused."""
        if isinstance(values, WeightSyncConfig):
            return values
        if not isinstance(values, Mapping):
            raise UsageError("expected a dict of WeightSyncConfig fields", argument=_PREFIX)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError("unknown key(s)", argument=_PREFIX, unknown=unknown, known=sorted(known))
        if "publishers" not in values:
            raise UsageError("is required", argument=f"{_PREFIX}.publishers")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what ``collective_rpc`` carries to the workers)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["publishers"] = list(self.publishers)
        return out


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods are called through
    ``llm.collective_rpc(name, args=...)``. Method names carry a ``tiersync_`` prefix, since
    vLLM refuses extension attributes its worker already has (``update_weights`` is one)."""

    def tiersync_join(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Register this worker with every trainer shard. Returns ``{"rank", "transports"}``.
        UsageError: bad config, joined already, or an engine the update would make serve stale
        KV (see the module docstring); RemoteError: a trainer shard is unreachable. Errors come
        back as a result (see :func:`_reported`)."""
        return _reported(self._tiersync_join, config)

    def _tiersync_join(self, config: Mapping[str, Any]) -> dict[str, Any]:
        cfg = WeightSyncConfig.from_dict(config)
        if getattr(self, "_tiersync_receiver", None) is not None:
            raise UsageError("this worker joined already; call tiersync_leave first", argument="config")
        world = int(self.vllm_config.parallel_config.world_size)
        rank = int(self.rank) % world
        self._tiersync_receiver = EngineReceiver(cfg.receiver_config(rank), world)
        self._tiersync_config, self._tiersync_applied = cfg, None
        return {"rank": rank, "transports": [t.value for t in self._tiersync_receiver.receiver.transports()]}

    def tiersync_apply(self, version: int) -> dict[str, Any]:
        """Load version ``version`` (or the later one that landed first) into the model.

        Returns ``{"version", "nbytes", "tensors", "wait_s", "load_s", "sync_s"}``: the
        version applied, its bytes and tensor count, the wait for it to land, the in-place
        load, and the receiver's own announce-to-landed time. Errors come back as a result."""
        return _reported(self._tiersync_apply, version)

    def _tiersync_apply(self, version: int) -> dict[str, Any]:
        receiver = getattr(self, "_tiersync_receiver", None)
        if receiver is None:
            raise UsageError("call tiersync_join before tiersync_apply", argument="version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise UsageError("must be an int >= 0", argument="version", value=version)
        t0 = time.perf_counter()
        result = receiver.wait(version, self._tiersync_config.apply_timeout_s)
        with receiver.receiver.acquire(self._tiersync_config.apply_timeout_s) as lease:
            t1 = time.perf_counter()
            self._tiersync_applied = None  # unknown until the load finishes
            try:
                self.reload_weights(weights_iterator=iter(receiver.named(lease.tensors)), is_checkpoint_format=True)
            finally:  # even a failed load may have changed some weights
                tell_kv_connector()
            self._tiersync_applied = applied = lease.version
            nbytes = sum(a.nbytes for a in lease.tensors.values())
        return {
            "version": applied,
            "nbytes": nbytes,
            "tensors": len(lease.tensors),
            "wait_s": t1 - t0,
            "load_s": time.perf_counter() - t1,
            "sync_s": result.seconds,
        }

    def tiersync_weights_version(self) -> int | None:
        """The version last applied to the model (None before the first, or after a failed load)."""
        return getattr(self, "_tiersync_applied", None)

    def tiersync_leave(self) -> None:
        """Disconnect from the trainer and free the host buffers; the model keeps its weights."""
        receiver = getattr(self, "_tiersync_receiver", None)
        self._tiersync_receiver = None
        if receiver is not None:
            receiver.close()


_ERRORS = {c.__name__: c for c in (UsageError, ClosedError, CapacityError, RemoteError, IntegrityError)}


def _reported(fn: Any, *args: Any) -> Any:
    """Run ``fn`` in the worker; a failure becomes the result ``{"tiersync_error": type name,
    "message", "argument", "context"}``, since vLLM re-raises worker exceptions on the driver as
    plain ``Exception`` (type and context lost). :func:`_rpc` raises it again as that type."""
    try:
        return fn(*args)
    except TierSyncError as exc:
        kind, message, context = type(exc).__name__, exc.message, exc.context
        argument = getattr(exc, "argument", None)
        if argument is not None and message.startswith(f"{argument}: "):
            message = message[len(argument) + 2 :]
    except Exception as exc:  # noqa: BLE001 - e.g. load_weights on names the model does not know
        kind, message, context, argument = "RemoteError", f"{type(exc).__name__}: {exc}", {}, None
    if kind not in _ERRORS:
        kind = "RemoteError"
    return {
        "tiersync_error": kind,
        "message": message,
        "argument": argument,
        "context": {
            k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in context.items()
        },
    }


def _raise(report: Mapping[str, Any], method: str) -> None:
    cls = _ERRORS.get(report["tiersync_error"], RemoteError)
    context = {**report.get("context", {}), "rpc": method}
    if issubclass(cls, UsageError):
        raise cls(report["message"], argument=report.get("argument"), **context)
    if cls is RemoteError:
        context.pop("peer", None)
        raise RemoteError(report["message"], peer="vllm-worker", **context)
    raise cls(report["message"], **context)


def join_weight_sync(llm: Any, config: Mapping[str, Any] | WeightSyncConfig) -> list[dict[str, Any]]:
    """Register every worker of ``llm`` (a ``vllm.LLM`` built with ``worker_extension_cls=EXTENSION``)
    with the trainer. Validates ``config`` here first (UsageError naming the field); one dict
    per worker back (see :meth:`WeightSyncExtension.tiersync_join`)."""
    cfg = WeightSyncConfig.from_dict(config)
    return _rpc(llm, "tiersync_join", (cfg.to_dict(),), None)


def update_weights(llm: Any, version: int, *, reset_running_requests: bool = False) -> dict[str, Any]:
    """Make version ``version`` (or a later one already landed) the engine's weights, then reset
    the prefix cache (and a connector's cache) so no KV of the old weights is reused.

    Call it between ``generate`` calls, or with ``reset_running_requests=True`` while requests
    run (vLLM preempts them; they recompute with the new weights). Returns worker 0's result
    (:meth:`WeightSyncExtension.tiersync_apply`) plus ``"workers"``, all of them. RemoteError
    when a worker failed or the workers applied different versions, or the cache could not be
    reset (running requests hold it: the weights are new then, the cache is not)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise UsageError("must be an int >= 0", argument="version", value=version)
    results = _rpc(llm, "tiersync_apply", (version,), version)
    applied = {r["version"] for r in results}
    if len(applied) != 1:
        raise RemoteError("workers applied different versions", version=version, applied=sorted(applied))
    if not llm.reset_prefix_cache(reset_running_requests=reset_running_requests, reset_connector=True):
        raise RemoteError(
            "weights updated but the prefix cache was not reset (requests are running); "
            "call llm.reset_prefix_cache() once they finish, or pass reset_running_requests=True",
            version=results[0]["version"],
        )
    return {**results[0], "workers": results}


def _rpc(llm: Any, method: str, args: tuple, version: int | None) -> list[Any]:
    """``llm.collective_rpc``; a worker's reported failure (:func:`_reported`) is raised again as
    its tiersync type, any other failure of the RPC as RemoteError with the engine's message."""
    try:
        results = list(llm.collective_rpc(method, args=args))
    except Exception as exc:
        raise RemoteError(
            f"{method} failed in the engine", peer="vllm", version=version, engine_error=f"{type(exc).__name__}: {exc}"
        ) from exc
    for r in results:
        if isinstance(r, Mapping) and "tiersync_error" in r:
            _raise(r, method)
    return results
