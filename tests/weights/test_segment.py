"""Weights segments whose publisher is gone: a publisher killed before it could unlink its
segments leaves them in /dev/shm; the next SegmentPool in that directory removes them, and
never a segment whose publisher runs (its pid, or its lock held from another pid namespace)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tiersync.weights.segment import SEGMENT_PREFIX, SegmentPool, SegmentWriter, reclaim_stale

_WRITER = """
import os, sys
from tiersync.weights.segment import SEGMENT_PREFIX, SegmentWriter
path = sys.argv[1] or os.path.join(sys.argv[2], f"{SEGMENT_PREFIX}{os.getpid()}-0-w-0")
w = SegmentWriter(path, 4096)
print(path, flush=True)
sys.stdin.read()
"""


def _writer(path: str = "", directory: str = "") -> tuple[subprocess.Popen, str]:
    """A process holding a SegmentWriter at ``path`` (default: in ``directory``, named after
    that process's pid, as a publisher names it) and the path."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, path, directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _named(directory: str, pid: int, tag: str) -> str:
    return os.path.join(directory, f"{SEGMENT_PREFIX}{pid}-0-{tag}-0")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_publishers_segment_is_removed_by_the_next_pool(tmp_path):
    killed, path = _writer(directory=str(tmp_path))
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert os.path.exists(path)  # nothing ran at its exit
    pool = SegmentPool(_named(str(tmp_path), os.getpid(), "b"), 4096)
    try:
        assert not os.path.exists(path)
    finally:
        pool.close()


@pytest.mark.parametrize("named", ["own-pid", "dead-pid"])
def test_a_running_publishers_segment_stays_until_it_is_gone(tmp_path, named):
    """Named after its own running pid, or after a pid that does not run here (a publisher in
    another pid namespace): a live writer's lock keeps it; once the writer is gone, it goes."""
    path = "" if named == "own-pid" else _named(str(tmp_path), _dead_pid(), "ns")
    holder, path = _writer(path, str(tmp_path))
    try:
        assert reclaim_stale(str(tmp_path)) == []
        assert os.path.exists(path)
    finally:
        holder.kill()
        holder.wait()
    assert reclaim_stale(str(tmp_path)) == [path]


def test_a_closed_writer_unlinks_and_drops_its_lock(tmp_path):
    path = _named(str(tmp_path), os.getpid(), "c")
    writer = SegmentWriter(path, 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("a live writer's segment could be locked")
        except BlockingIOError:
            pass
        writer.close()
        assert not os.path.exists(path)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the writer's lock is gone
    finally:
        os.close(fd)


_NO_ROOM = r"""
import os, sys
import numpy as np
from tiersync.errors import CapacityError
from tiersync.weights import Mesh, PublisherConfig, Sharding, WeightPublisher
tensors = {"w": np.ones((1024, 1024), np.float32)}  # 4 MiB: more than the 1 MiB /dev/shm
try:
    pub = WeightPublisher(tensors, Sharding(Mesh((1,), ("fsdp",)), ("fsdp",)), config=PublisherConfig(shm_dir=sys.argv[1]))
    pub.publish(1).result(30)  # the trainer writing a version
    print("written")
except CapacityError as exc:
    print("refused", exc.requested >= 4 << 20, os.listdir(sys.argv[1]))
"""


def test_a_segment_without_room_is_refused_before_any_write(tmp_path):
    """A /dev/shm without room for the shard (here a 1 MiB tmpfs of its own, in a user and mount
    namespace): the publisher is refused at construction (CapacityError, nothing left behind);
    before, the segment was a sparse file and the trainer's first write to a page past the room
    was a SIGBUS."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "-rm", "true"], check=False, capture_output=True, text=True) if unshare else None
    if probe is None or probe.returncode:
        pytest.skip(f"cannot make a user and mount namespace here: {probe.stderr.strip() if probe else 'no unshare'}")
    mount, script = tmp_path / "shm", tmp_path / "no_room.py"
    mount.mkdir()
    script.write_text(_NO_ROOM)
    cmd = 'mount -t tmpfs -o size=1m none "$1" && exec "$2" "$3" "$1"'
    run = subprocess.run(
        [unshare, "-rm", "sh", "-c", cmd, "sh", str(mount), sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # -7 was the SIGBUS
    assert run.stdout.split() == ["refused", "True", "[]"]


def test_a_holder_gone_mid_publish_leaves_the_current_segment_readable_until_the_next(tmp_path):
    """A zero-copy sampler of the version being published went away: the segment is retired
    (never written again) but stays on disk while that version is written and announced, so
    other same-host samplers still open it; the next version's take() removes it."""
    from tiersync.weights.segment import SegmentReader

    pool = SegmentPool(str(tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}-0-t"), 8192)
    gone, other = object(), object()
    try:
        first = pool.take(1, {gone})
        first.begin(1)
        current = pool.take(2, {gone, other})  # version 1's is still held: a second segment
        current.begin(2)
        assert current is not first
        pool.orphan(gone)
        assert not os.path.exists(first.path)  # not current: gone at once
        SegmentReader(current.path, 8192).close()  # still announced and opened by others
        nxt = pool.take(3, set())
        assert nxt is not current and not os.path.exists(current.path)  # retired: never rewritten
    finally:
        pool.close()
    assert not os.listdir(tmp_path)
