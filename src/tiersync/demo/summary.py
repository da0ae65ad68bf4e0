"""The demo's result: one JSON-able dict of sizes, timings, bandwidths and the correctness checks.

:func:`summarize` turns what the phases of :func:`tiersync.demo.run.run_demo` returned into
that dict; ``passed`` is True iff request 2's reuse from the host tier and (when it ran) its
reuse from disk after the restart both match a full recompute (logits within ``ATOL``/``RTOL``,
same argmax, byte-exact KV) and hit where they should.
"""

from __future__ import annotations

from typing import Any

import torch

from tiersync.demo.rig import Rig, Settings

ATOL, RTOL = 1e-4, 1e-5


def _span(blocks: list[int]) -> list[int]:
    """``[first, last]`` of a block range, ``[]`` when empty."""
    return [blocks[0], blocks[-1]] if blocks else []


def _gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _logits_check(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    return {
        "logits_max_abs_diff": float((a - b).abs().max()),
        "logits_allclose": bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL)),
        "argmax_match": int(a.argmax()) == int(b.argmax()),
    }


def _restart_summary(s: Settings, full: dict, restart: dict | None) -> dict[str, Any]:
    """Request 2 served from disk after the restart (or why that phase was skipped)."""
    if restart is None:
        return {"skipped": "request 2 has no full block of its own, so nothing filled the host tier", "passed": True}
    rc = _logits_check(full["logits"], restart["logits"])
    expected = (s.prompt_tokens - 1) // s.block_size  # every block of request 2 left before its last token
    hit_disk = restart["hit"]["storage"] == expected and restart["hit"]["host"] == 0 and restart["blocks"] == expected
    return {
        "open_s": restart["open_s"],
        "storage_blocks_found": restart["storage_blocks_found"],
        "blocks_hit": restart["hit"],
        "expected_blocks": expected,
        "blocks_reused": restart["blocks"],
        "reused_tokens": restart["reused_tokens"],
        "suffix_tokens": s.prompt_tokens - restart["reused_tokens"],
        "disk_bytes": restart["disk_bytes"],
        "h2d_bytes": restart["bytes"],
        "load_s": restart["seconds"],
        "load_gbps": _gbps(restart["bytes"], restart["seconds"]),
        "ttft_s": restart["ttft_s"],
        "speedup": full["ttft_s"] / restart["ttft_s"] if restart["ttft_s"] > 0 else None,
        **rc,
        "kv_bytes_exact": restart["kv_exact"],
        "hit_on_disk": hit_disk,
        "passed": rc["logits_allclose"] and rc["argmax_match"] and restart["kv_exact"] and hit_disk,
    }


def _disk_summary(rig: Rig, full: dict, demote: dict, restart: dict | None) -> dict[str, Any]:
    """The disk phases: the directory, the demotion to disk and the restart."""
    return {
        "storage_dir": rig.storage_dir,
        "storage_dir_kept": not rig.own_dir,
        "cleared_stale_blocks": rig.cleared_blocks,
        "demote": {
            "request2_blocks_saved": demote["saved_blocks"],
            "blocks": demote["blocks"],
            "bytes": demote["bytes"],
            "seconds": demote["seconds"],
            "gbps": _gbps(demote["bytes"], demote["seconds"]),
            "drained": demote["drained"],
            "host_entries_after": demote["host_entries"],
            "storage_entries_after": demote["storage_entries"],
        },
        "restart": _restart_summary(rig.settings, full, restart),
    }


def summarize(
    rig: Rig, one: dict, full: dict, reuse: dict, kv_exact: bool, demote: dict, restart: dict | None
) -> dict[str, Any]:
    """The JSON-able result: sizes, timings, bandwidths and the correctness checks."""
    s = rig.settings
    check = _logits_check(full["logits"], reuse["logits"])
    host_only = reuse["hit"]["storage"] == 0
    phase2_ok = check["logits_allclose"] and check["argmax_match"] and kv_exact and host_only
    disk = _disk_summary(rig, full, demote, restart)
    return {
        "model": {
            "name": rig.identity.model,
            "weights_version": rig.identity.weights_version,
            "layers": rig.model.geometry.num_layers,
            "kv_heads": rig.model.geometry.kv_heads,
            "head_dim": rig.model.geometry.head_dim,
            "params": rig.model.num_params,
            "dtype": "float32",
        },
        "prompt_tokens": s.prompt_tokens,
        "shared_tokens": s.shared_tokens,
        "block_size": s.block_size,
        "repeats": s.repeats,
        "block_bytes": rig.paged.block_nbytes,
        "host_blocks": rig.host_blocks,
        "blocks_offloaded": one["blocks"],
        "d2h_bytes": one["bytes"],
        "d2h_s": one["seconds"],
        "d2h_gbps": _gbps(one["bytes"], one["seconds"]),
        "blocks_reused": reuse["blocks"],
        "blocks_hit": reuse["hit"],
        "reused_tokens": reuse["reused_tokens"],
        "suffix_tokens": s.prompt_tokens - reuse["reused_tokens"],
        "device_blocks": {"request1": _span(one["device_blocks"]), "request2": _span(reuse["device_blocks"])},
        "h2d_bytes": reuse["bytes"],
        "h2d_s": reuse["seconds"],
        "h2d_gbps": _gbps(reuse["bytes"], reuse["seconds"]),
        "prefill1_s": one["prefill_s"],
        "ttft_no_reuse_s": full["ttft_s"],
        "ttft_reuse_s": reuse["ttft_s"],
        "speedup": full["ttft_s"] / reuse["ttft_s"] if reuse["ttft_s"] > 0 else None,
        **check,
        "atol": ATOL,
        "rtol": RTOL,
        "kv_bytes_exact": kv_exact,
        "host_phase_passed": phase2_ok,
        **disk,
        "passed": phase2_ok and disk["restart"]["passed"],
    }
