"""net/deadlines.py: one deadline per key, the due ones taken out soonest first."""

from __future__ import annotations

from tiersync.net.deadlines import Deadlines


def test_due_takes_out_the_keys_whose_deadline_passed_soonest_first_with_their_values():
    d: Deadlines[str, int] = Deadlines()
    d.set("late", 30.0, 3)
    d.set("early", 10.0, 1)
    d.set("middle", 20.0, 2)
    assert d.due(5.0) == [] and len(d) == 3
    assert d.due(20.0) == [("early", 1), ("middle", 2)]  # a deadline equal to now is due
    assert len(d) == 1 and "late" in d and "early" not in d
    assert d.get("late") == 3 and d.get("early") is None


def test_a_key_set_again_keeps_only_its_new_deadline_and_value():
    d: Deadlines[str, str] = Deadlines()
    d.set("k", 10.0, "first")
    d.set("k", 50.0, "second")
    assert d.due(20.0) == [] and d.get("k") == "second"
    assert d.first() == ("k", 50.0)
    assert d.due(50.0) == [("k", "second")] and len(d) == 0


def test_a_popped_key_is_never_due_and_first_skips_it():
    d: Deadlines[str, None] = Deadlines()
    d.set("gone", 1.0, None)
    d.set("kept", 2.0, None)
    assert d.pop("gone") is None and d.pop("gone") is None  # popping again is no error
    assert d.first() == ("kept", 2.0) and d.keys() == ["kept"]
    assert d.due(100.0) == [("kept", None)]
    assert d.first() is None


def test_equal_deadlines_never_compare_their_keys():
    d: Deadlines[object, None] = Deadlines()
    keys = [object() for _ in range(5)]  # objects that cannot be ordered
    for k in keys:
        d.set(k, 1.0, None)
    assert [k for k, _ in d.due(1.0)] == keys  # in the order they were set


def test_entries_of_keys_dropped_or_set_again_are_swept_not_kept_until_their_deadline():
    d: Deadlines[int, None] = Deadlines()
    for i in range(10_000):  # each key set again and dropped long before its deadline
        d.set(i % 3, 600.0 + i, None)
        if i % 2:
            d.pop(i % 3)
    live = d.keys()
    assert live == [2] and len(d._heap) <= 2 * len(live) + 64 + 1  # 9998 % 3 set last, 9999 % 3 dropped
    assert sorted(k for k, _ in d.due(1e9)) == sorted(live) and len(d) == 0
