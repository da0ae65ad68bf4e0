"""Types of the native send and receive paths (``_wire.c``)."""

import socket

def recv_many(
    sock: socket.socket | int,
    header: memoryview,
    dests: list[memoryview | list[memoryview]],
    request_ids: list[int],
    max_payload: int,
    empty_meta_sum: int,
    timeout_s: float,
    /,
) -> tuple[int, tuple[int, ...], int, int]:
    """(done, sums, n, err): see ``_wire.c``."""

def send_all(
    sock: socket.socket | int, bufs: list[bytes | memoryview], timeout_s: float, pinned: int = 0, /
) -> tuple[int, int]:
    """(sent, err): see ``_wire.c``."""

def copied_instead() -> int:
    """``send_all`` calls in this process whose pinned bytes were copied after all (no pipe)."""

def _xxh3_56(data: bytes | bytearray | memoryview, /) -> int: ...
