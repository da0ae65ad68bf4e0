"""End-to-end checks of ``tiersync demo`` on its hidden ``--tiny`` setting (no timing assertions)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiersync.demo import main

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
    _first1, last1 = r["device_blocks"]["request1"]
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


def test_restart_hits_on_disk(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    rc, r = _run(capsys, "--storage-dir", str(tmp_path))
    assert rc == 0 and r["passed"] and r["host_phase_passed"]
    assert r["blocks_hit"] == {"host": TINY_SHARED // BLOCK, "storage": 0}, "request 2 first hits the host tier"
    d, x = r["demote"], r["restart"]
    assert d["request2_blocks_saved"] == TINY_PROMPT // BLOCK - TINY_SHARED // BLOCK
    assert d["drained"] and d["host_entries_after"] == 0
    assert (
        d["storage_entries_after"] == d["blocks"] == r["host_blocks"] == TINY_PROMPT // BLOCK * 2 - TINY_SHARED // BLOCK
    )
    assert d["bytes"] >= d["blocks"] * BLOCK_BYTES
    expected = (TINY_PROMPT - 1) // BLOCK  # request 1's shared blocks and request 2's own, last token left to run
    assert x["passed"] and x["hit_on_disk"] and x["expected_blocks"] == expected
    assert x["storage_blocks_found"] == d["blocks"]
    assert x["blocks_hit"] == {"host": 0, "storage": expected} and x["blocks_reused"] == expected
    assert x["h2d_bytes"] == expected * BLOCK_BYTES and x["disk_bytes"] >= x["h2d_bytes"]
    assert x["logits_allclose"] and x["argmax_match"] and x["kv_bytes_exact"]
    assert x["logits_max_abs_diff"] <= r["atol"] and x["ttft_s"] > 0
    assert r["storage_dir"] == str(tmp_path) and r["storage_dir_kept"] and any(tmp_path.iterdir())
    rc, again = _run(capsys, "--storage-dir", str(tmp_path))  # a kept directory: its old blocks are cleared first
    assert rc == 0 and again["passed"] and again["cleared_stale_blocks"] == d["blocks"]
    assert again["blocks_hit"]["storage"] == 0


def test_temporary_storage_dir_is_removed(capsys: pytest.CaptureFixture[str]) -> None:
    import os

    rc, r = _run(capsys, "--prompt-tokens", "48", "--shared-tokens", "20")
    assert rc == 0 and r["passed"] and not r["storage_dir_kept"]
    assert r["restart"]["blocks_hit"] == {"host": 0, "storage": 2}
    assert not os.path.exists(r["storage_dir"])


def test_corrupted_host_block_also_fails_after_restart(capsys: pytest.CaptureFixture[str]) -> None:
    rc, r = _run(capsys, "--inject-fault")
    assert rc == 1 and not r["restart"]["passed"]
    assert not r["restart"]["logits_allclose"], "the corrupted block went to disk and is served from there too"
