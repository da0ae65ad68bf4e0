"""Scatter-gather bookkeeping shared by the socket and file paths."""

from __future__ import annotations


def consume(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes of the buffer list ``views`` (after a short readv/writev/sendmsg)
    and return what is left, in place of ``views``; emptied buffers are removed."""
    i = 0
    while n > 0 and i < len(views):
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    del views[:i]
    return views
