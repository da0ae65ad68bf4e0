"""How a batch of block-store pulls is cut into requests (no I/O).

A :class:`~tiersync.net.tcp.TcpChannel` pulls ``(key, offset, dest)`` items. Over TCP,
:func:`plan_pulls` gives each large item its own PULL and groups the small ones, one PULL_MANY
per about :data:`GROUP_LIMIT` bytes whose single DATA answer is scattered into their buffers.
On the same host, :func:`local_groups` cuts the items into PULL_LOCAL requests growing from
:data:`LOCAL_FIRST` to :data:`LOCAL_GROUP` bytes. :func:`writable` checks a destination
(UsageError naming ``items``); :class:`Later` is a pipelined request's destination known only
once an earlier answer was read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from tiersync.errors import UsageError
from tiersync.net import store_ops as so

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "GROUP_BYTES",
    "GROUP_ITEMS",
    "GROUP_LIMIT",
    "LOCAL_FIRST",
    "LOCAL_GROUP",
    "Item",
    "Later",
    "Pull",
    "local_groups",
    "plan_pulls",
    "writable",
]

# Pulls smaller than GROUP_BYTES are grouped into one PULL_MANY of about GROUP_LIMIT bytes, so the
# work each request costs on both sides (encode, parse, answer, ledger: tens of microseconds of
# interpreter) is paid once per 4 MiB. Since both sides write with one native call and the reader
# lands a group's answer natively, 4 MiB beat 1 MiB in each of 6 interleaved pairs of bench h2h's
# 4-stream rows (session of 2026-12-06 10:59 UTC: 0.80-0.83x raw sockets against 0.71-0.76x at
# 1 MiB, 0.85-0.88x against 0.75-0.80x at 64 KiB); before those, 1 MiB had won (answers of
# several streams interleaving more finely) or the two were inside the noise.
GROUP_BYTES = 4 << 20
GROUP_LIMIT = 4 << 20
GROUP_ITEMS = 64
LOCAL_GROUP = 32 << 20  # bytes per PULL_LOCAL: two in flight, one copied while the next is looked up
LOCAL_FIRST = 2 << 20  # ... from this size up, doubling: the first copy starts after a short lookup
Item = tuple[bytes, int, memoryview]  # (key, offset, destination) of a pull, checked
Pull = tuple[so.Pull | so.PullMany, memoryview | list[memoryview]]  # a request and where its DATA lands


@dataclass(frozen=True, slots=True)
class Later:
    """A :meth:`~tiersync.net.tcp.TcpChannel.pipeline` destination known only once an earlier answer of the same
    pipeline was read: ``resolve()`` gives the buffer (or list of buffers) before this request's
    DATA is read, after ``landed`` ran for every answer ahead of it that is not a DATA (the DATA
    answers queued back to back are received together, their destinations resolved first: a
    destination may depend on an earlier non-DATA answer, not on an earlier DATA)."""

    resolve: Callable[[], object]


def plan_pulls(
    lease_id: int, items: Iterable[tuple[bytes, int, object]], new_id: Callable[[], int], max_frame: int
) -> list[Pull]:
    """Validate every item before anything is sent (UsageError naming ``items``), then group
    the small ones: ``(PULL or PULL_MANY, destination buffer or buffers)``, request ids from
    ``new_id``. No answer exceeds ``max_frame`` bytes (the largest frame both ends accept,
    :attr:`~tiersync.net.protocol.Connection.frame_limit`): groups stay within it and a larger
    item is pulled in parts of at most that (a DATA answer has no metadata)."""
    out: list[Pull] = []
    group: list[Item] = []
    size, limit = 0, min(GROUP_LIMIT, max_frame)
    for key, offset, dest in items:
        view = writable(dest)
        if len(view) >= min(GROUP_BYTES, limit):
            for o in range(0, len(view), max_frame):
                part = view[o : o + max_frame]
                out.append((so.Pull(new_id(), lease_id, key, offset + o, len(part)), part))
            continue
        if group and size + len(view) > limit:  # a group never passes the limit
            out.append(_group(lease_id, group, new_id))
            group, size = [], 0
        group.append((key, offset, view))
        size += len(view)
        if size >= limit or len(group) == GROUP_ITEMS:
            out.append(_group(lease_id, group, new_id))
            group, size = [], 0
    if group:
        out.append(_group(lease_id, group, new_id))
    return out


def _group(lease_id: int, group: list[Item], new_id: Callable[[], int]) -> Pull:
    if len(group) == 1:
        key, offset, view = group[0]
        return so.Pull(new_id(), lease_id, key, offset, len(view)), view
    items = tuple((k, o, len(v)) for k, o, v in group)
    return so.PullMany(new_id(), lease_id, items), [v for _, _, v in group]


def local_groups(items: list[Item], max_keys: int, max_frame: int) -> Iterator[list[Item]]:
    """Consecutive items (at most ``max_keys`` per group) in groups of about LOCAL_FIRST bytes,
    then twice that, up to LOCAL_GROUP: the server looks up a small first group quickly, and
    each next lookup overlaps the copy of the group before it. A group of several items never
    passes ``max_frame`` bytes (what a server allows a PULL_LOCAL of several ranges)."""
    group: list[Item] = []
    size, target = 0, LOCAL_FIRST
    for item in items:
        if group and size + len(item[2]) > max_frame:
            yield group
            group, size, target = [], 0, min(2 * target, LOCAL_GROUP)
        group.append(item)
        size += len(item[2])
        if size >= target or len(group) == max_keys:
            yield group
            group, size, target = [], 0, min(2 * target, LOCAL_GROUP)
    if group:
        yield group


def writable(dest: object) -> memoryview:
    """``dest`` as a writable byte view; UsageError (naming ``items``) when it is not one."""
    if type(dest) is memoryview and dest.format == "B" and dest.ndim == 1 and dest.contiguous and not dest.readonly:
        return dest  # already one: no new view (a read of many small blocks checks each)
    try:
        view = memoryview(cast("Buffer", dest)).cast("B")
    except TypeError as exc:
        raise UsageError("destinations must be contiguous buffers", argument="items") from exc
    if view.readonly:
        raise UsageError("destinations must be writable", argument="items")
    return view
