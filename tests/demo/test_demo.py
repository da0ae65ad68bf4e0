"""End-to-end checks of ``tiersync demo`` on its hidden ``--tiny`` setting (no timing assertions)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiersync.demo import main  # noqa: E402

pytestmark = pytest.mark.torch

TINY_PROMPT, TINY_SHARED, BLOCK = 160, 100, 16
# bundled config: 4 layers x (k, v) x 16 tokens x 2 KV heads x 64 head_dim x 4 bytes
BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 4


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    rc = main(["--tiny", "--json", *extra])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints exactly one line"
    return rc, json.loads(out[0])


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")


def test_reuse_matches_full_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    rc, r = _run(capsys)
    assert rc == 0 and r["passed"] is True
    assert r["logits_allclose"] and r["argmax_match"] and r["kv_bytes_exact"]
    assert r["logits_max_abs_diff"] <= r["atol"]
    assert r["block_bytes"] == BLOCK_BYTES
    assert r["blocks_offloaded"] == TINY_PROMPT // BLOCK
    assert r["d2h_bytes"] == r["blocks_offloaded"] * BLOCK_BYTES
    assert r["blocks_reused"] == TINY_SHARED // BLOCK
    assert r["reused_tokens"] == r["blocks_reused"] * BLOCK
    assert r["suffix_tokens"] == TINY_PROMPT - r["reused_tokens"]
    assert r["h2d_bytes"] == r["blocks_reused"] * BLOCK_BYTES
    first1, last1 = r["device_blocks"]["request1"]
    first2, last2 = r["device_blocks"]["request2"]
    assert first2 > last1 and last2 - first2 + 1 == r["blocks_reused"], "request 2 lands in fresh device blocks"


def test_corrupted_host_block_fails_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    rc, r = _run(capsys, "--inject-fault")
    assert rc == 1 and r["passed"] is False
    assert not r["kv_bytes_exact"] and not r["logits_allclose"]


def test_prefix_shorter_than_a_block_reuses_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--tiny", "--json", "--prompt-tokens", "48", "--shared-tokens", "10"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["passed"]
    assert r["blocks_reused"] == 0 and r["h2d_bytes"] == 0 and r["suffix_tokens"] == 48


def test_text_report_says_pass(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--tiny", "--prompt-tokens", "64", "--shared-tokens", "40"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "TTFT no reuse" in out and "TTFT reuse" in out and out.rstrip().endswith("PASS")


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--prompt-tokens", "64", "--shared-tokens", "64"]) == 2
    assert "shared_tokens" in capsys.readouterr().err


def test_main_forces_hub_offline_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main(["--tiny", "--prompt-tokens", "8"]) == 2  # refused after the environment is set
    assert os.environ["HF_HUB_OFFLINE"] == "1"
