"""Copy backends: what moves a pool's bytes, chosen by the pool's device.

A backend copies a :class:`~tiersync.transfer.spans.BlockCopy` (block offsets on both sides and
one region pattern) between a pool's storage and the host arena, and ``synchronize`` waits for
what it started. Subclasses implement only :meth:`CopyBackend._copy` (and ``_synchronize`` when
their copies are asynchronous, as a CUDA stream or a PJRT transfer would be); the base checks the
spans (a :class:`BlockCopy` is checked when it is made), counts calls and bytes, and turns a
backend's failure into a :class:`TransferFailed` naming the backend.

Two backends exist, both for host-addressable (``Device.CPU``) pools: ``native`` (the C
kernel: one loop over blocks and regions, GIL released, non-temporal stores for large spans) and
``python-memmove`` (``ctypes.memmove`` per region, when the extension was not built).
:func:`backend_for` picks the first available one registered for a device; a device with none
(CUDA, accelerators) is refused with a :class:`UsageError` naming ``layout``. A new backend
registers itself with :func:`register`: that is the seam for pinned-memory CUDA copies on
streams, or a JAX/PJRT backend.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import ClassVar

from tiersync.errors import TierSyncError, UsageError
from tiersync.layout.pool import Device
from tiersync.transfer import kernel
from tiersync.transfer.spans import BlockCopy

__all__ = [
    "BackendStats",
    "CopyBackend",
    "MemmoveCopier",
    "NativeCopier",
    "TransferFailed",
    "backend_for",
    "register",
    "unregister",
]


class TransferFailed(TierSyncError):
    """A copy backend failed to move bytes (the transfer's future carries it)."""


@dataclass(frozen=True, slots=True)
class BackendStats:
    """What one backend moved: ``copies`` calls, ``blocks`` and ``bytes`` (decimal counts)."""

    copies: int
    blocks: int
    bytes: int


class CopyBackend:
    """Base of every copy backend (see the module doc). Thread-safe: workers share one."""

    name: ClassVar[str] = ""
    devices: ClassVar[frozenset[Device]] = frozenset()

    def __init__(self, *, streaming: bool = True) -> None:
        self.streaming = streaming
        self._lock = threading.Lock()
        self._copies = self._blocks = self._bytes = 0

    @classmethod
    def available(cls) -> bool:
        """Whether this backend can run in this process (its library is there)."""
        return True

    def copy(self, src_addr: int, dst_addr: int, spans: BlockCopy) -> None:
        """Copy every block of ``spans`` from ``src_addr`` to ``dst_addr`` (addresses of block 0's
        byte 0 on each side). Raises UsageError for malformed spans, TransferFailed when the
        backend fails."""
        if not isinstance(spans, BlockCopy):  # valid by construction (int64, contiguous, equal lengths)
            raise UsageError("must be a BlockCopy", argument="spans")
        if not len(spans):
            return
        try:
            self._copy(src_addr, dst_addr, spans)
        except TierSyncError:
            raise
        except Exception as exc:
            raise TransferFailed(f"the {self.name} copy backend failed: {exc}", backend=self.name) from exc
        with self._lock:
            self._copies += 1
            self._blocks += len(spans)
            self._bytes += spans.nbytes

    def synchronize(self) -> None:
        """Wait until every copy started so far has landed (no-op for synchronous backends)."""
        try:
            self._synchronize()
        except TierSyncError:
            raise
        except Exception as exc:
            raise TransferFailed(
                f"the {self.name} copy backend failed to synchronize: {exc}", backend=self.name
            ) from exc

    @property
    def stats(self) -> BackendStats:
        with self._lock:
            return BackendStats(self._copies, self._blocks, self._bytes)

    def _copy(self, src_addr: int, dst_addr: int, spans: BlockCopy) -> None:
        raise NotImplementedError

    def _synchronize(self) -> None:
        return None


class NativeCopier(CopyBackend):
    """The C kernel (``tiersync.transfer._kernel``): blocks x regions in one GIL-free loop."""

    name = "native"
    devices = frozenset({Device.CPU})

    @classmethod
    def available(cls) -> bool:
        return kernel.KERNEL == "native"

    def _copy(self, src_addr: int, dst_addr: int, spans: BlockCopy) -> None:
        pat = spans.pattern
        kernel.copy_blocks(
            src_addr, dst_addr, spans.src, spans.dst, pat.src, pat.dst, pat.length, streaming=self.streaming
        )


class MemmoveCopier(CopyBackend):
    """``ctypes.memmove`` per block and region (GIL released per call; Python per region)."""

    name = "python-memmove"
    devices = frozenset({Device.CPU})

    def _copy(self, src_addr: int, dst_addr: int, spans: BlockCopy) -> None:
        pat, move = spans.pattern, ctypes.memmove
        regions = list(zip(pat.src.tolist(), pat.dst.tolist(), pat.length.tolist()))
        for sb, db in zip(spans.src.tolist(), spans.dst.tolist()):
            for s, d, n in regions:
                move(dst_addr + db + d, src_addr + sb + s, n)


_REGISTRY: list[type[CopyBackend]] = [NativeCopier, MemmoveCopier]


def register(backend: type[CopyBackend]) -> None:
    """Add ``backend`` (a CopyBackend subclass with ``name`` and ``devices``), preferred over the
    ones registered before it for its devices. Registering the same class twice is a no-op."""
    if not (isinstance(backend, type) and issubclass(backend, CopyBackend)) or not backend.name or not backend.devices:
        raise UsageError("must be a CopyBackend subclass with a name and devices", argument="backend")
    if backend not in _REGISTRY:
        _REGISTRY.insert(0, backend)


def unregister(backend: type[CopyBackend]) -> None:
    """Remove a backend :func:`register` added (the built-in ones stay)."""
    if backend in _REGISTRY and backend not in (NativeCopier, MemmoveCopier):
        _REGISTRY.remove(backend)


def backend_for(device: Device, *, name: str | None = None, streaming: bool = True) -> CopyBackend:
    """A new instance of the first available backend for ``device`` (or the one called ``name``).
    UsageError naming ``layout`` when the device has none, naming ``TransferConfig.backend`` when
    ``name`` is unknown, unavailable or not for this device."""
    fits = [b for b in _REGISTRY if device in b.devices]
    if name is not None:
        chosen = [b for b in fits if b.name == name and b.available()]
        if not chosen:
            raise UsageError(
                "no available copy backend of this name for the pool's device",
                argument="TransferConfig.backend",
                value=name,
                device=device.value,
                known=sorted(b.name for b in _REGISTRY if b.available()),
            )
        return chosen[0](streaming=streaming)
    for backend in fits:
        if backend.available():
            return backend(streaming=streaming)
    raise UsageError(
        "pools on this device need a device backend that is not available", argument="layout", devices=[device.value]
    )
