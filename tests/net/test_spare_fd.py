"""SpareDescriptor: a process whose descriptor table is full (a lowered RLIMIT_NOFILE, in a
child process) still opens one socket, with the spare; the next needs the spare back first."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import errno, os, resource, socket
from tiersync.net.spare_fd import SpareDescriptor
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
spare = SpareDescriptor()
assert spare.held
fill = []
while True:
    try:
        fill.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE
        break
try:
    socket.socket()
    raise SystemExit("a descriptor was still free")
except OSError as exc:
    assert exc.errno == errno.EMFILE
one = spare.call(socket.socket)  # EMFILE, then the spare's number
assert not spare.held
try:
    spare.call(socket.socket)
    raise SystemExit("a second socket without the spare back")
except OSError as exc:
    assert exc.errno == errno.EMFILE
one.close()  # a descriptor is free again: the next call takes the spare back first
spare.call(lambda: None)
assert spare.held
try:
    spare.call(lambda: (_ for _ in ()).throw(KeyError("other")))
except KeyError:
    assert spare.held  # another failure leaves the spare alone
spare.close()
assert not spare.held
print("ok")
"""


def test_a_full_descriptor_table_leaves_one_socket_to_the_spare():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
