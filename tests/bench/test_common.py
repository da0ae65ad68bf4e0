"""tiersync.bench.common.from_child: a bench's wait on a child process (the block server of
``bench h2h``, the prefill process of ``bench pd``, the samplers of ``bench weights``) ends as
soon as the child ends, with an error naming it, not after the whole timeout."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from tiersync.bench.common import RoundTripError, from_child


def _child(conn, how: str) -> None:
    if how == "answer":
        conn.send(("ready", 1))
    elif how == "fail":
        raise OSError(97, "Address family not supported by protocol")
    elif how == "silent":
        time.sleep(30)


def _start(how: str):
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, how), daemon=True)
    proc.start()
    child.close()
    return conn, proc


def test_the_message_of_a_child_that_answered_and_exited():
    conn, proc = _start("answer")
    proc.join(30)
    assert proc.exitcode == 0
    assert from_child(conn, proc, "block server", 30) == ("ready", 1)


def test_a_child_that_dies_is_reported_at_once_with_its_exit_code():
    conn, proc = _start("fail")
    t0 = time.monotonic()
    with pytest.raises(RoundTripError) as info:
        from_child(conn, proc, "block server", 60)
    assert time.monotonic() - t0 < 30
    assert "the block server process ended before answering" in str(info.value)
    assert "exitcode=1" in str(info.value).replace(" ", "")


def test_a_silent_child_is_reported_after_the_timeout():
    conn, proc = _start("silent")
    try:
        with pytest.raises(RoundTripError, match=r"the prefill process sent nothing within 0\.5 s"):
            from_child(conn, proc, "prefill", 0.5)
        assert proc.is_alive()
    finally:
        proc.kill()
        proc.join(10)
