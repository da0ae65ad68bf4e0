"""Copy backends (tiersync.transfer.backends): the built-in ones against a numpy reference, the
checks and accounting of the base, failures as TransferFailed, and the registry as the seam a
device backend plugs into (a backend registered for CUDA pools is the one the engine uses)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from _kvpools import make_pool
from tiersync.errors import UsageError
from tiersync.layout.adapters import kv_layout
from tiersync.layout.pool import Device, DevicePool, KVLayout
from tiersync.tiers.host import HostArena
from tiersync.transfer.backends import (
    CopyBackend,
    MemmoveCopier,
    NativeCopier,
    TransferFailed,
    backend_for,
    register,
    unregister,
)
from tiersync.transfer.engine import TransferConfig, TransferEngine
from tiersync.transfer.future import TransferStatus
from tiersync.transfer.spans import BlockCopy, Pattern

_I64 = np.int64


def _reference_case():
    rng = np.random.default_rng(21)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    regions = np.array([[0, 4096, 300], [512, 0, 5000], [6000, 9000, 17]], dtype=_I64)  # both kernel paths
    blocks = np.array([[0, 20000], [10000, 0], [40000, 40000]], dtype=_I64)
    want = np.zeros(1 << 16, dtype=np.uint8)
    for sb, db in blocks.tolist():
        for sr, dr, n in regions.tolist():
            want[db + dr : db + dr + n] = src[sb + sr : sb + sr + n]
    pattern = Pattern(*(np.ascontiguousarray(regions[:, i]) for i in range(3)))
    return src, want, BlockCopy(np.ascontiguousarray(blocks[:, 0]), np.ascontiguousarray(blocks[:, 1]), pattern)


@pytest.mark.parametrize("backend", [NativeCopier, MemmoveCopier])
def test_builtin_backends_match_a_numpy_reference_and_count_what_they_moved(backend):
    if not backend.available():
        pytest.skip("native kernel not built")
    src, want, spans = _reference_case()
    dst = np.zeros_like(want)
    copier = backend()
    copier.copy(src.ctypes.data, dst.ctypes.data, spans)
    copier.synchronize()
    assert np.array_equal(dst, want)
    stats = copier.stats
    assert (stats.copies, stats.blocks, stats.bytes) == (1, 3, 3 * (300 + 5000 + 17))


def test_malformed_spans_are_refused_before_anything_moves():
    src, want, spans = _reference_case()
    dst = np.zeros_like(want)
    pat = spans.pattern
    bad = [
        lambda: BlockCopy(spans.src.astype(np.int32), spans.dst, pat),
        lambda: BlockCopy(spans.src, spans.dst[:2], pat),
        lambda: BlockCopy(spans.src[::2], spans.dst[::2], pat),
        lambda: BlockCopy(spans.src, spans.dst, "pattern"),
        lambda: Pattern(pat.src, pat.dst[:1], pat.length),
        lambda: Pattern(pat.src, pat.dst, pat.length.reshape(1, -1)),
    ]
    for make in bad:  # a BlockCopy is valid by construction
        with pytest.raises(UsageError) as ei:
            make()
        assert ei.value.argument == "spans"
    copier = MemmoveCopier()
    with pytest.raises(UsageError) as ei:  # and a backend takes nothing else
        copier.copy(src.ctypes.data, dst.ctypes.data, (spans.src, spans.dst, pat))
    assert ei.value.argument == "spans"
    assert not dst.any() and copier.stats.copies == 0


class _Broken(CopyBackend):
    name, devices = "broken", frozenset({Device.CPU})

    def _copy(self, src_addr, dst_addr, spans):
        raise OSError("the device went away")


def test_a_failing_backend_fails_the_transfer_with_its_name(monkeypatch):
    rng = np.random.default_rng(3)
    pool = make_pool("numpy", np.float32, rng, dim=256)
    layout = kv_layout([pool.tensor])
    register(_Broken)
    try:
        with (
            HostArena.for_layout(layout, 8) as arena,
            TransferEngine(layout, arena, TransferConfig(backend="broken")) as eng,
        ):
            fut = eng.d2h([(0, arena.allocate(1)[0], 1)])
            with pytest.raises(TransferFailed, match="broken copy backend failed: the device went away"):
                fut.result(timeout=30)
            assert fut.status is TransferStatus.FAILED and eng.backends[Device.CPU].stats.copies == 0
    finally:
        unregister(_Broken)


class _HostBackedCuda(CopyBackend):
    """Stands in for a CUDA backend: its "device" pools are host memory, copied with memmove, and
    it records synchronize calls (an asynchronous backend waits for its stream there)."""

    name, devices = "test-cuda", frozenset({Device.CUDA})
    syncs = 0

    def _copy(self, src_addr, dst_addr, spans):
        pat = spans.pattern
        for sb, db in zip(spans.src.tolist(), spans.dst.tolist()):
            for s, d, n in zip(pat.src.tolist(), pat.dst.tolist(), pat.length.tolist()):
                ctypes.memmove(dst_addr + db + d, src_addr + sb + s, n)

    def _synchronize(self):
        type(self).syncs += 1


def test_a_registered_device_backend_is_the_one_the_engine_uses_for_its_pools():
    rng = np.random.default_rng(4)
    pool = make_pool("numpy", np.float32, rng, dim=512)
    host_layout = kv_layout([pool.tensor])
    p = host_layout.pools[0]
    cuda = KVLayout(
        (DevicePool(spec=p.spec, device=Device.CUDA, address=p.address, nbytes=p.nbytes, owner=pool.tensor),)
    )
    with HostArena.for_layout(cuda, 8) as arena:
        with pytest.raises(UsageError) as ei:  # nothing registered for CUDA: refused as before
            TransferEngine(cuda, arena)
        assert ei.value.argument == "layout" and ei.value.context["devices"] == ["cuda"]
        register(_HostBackedCuda)
        try:
            with TransferEngine(cuda, arena) as eng:
                assert isinstance(eng.backends[Device.CUDA], _HostBackedCuda)
                host = arena.allocate(2)
                eng.d2h([(5, host[0], 1), (9, host[1], 1)]).result(timeout=30)
                want = [pool.block(5), pool.block(9)]
                pool.scramble(rng)
                eng.h2d([(host[0], 9, 1), (host[1], 5, 1)]).result(timeout=30)
                assert [pool.block(9), pool.block(5)] == want
                assert eng.backends[Device.CUDA].stats.blocks == 4 and _HostBackedCuda.syncs >= 2
        finally:
            unregister(_HostBackedCuda)
        with pytest.raises(UsageError):
            TransferEngine(cuda, arena)


def test_backend_names_are_validated_where_the_user_wrote_them():
    with pytest.raises(UsageError) as ei:
        TransferConfig(backend="")
    assert ei.value.argument == "TransferConfig.backend"
    with pytest.raises(UsageError) as ei:
        backend_for(Device.CPU, name="cuda-ipc")
    assert ei.value.argument == "TransferConfig.backend" and "python-memmove" in ei.value.context["known"]
    with pytest.raises(UsageError) as ei:
        register(int)
    assert ei.value.argument == "backend"
    assert isinstance(backend_for(Device.CPU, name="python-memmove"), MemmoveCopier)
