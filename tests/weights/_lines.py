"""A child process of the weights tests whose stdout lines arrive on a queue (``expect``)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import tiersync

HERE = os.path.dirname(os.path.abspath(__file__))


class LineChild:
    """``python HERE/script args`` with this checkout's tiersync; stdin piped when ``stdin``."""

    def __init__(self, script: str, args: list[str], timeout: float, *, stdin: bool = False) -> None:
        src = os.path.dirname(os.path.dirname(tiersync.__file__))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, src])}
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), *args],
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str) -> str:
        """The next line starting with ``prefix`` (others are skipped); queue.Empty after the timeout."""
        while True:
            line = self.lines.get(timeout=self.timeout)
            if line.startswith(prefix):
                return line
