"""tsum64 (the native payload checksum) against a plain-Python reading of its spec in _kernel.c.

Invariants: every stripe implementation (scalar, SSE2, AVX2) gives the reference value for
every length (all tail sizes, stripe boundaries), splitting the input across ``update`` calls
never changes it, any buffer type works, and a single flipped bit changes it.
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest

from tiersync.transfer import kernel

pytestmark = pytest.mark.skipif(kernel.TSUM64 is None, reason="native extension not built")

M = (1 << 64) - 1
M3, M4, M5 = 0xF23B35D20B759285, 0xEBB857552B297AB5, 0xED3CA46C429153EF
INIT = (
    0x6A46B658A09E8E55,
    0xA5BBCA51B2AD7275,
    0x3C5A1E0F96D2B487,
    0x81F4E2D7C6A9B053,
    0xC3D0090EFA6C0B31,
    0xDCFA67A0542C60FF,
    0x5E27C9B1D08F4A63,
    0x97B3E5A14C6D2F19,
)
KEY = (
    0x2F8E4C1B9D7A3065,
    0xB46A1D93E5C7F20B,
    0x71C9A3E85B2D6F47,
    0xE0537BD1A948C62D,
    0x4AD62F7093BE1C85,
    0x98F1C4E26A3B5D07,
    0x1D7BE3964FA0C259,
    0xC62A905D1E8F7B33,
)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M


def _fold(h: int, x: int) -> int:
    return _rotl(h ^ (x * M3 & M), 31) * M4 & M


def reference(data: bytes, seed: int = 0) -> int:
    s1 = [seed ^ i for i in INIT]
    s2 = [seed] * 8
    padded = data + bytes(-len(data) % 64)
    for off in range(0, len(padded), 64):
        for i in range(8):
            w = int.from_bytes(padded[off + 8 * i : off + 8 * i + 8], "little")
            lo = ((w & 0xFFFFFFFF) + (KEY[i] & 0xFFFFFFFF)) & 0xFFFFFFFF
            hi = ((w >> 32) + (KEY[i] >> 32)) & 0xFFFFFFFF
            s1[i] = (s1[i] + lo * hi + w) & M
            s2[i] = (s2[i] + s1[i]) & M
    h = seed ^ (len(data) * M5 & M)
    for i in range(8):
        h = _fold(_fold(h, s1[i]), s2[i])
    h ^= h >> 31
    h = h * M5 & M
    h ^= h >> 29
    h = h * M3 & M
    return h ^ (h >> 32)


def _impls() -> list[str]:
    out = []
    for name in ("scalar", "sse2", "avx2", "avx512"):
        try:
            kernel._native._tsum64_using(name, b"")
        except ValueError:
            continue
        out.append(name)
    return out


def test_every_implementation_matches_the_spec_at_every_tail_length():
    data = os.urandom(700)
    impls = _impls()
    assert "scalar" in impls and kernel.TSUM64 in impls
    for n in list(range(200)) + [255, 256, 257, 511, 512, 700]:
        want = reference(data[:n])
        assert kernel.tsum64(data[:n]) == want, n
        for name in impls:
            assert kernel._native._tsum64_using(name, data[:n]) == want, (name, n)


def test_seed_changes_the_value_and_follows_the_spec():
    data = os.urandom(333)
    assert kernel.tsum64(data, seed=7) == reference(data, 7) != kernel.tsum64(data)


def test_splitting_never_changes_the_result():
    rng = random.Random(5)
    data = os.urandom(3 << 20)
    want = kernel.tsum64(data)
    for _ in range(20):
        h, pos, view = kernel.tsum64_hasher(), 0, memoryview(data)
        while pos < len(data):
            n = rng.choice([1, 7, 63, 64, 65, 4096, 100_003, 1 << 20])
            h.update(view[pos : pos + n])
            pos += n
        assert h.intdigest() == want


def test_a_list_of_parts_sums_their_concatenation():
    rng = random.Random(9)
    for _ in range(10):
        parts = [os.urandom(rng.choice([0, 1, 63, 64, 65, 8191, 8192, 70_000])) for _ in range(rng.randint(0, 12))]
        whole = b"".join(parts)
        assert kernel.tsum64(parts) == kernel.tsum64(tuple(memoryview(p) for p in parts)) == reference(whole)
        assert kernel.tsum64(parts, seed=3) == reference(whole, 3)
    with pytest.raises(TypeError):
        kernel.tsum64([b"ab", 5])  # every part a buffer, or nothing is summed
    with pytest.raises((TypeError, BufferError, ValueError)):
        kernel.tsum64([b"ab", np.zeros((4, 4), np.uint8)[:, ::2]])


def test_composed_partials_give_the_checksum_of_the_concatenation():
    rng = random.Random(11)
    for _ in range(10):
        sizes = [64 * rng.choice([0, 1, 2, 127, 1024]) for _ in range(rng.randint(0, 6))]
        parts = [os.urandom(n) for n in sizes] + [os.urandom(rng.choice([0, 1, 63, 64, 9000]))]
        whole = b"".join(parts)
        states = [kernel.tsum64_partial(p) for p in parts]
        assert kernel.tsum64_compose(states) == reference(whole)
        assert kernel.tsum64_compose(states, seed=9) == reference(whole, 9)
    assert kernel.tsum64_compose([]) == reference(b"")
    assert {len(s) for s in states} == {kernel.PARTIAL_BYTES}  # the size callers slice kept states by
    with pytest.raises(ValueError, match=r"partials\[0\] is not a whole number of stripes"):
        kernel.tsum64_compose([kernel.tsum64_partial(b"x" * 65), kernel.tsum64_partial(b"y")])
    with pytest.raises(ValueError, match=r"partials\[1\]"):
        kernel.tsum64_compose([kernel.tsum64_partial(b"x" * 64), b"not a state"])


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4096, 256 << 10, (256 << 10) + 1, (1 << 20) + 4097])
@pytest.mark.parametrize("shift", [0, 1, 32])
def test_copy_partials_copies_and_sums_each_piece_of_what_landed(n, shift):
    piece = 64 << 10
    src = np.frombuffer(os.urandom(n), np.uint8)
    room = np.zeros(n + shift, np.uint8)
    dst = room[shift:]  # destinations aligned for streamed stores and not
    states = kernel.copy_partials(dst, src, piece)
    assert bytes(dst) == bytes(src)
    parts = [states[i : i + 136] for i in range(0, len(states), 136)]
    assert len(parts) == -(-n // piece)
    assert kernel.tsum64_compose(parts) == reference(bytes(src))
    assert all(p == kernel.tsum64_partial(bytes(src[k * piece : (k + 1) * piece])) for k, p in enumerate(parts))


def test_compose_pieces_mixes_kept_states_and_bytes_summed_now():
    """Pieces back to back, some from kept states (copy_partials'), some summed from the bytes,
    give the tsum64 of their concatenation; a middle piece not a whole number of stripes is
    refused as tsum64_compose refuses it."""
    piece = 4096
    buf = np.frombuffer(os.urandom(5 * piece + 100), np.uint8)
    states = kernel.copy_partials(np.empty_like(buf), buf, piece)
    pieces = [(64, piece - 64, -1), (piece, piece, 1), (2 * piece, piece, 2), (3 * piece, 2 * piece + 100, -1)]
    assert kernel.compose_pieces(buf, pieces, states) == reference(bytes(buf[64:]))
    assert kernel.compose_pieces(buf, [(5 * piece, 100, 5)], states) == reference(bytes(buf[5 * piece :]))
    with pytest.raises(ValueError):
        kernel.compose_pieces(buf, [(0, 100, -1), (100, piece, -1)], states)


def test_copy_partials_refuses_bad_arguments_and_writes_nothing():
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
    for piece in (0, -64, 100):
        with pytest.raises(ValueError, match="piece must be a positive multiple of 64"):
            kernel.copy_partials(dst, src, piece)
    with pytest.raises(ValueError, match="differ in length"):
        kernel.copy_partials(dst[:255], src, 64)
    with pytest.raises((TypeError, BufferError, ValueError)):
        kernel.copy_partials(bytes(256), src, 64)  # read-only destination
    with pytest.raises((TypeError, BufferError, ValueError)):
        kernel.copy_partials(np.zeros(512, np.uint8)[::2], src, 64)  # not contiguous
    assert not dst.any()


def test_any_contiguous_buffer_and_single_bit_flips():
    arr = np.random.default_rng(1).integers(0, 255, size=(64, 1024), dtype=np.uint8)
    base = kernel.tsum64(arr)
    assert base == kernel.tsum64(arr.tobytes()) == kernel.tsum64(memoryview(bytearray(arr.tobytes())))
    flat = arr.reshape(-1)
    for pos in (0, 1, 63, 64, 4095, flat.size - 1):
        for bit in (0, 7):
            flat[pos] ^= 1 << bit
            assert kernel.tsum64(arr) != base
            flat[pos] ^= 1 << bit
    with pytest.raises((TypeError, BufferError, ValueError)):
        kernel.tsum64(arr[:, ::2])  # not contiguous


def test_threads_hash_in_parallel_to_the_same_values():
    blocks = [os.urandom(4 << 20) for _ in range(4)]
    want = [reference(b[:1000]) for b in blocks]
    got: dict[int, int] = {}

    def one(i: int) -> None:
        for _ in range(5):
            kernel.tsum64(blocks[i])
        got[i] = kernel.tsum64(blocks[i][:1000])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [got[i] for i in range(4)] == want


def test_missing_extension_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernel, "TSUM64", None)
    with pytest.raises(RuntimeError, match="native extension"):
        kernel.tsum64(b"x")
    with pytest.raises(RuntimeError, match="native extension"):
        kernel.tsum64_hasher()
    with pytest.raises(RuntimeError, match="native extension"):
        kernel.copy_partials(np.zeros(64, np.uint8), np.zeros(64, np.uint8), 64)


def test_every_copy_loop_stores_the_bytes_and_sums_what_it_stored():
    """copy_partials through each fused copy loop this CPU has (plain, AVX2, AVX-512), at every
    tail length and at destinations aligned for streamed stores or not: the bytes land, and the
    partial state is tsum64_partial's of them."""
    import numpy as np

    loops = []
    for name in ("plain", "avx2", "avx512"):
        try:
            kernel._native._copy_partials_using(name, bytearray(1), b"x")
        except ValueError:
            continue
        loops.append(name)
    assert "plain" in loops
    data = os.urandom(4096 + 64)
    for n in list(range(200)) + [255, 256, 257, 4095, 4096]:
        for shift in (0, 1, 32):
            src = data[shift : shift + n]
            want = kernel.tsum64_partial(src) if n else None
            for name in loops:
                raw = np.zeros(n + 128, np.uint8)
                at = -raw.ctypes.data % 64 + shift  # 64-byte aligned (streamed stores) when shift is 0
                dst = raw[at : at + n]
                got = kernel._native._copy_partials_using(name, dst, src)
                assert dst.tobytes() == src, (name, n, shift)
                if n:
                    assert got == want, (name, n, shift)
