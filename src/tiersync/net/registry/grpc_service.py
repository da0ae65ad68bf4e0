"""gRPC control plane for the registry (``grpcio`` imported here only).

The service ``tiersync.registry.v1.Registry`` is defined with grpcio's generic handlers
and bytes messages encoded by :mod:`tiersync.net.registry.messages`, so there is no
protoc/codegen step and no generated files to keep in sync; the schema lives in one small
Python module shared by client and server. The version is in the service's name
(:data:`SERVICE`): a client and a server of message schemas that differ never read each
other's bytes; the client's calls fail UNIMPLEMENTED, reported as a registry that speaks
another version (a change to a message takes a new version).

:class:`RegistryClient` implements :class:`Registry`. On an outage
``lookup`` and ``placement_targets`` never raise: they log, count
(``client.failures``) and return what they have (unanswered keys get ``()``).
Writes raise :class:`RegistryUnavailableError`, or :class:`~tiersync.net.errors.AuthError`
when the server refuses the token (``RegistryConfig.token``; lookups then degrade as on an
outage). A server given a token refuses every call without its proof (:mod:`.auth`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import grpc

from tiersync.errors import TierSyncError, UsageError
from tiersync.net.config import coerce_token
from tiersync.net.errors import AuthError, ProtocolError, ProtocolFault
from tiersync.net.registry import messages as m
from tiersync.net.registry.auth import METADATA_KEY, WINDOW_S, Replays, check_proof, proof
from tiersync.net.registry.base import Registry, RegistryConfig, StoreInfo, check_keys
from tiersync.net.registry.errors import RegistryUnavailableError
from tiersync.net.tls import TlsConfig

log = logging.getLogger(__name__)
SERVICE = "tiersync.registry.v1.Registry"
"""The gRPC service name: the version of the messages' schema is part of it."""
_CHANGES = frozenset({"Publish", "Unpublish", "RegisterStore", "RemoveStore", "Heartbeat"})  # calls that change state


def _methods(backend: Registry) -> dict[str, Callable[[bytes], bytes]]:
    def publish(data: bytes) -> bytes:
        backend.publish(*m.dec_store_keys(data))
        return b""

    def unpublish(data: bytes) -> bytes:
        backend.unpublish(*m.dec_store_keys(data))
        return b""

    def register(data: bytes) -> bytes:
        infos = m.dec_infos(data)  # one store a call, as RegistryClient sends it (not 65,536 at once)
        if len(infos) != 1:
            raise UsageError(f"a RegisterStore call carries one store, not {len(infos)}", argument="RegisterStore")
        backend.register_store(infos[0])
        return b""

    def remove(data: bytes) -> bytes:
        backend.remove_store(m.dec_text(data))
        return b""

    def get(data: bytes) -> bytes:
        info = backend.get_store(m.dec_text(data))
        return m.enc_infos([info] if info is not None else [])

    return {
        "Lookup": lambda data: m.enc_owners(backend.lookup(m.dec_keys(data))),
        "Publish": publish,
        "Unpublish": unpublish,
        "RegisterStore": register,
        "RemoveStore": remove,
        "Heartbeat": lambda data: b"\x01" if backend.heartbeat(*m.dec_heartbeat(data)) else b"\x00",
        "GetStore": get,
        "Targets": lambda data: m.enc_infos(backend.placement_targets(*m.dec_targets(data))),
    }


class _Gate:
    """The token check of every call when the server has a token; refusals logged like the wire
    stack's (the first ten, then every thousandth)."""

    def __init__(self, token: bytes | None, backend: Registry) -> None:
        self.token, self.refused, self._lock = token, 0, threading.Lock()
        self.replays, self._backend = Replays(), backend

    def check(self, name: str, data: bytes, context: grpc.ServicerContext) -> None:
        if self.token is None:
            return
        value = next((v for k, v in context.invocation_metadata() if k == METADATA_KEY), None)
        try:
            value = value if isinstance(value, str) else None
            changes = name in _CHANGES  # only their proofs are recorded: a replayed read changes nothing
            nonce = check_proof(
                self.token, name, data, value, peer=context.peer(), replays=self.replays if changes else None
            )
            if changes and not self._backend.take_once(f"proof:{nonce}", 2 * WINDOW_S):
                raise AuthError("registry token proof used before (a replayed call)", peer=context.peer())
        except RegistryUnavailableError as exc:  # the shared record is down: so is the backend
            context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
        except AuthError as exc:
            with self._lock:
                self.refused += 1
                n = self.refused
            level = logging.WARNING if n <= 10 or n % 1000 == 0 else logging.DEBUG
            log.log(level, "registry refused a %s call: %s (%d refused so far)", name, exc.message, n)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)


def _wrap(name: str, fn: Callable[[bytes], bytes], gate: _Gate) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def handler(data: bytes, context: grpc.ServicerContext) -> bytes:
        gate.check(name, data, context)  # aborts the call (raises) when the proof fails
        try:
            return fn(data)
        except RegistryUnavailableError as exc:  # the backend (e.g. Redis) is down: retryable
            context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
            raise  # never reached: abort raises (grpc is untyped here, so mypy cannot know that)
        except TierSyncError as exc:  # malformed message or bad argument: the caller's fault
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            raise

    return handler


def _read(path: str | None, argument: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", argument=argument) from None


def _server_credentials(tls: TlsConfig | None) -> grpc.ServerCredentials | None:
    if tls is None:
        return None
    if not isinstance(tls, TlsConfig):
        raise UsageError("must be a TlsConfig or None", argument="tls")
    if tls.certfile is None:
        raise UsageError("a TLS registry needs certfile and keyfile", argument="tls")
    pair = (_read(tls.keyfile, "tls.keyfile"), _read(tls.certfile, "tls.certfile"))
    ca = _read(tls.cafile, "tls.cafile")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=tls.require_peer_cert)


