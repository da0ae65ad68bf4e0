"""tiersync.iov.consume: what is left after a short scatter-gather call."""

from tiersync.iov import consume


def test_consume_drops_whole_and_partial_buffers():
    views = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"fgh")]
    assert [bytes(v) for v in consume(views, 4)] == [b"e", b"fgh"]
    assert [bytes(v) for v in consume(views, 0)] == [b"e", b"fgh"]
    assert consume(views, 4) == []


def test_consume_returns_the_same_list():
    views = [memoryview(b"abcd")]
    assert consume(views, 1) is views and bytes(views[0]) == b"bcd"
