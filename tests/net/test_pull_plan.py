"""How pull_many cuts a batch into requests: large items alone (in parts when larger than the
frame limit), small ones grouped (never past GROUP_LIMIT bytes or GROUP_ITEMS items), every
item once with its own destination; a bad
destination refused before any request is made; same-host groups bounded by bytes and keys."""

from __future__ import annotations

import itertools

import pytest

from tiersync.errors import UsageError
from tiersync.net import store_ops as so
from tiersync.net.frames import ProtocolConfig
from tiersync.net.pull_plan import (
    GROUP_BYTES,
    GROUP_ITEMS,
    GROUP_LIMIT,
    LOCAL_FIRST,
    LOCAL_GROUP,
    local_groups,
    plan_pulls,
)

MiB = 1 << 20


def _items(sizes: list[int]) -> list[tuple[bytes, int, memoryview]]:
    return [(i.to_bytes(16, "little"), 0, memoryview(bytearray(n))) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    "sizes",
    [
        [64 << 10] * 200,
        [3 * MiB, 3 * MiB, 3 * MiB],  # two would pass the limit together: one each
        [MiB, GROUP_BYTES, 100, GROUP_BYTES - 1, 16 * MiB, 5],
        [4096] * (GROUP_ITEMS * 2 + 3),
    ],
)
def test_small_items_grouped_within_the_limits_large_ones_alone(sizes):
    items = _items(sizes)
    ids = itertools.count(7)
    plan = plan_pulls(3, items, lambda: next(ids), ProtocolConfig().max_frame_size)
    seen = []
    for request, dest in plan:
        if isinstance(request, so.PullMany):
            assert len(request.items) <= GROUP_ITEMS and sum(n for _, _, n in request.items) <= GROUP_LIMIT
            assert [len(d) for d in dest] == [n for _, _, n in request.items]
            seen += [k for k, _, _ in request.items]
        else:
            assert request.length == len(dest)
            seen.append(request.key)
        assert request.lease_id == 3
    assert sorted(seen) == sorted(k for k, _, _ in items)  # every item once
    assert [r.request_id for r, _ in plan] == list(range(7, 7 + len(plan)))
    big = [r for r, _ in plan if isinstance(r, so.Pull) and r.length >= GROUP_BYTES]
    assert len(big) == sum(1 for n in sizes if n >= GROUP_BYTES)


@pytest.mark.parametrize("max_frame", [MiB, 2 * MiB + 5, 64 << 10])
def test_no_answer_passes_the_frame_limit_and_every_byte_is_asked_once(max_frame):
    """No DATA answer is larger than ``max_frame`` (the largest frame both ends accept): groups
    stay within it, and an item larger than it is pulled in parts, each a slice of its
    destination at the matching offset into the block; every byte is asked for exactly once."""
    items = [(k, 100, d) for k, _, d in _items([512 << 10] * 9 + [64 << 10] * 40 + [3 * MiB + 7])]
    ids = itertools.count(1)
    plan = plan_pulls(3, items, lambda: next(ids), max_frame)
    parts: dict[bytes, list[tuple[int, int]]] = {k: [] for k, _, _ in items}
    for request, dest in plan:
        asked = (
            list(zip(request.items, dest))
            if isinstance(request, so.PullMany)
            else [((request.key, request.offset, request.length), dest)]
        )
        assert sum(n for (_, _, n), _ in asked) <= max_frame
        for (key, offset, n), view in asked:
            assert len(view) == n
            parts[key].append((offset - 100, n))
            view[:] = bytes([len(parts[key]) % 251 + 1]) * n  # lands where this part says it does
    for key, _, dest in items:
        pos = 0
        for i, (o, n) in enumerate(sorted(parts[key])):
            assert o == pos and bytes(dest[o : o + n]) == bytes([(i + 1) % 251 + 1]) * n
            pos += n
        assert pos == len(dest)
    assert len(parts[items[-1][0]]) == -(-(3 * MiB + 7) // max_frame)  # the large item in parts


def test_a_bad_destination_is_refused_before_any_request():
    ids = itertools.count(1)
    items = [*_items([100, 200]), (b"x" * 16, 0, memoryview(b"read-only"))]
    with pytest.raises(UsageError) as info:
        plan_pulls(1, items, lambda: next(ids), MiB)
    assert info.value.argument == "items" and next(ids) == 1  # no request id was taken


def test_local_groups_grow_to_a_bound_by_bytes_and_keys():
    """Groups double from LOCAL_FIRST bytes up to LOCAL_GROUP, never over ``max_keys`` items,
    every item once, in order."""
    items = _items([MiB] * 70)
    groups = list(local_groups(items, max_keys=16, max_frame=64 * MiB))
    assert [len(g) for g in groups] == [2, 4, 8, 16, 16, 16, 8] and [x for g in groups for x in g] == items
    groups = list(local_groups(_items([MiB] * 200), max_keys=4096, max_frame=64 * MiB))
    sizes = [len(g) * MiB for g in groups]
    assert sizes[0] == LOCAL_FIRST and sizes[:6] == [LOCAL_FIRST << i for i in range(5)] + [LOCAL_GROUP]
    assert max(sizes) == LOCAL_GROUP and sum(sizes) == 200 * MiB
    big = list(local_groups(_items([LOCAL_GROUP // 2] * 5), max_keys=100, max_frame=64 * MiB))
    assert [len(g) for g in big] == [1, 1, 1, 1, 1]


def test_local_groups_of_several_items_stay_within_a_frame():
    """A group of several items never passes ``max_frame`` (what a server allows a PULL_LOCAL of
    several ranges); an item larger than that goes alone."""
    items = _items([MiB, 100 * MiB, MiB, 3 * MiB, 3 * MiB, 3 * MiB])
    groups = list(local_groups(items, max_keys=4096, max_frame=4 * MiB))
    assert [x for g in groups for x in g] == items
    assert all(len(g) == 1 or sum(len(v) for _, _, v in g) <= 4 * MiB for g in groups)
    assert [len(g) for g in groups] == [1, 1, 2, 1, 1]
