"""Shared by the file targets: turn fuzzer bytes into damage applied to a pristine file.

An input is a mode byte then a body. Mode even: the body is a *mutation program*, 16-byte
ops ``<BBHIQ`` (kind, file, n, offset, value) applied in order to copies of the target's
pristine files; the fuzzer's byte mutations then explore damage to real, valid files.
Mode odd: the body is the file itself (the fuzzer has to find the magic and checksums, which
libFuzzer's comparison hooks help with).
"""

from __future__ import annotations

import logging
import resource
import struct
import sys

import numpy as np

KINDS = ("flip", "zero", "fill", "truncate", "extend", "u32", "u64", "swap")
MAX_OPS = 8
_OP = struct.Struct("<BBHIQ")


def decode(body: bytes) -> list[tuple[str, int, int, int, int]]:
    """The ops of a mutation program (at most MAX_OPS; a partial trailing op is ignored)."""
    ops = []
    for at in range(0, min(len(body), MAX_OPS * _OP.size) - _OP.size + 1, _OP.size):
        kind, which, n, offset, value = _OP.unpack_from(body, at)
        ops.append((KINDS[kind % len(KINDS)], which, n % 512 + 1, offset, value))
    return ops


def encode(ops: list[tuple[str, int, int, int, int]]) -> bytes:
    """A mutation program (mode byte included) running ``ops``: for seed corpora and tests."""
    return b"\0" + b"".join(_OP.pack(KINDS.index(k), w, n - 1, off, v) for k, w, n, off, v in ops)


def apply(buf: bytearray, kind: str, n: int, offset: int, value: int) -> bytearray:
    """``buf`` damaged by one op; ``offset`` wraps to the file's size (end included)."""
    at = offset % (len(buf) + 1)
    if kind == "flip" and at < len(buf):
        buf[at] ^= value % 255 + 1
    elif kind in ("zero", "fill"):
        buf[at : at + n] = bytes([0 if kind == "zero" else value % 256]) * len(buf[at : at + n])
    elif kind == "truncate":
        del buf[at:]
    elif kind == "extend":
        buf += np.random.default_rng(value).bytes(n)
    elif kind in ("u32", "u64") and at + (4 if kind == "u32" else 8) <= len(buf):
        struct.pack_into("<I" if kind == "u32" else "<Q", buf, at, value % (2**32 if kind == "u32" else 2**64))
    elif kind == "swap" and at + n <= len(buf):  # move a range elsewhere (records out of place)
        dst = value % (len(buf) - n + 1)
        chunk = bytes(buf[at : at + n])
        buf[at : at + n], buf[dst : dst + n] = buf[dst : dst + n], chunk
    return buf


def fuzz(one_input, atheris, before=None) -> None:
    """A target's ``main``: refuse without atheris, :func:`prepare_run`, ``before()`` (the
    target's own set-up), then let libFuzzer drive ``one_input``."""
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris")
    prepare_run()
    if before is not None:
        before()
    atheris.instrument_all()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


def prepare_run() -> None:
    """What every target's ``main`` does before fuzzing: cap memory, and keep tiersync's logs
    (a WARNING per cold start or damaged file) out of the fuzzer's output."""
    limit_memory()
    logging.getLogger("tiersync").setLevel(logging.ERROR)


def limit_memory(extra: int = 2 << 30) -> None:
    """Cap the address space at what the process maps now plus ``extra``, so an allocation
    sized by a damaged field fails (MemoryError: a crash the fuzzer saves) even where the
    kernel would have overcommitted it. For long runs only; the tests trace allocations."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