def _channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.cafile, "tls.cafile"),
        private_key=_read(tls.keyfile, "tls.keyfile"),
        certificate_chain=_read(tls.certfile, "tls.certfile"),
    )


class RegistryServer:
    """A running registry service; ``address`` is "127.0.0.1:port"."""

    def __init__(self, server: grpc.Server, address: str) -> None:
        self._server, self.address = server, address

    def stop(self, grace: float | None = None) -> None:
        self._server.stop(grace).wait(5)


def serve_registry(
    backend: Registry,
    port: int = 0,
    host: str = "127.0.0.1",
    workers: int = 4,
    *,
    token: str | bytes | None = None,
    tls: TlsConfig | None = None,
) -> RegistryServer:
    """Serve ``backend`` over gRPC on ``host:port`` (0 picks a free port) and return the handle.
    With ``token`` (str or bytes, >= 16 bytes) every call must prove it (:mod:`.auth`), else it
    is refused UNAUTHENTICATED before the backend sees it. With ``tls`` (``certfile`` and
    ``keyfile`` required; ``require_peer_cert``: clients must present a certificate signed by
    ``cafile``) it serves only over TLS."""
    credentials = _server_credentials(tls)  # before anything starts: a bad file is a UsageError
    gate = _Gate(coerce_token(token, "token"), backend)
    server = grpc.server(ThreadPoolExecutor(max_workers=workers))
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(_wrap(name, fn, gate)) for name, fn in _methods(backend).items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    server.start()
    return RegistryServer(server, f"{host}:{bound}")


class RegistryClient(Registry):
    """:class:`Registry` over gRPC at ``address``. Thread-safe."""

    def __init__(self, address: str, config: RegistryConfig | None = None) -> None:
        self.config = config or RegistryConfig()
        self.address = address
        self.failures = 0
        # Reconnect fast after a registry restart (gRPC's default backoff grows to 120 s).
        options: list[tuple[str, int | str]] = [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        tls = self.config.tls
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if tls.server_hostname:
                options.append(("grpc.ssl_target_name_override", tls.server_hostname))
            self._channel = grpc.secure_channel(address, _channel_credentials(tls), options=options)
        self._stubs: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def _rpc(self, name: str, payload: bytes) -> bytes:
        stub = self._stubs.get(name)
        if stub is None:
            stub = self._stubs[name] = self._channel.unary_unary(f"/{SERVICE}/{name}")
        token = cast("bytes | None", self.config.token)  # RegistryConfig coerced it to bytes
        metadata = ((METADATA_KEY, proof(token, name, payload)),) if token is not None else None
        try:
            reply: bytes = stub(payload, timeout=self.config.rpc_timeout_s, metadata=metadata)
            return reply
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise AuthError(
                    f"the registry refused this client's token: {exc.details()}", peer=self.address
                ) from exc
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise RegistryUnavailableError(
                    f"the registry does not serve {SERVICE}/{name}: it runs another tiersync version",
                    peer=self.address,
                ) from exc
            raise RegistryUnavailableError(
                f"registry call {name} failed: {exc.code().name}", peer=self.address
            ) from exc

    def lookup(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        """Owners per key; never raises on an outage — unanswered batches come back as ``()``."""
        check_keys(keys)
        out: list[tuple[str, ...]] = []
        step = self.config.batch_size
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            try:
                owners = m.dec_owners(self._rpc("Lookup", m.enc_keys(batch)))
                if len(owners) != len(batch):  # else owners would be paired with other keys
                    raise ProtocolError(
                        "lookup reply has another number of rows than keys",
                        fault=ProtocolFault.MALFORMED,
                        peer=self.address,
                        keys=len(batch),
                        rows=len(owners),
                    )
                out.extend(owners)
            except TierSyncError as exc:
                self.failures += 1
                log.warning("registry lookup degraded: %s", exc)
                break
        return out + [()] * (len(keys) - len(out))

    def placement_targets(self, pool_group: str, count: int, exclude: Sequence[str] = ()) -> list[StoreInfo]:
        """Ranked targets; ``[]`` on an outage (counted in ``failures``)."""
        try:
            return m.dec_infos(self._rpc("Targets", m.enc_targets(pool_group, count, tuple(exclude))))
        except TierSyncError as exc:
            self.failures += 1
            log.warning("registry targets degraded: %s", exc)
            return []

    def register_store(self, info: StoreInfo) -> None:
        self._rpc("RegisterStore", m.enc_infos([info]))

    def heartbeat(self, store_id: str, free_blocks: int) -> bool:
        return self._rpc("Heartbeat", m.enc_heartbeat(store_id, free_blocks)) == b"\x01"

    def remove_store(self, store_id: str) -> None:
        self._rpc("RemoveStore", m.enc_text(store_id))

    def get_store(self, store_id: str) -> StoreInfo | None:
        infos = m.dec_infos(self._rpc("GetStore", m.enc_text(store_id)))
        return infos[0] if infos else None

    def publish(self, store_id: str, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        for start in range(0, len(keys), 4096):
            self._rpc("Publish", m.enc_store_keys(store_id, keys[start : start + 4096]))

    def unpublish(self, store_id: str, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        for start in range(0, len(keys), 4096):
            self._rpc("Unpublish", m.enc_store_keys(store_id, keys[start : start + 4096]))

    def close(self) -> None:
        self._channel.close()
