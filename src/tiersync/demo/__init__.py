"""``tiersync demo``: prefix reuse of a real transformer's KV cache, device -> host -> disk.

A tiny random-weight Llama (bundled config, fixed seed, float32, CPU; nothing
is downloaded) prefills a long prompt; its KV is paged into a block pool and
saved to a :class:`~tiersync.store.KVCacheStore` (host tier, then a disk
tier) by prefix key. A second request sharing the prefix loads those blocks
from the host into other device blocks and runs only its suffix. Its own KV
then fills the host tier, which demotes everything to disk; after a restart
(a new store on the same directory, empty host tier) the second request hits
on disk. Both times its next-token logits are checked against a full recompute.

Run ``python -m tiersync.demo [--quick] [--json]``. Exit status: 0 when the
check passes, 1 when it fails, 2 when torch/transformers are missing.
torch and transformers are imported only when :func:`main` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PRESETS = {  # (prompt_tokens, shared_tokens, repeats)
    "default": (4096, 3800, 3),
    "quick": (2048, 1800, 3),
    "tiny": (160, 100, 1),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiersync demo", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter prompts (about 10 s on two cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--prompt-tokens", type=int, help="tokens per prompt (overrides the preset)")
    p.add_argument("--shared-tokens", type=int, help="tokens both prompts share (overrides the preset)")
    p.add_argument("--repeats", type=int, help="time TTFT and h2d this many times, report the fastest")
    p.add_argument("--storage-dir", help="directory of the disk tier (kept; default: a temporary one, removed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # for tests
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)  # the check must fail
    return p


def _settings(args: argparse.Namespace) -> Any:
    from tiersync.demo.run import Settings

    prompt, shared, repeats = PRESETS["tiny" if args.tiny else "quick" if args.quick else "default"]
    prompt = args.prompt_tokens or prompt
    shared = args.shared_tokens if args.shared_tokens is not None else min(shared, prompt - 1)
    return Settings(
        prompt_tokens=prompt,
        shared_tokens=shared,
        seed=args.seed,
        repeats=args.repeats or repeats,
        inject_fault=args.inject_fault,
        storage_dir=args.storage_dir,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the demo; print a report (or JSON with ``--json``); 0 iff every check passed."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never touch the network
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from tiersync.demo.run import run_demo
    except ImportError as exc:
        print(f"tiersync demo needs torch and transformers (pip install 'tiersync[demo]'): {exc}", file=sys.stderr)
        return 2
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"tiersync demo: {exc}", file=sys.stderr)
        return 2
    result = run_demo(settings)
    print(json.dumps(result) if args.json else format_report(result))
    return 0 if result["passed"] else 1


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def format_report(r: dict[str, Any]) -> str:
    """A short human-readable report of a :func:`~tiersync.demo.run.run_demo` result."""
    m = r["model"]
    lines = [
        f"tiersync demo: Llama {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"{m['params'] / 1e6:.1f}M params, float32, CPU (random weights {m['weights_version']})",
        f"  prompts           {r['prompt_tokens']} tokens, {r['shared_tokens']} shared; blocks of {r['block_size']} "
        f"tokens = {r['block_bytes'] / 1024:.0f} KiB; host tier {r['host_blocks']} blocks",
        f"  request 1         prefill {r['prefill1_s']:.3f} s; saved {r['blocks_offloaded']} blocks "
        f"({r['d2h_bytes'] / 2**20:.1f} MiB) d2h in {r['d2h_s'] * 1e3:.2f} ms = {_num(r['d2h_gbps'], '.2f')} GB/s",
        f"  request 2 (host)  {r['blocks_reused']} blocks hit (host {r['blocks_hit']['host']}, disk "
        f"{r['blocks_hit']['storage']}; {r['reused_tokens']} tokens, {r['h2d_bytes'] / 2**20:.1f} MiB) "
        f"h2d in {r['h2d_s'] * 1e3:.2f} ms = {_num(r['h2d_gbps'], '.2f')} GB/s; ran {r['suffix_tokens']} suffix tokens",
        f"  timing            fastest of {r['repeats']} run(s); a reuse TTFT includes lookup, loads and cache rebuild",
        f"  TTFT no reuse     {r['ttft_no_reuse_s'] * 1e3:.1f} ms",
        f"  TTFT reuse        {r['ttft_reuse_s'] * 1e3:.1f} ms  (speedup {_num(r['speedup'], '.2f')}x)",
        f"  logits max diff   {r['logits_max_abs_diff']:.3g} (atol {r['atol']:g}); argmax "
        f"{'matches' if r['argmax_match'] else 'DIFFERS'}; KV bytes {'exact' if r['kv_bytes_exact'] else 'DIFFER'}",
    ]
    d, x = r["demote"], r["restart"]
    lines.append(
        f"  host -> disk      request 2 saved {d['request2_blocks_saved']} new blocks, then "
        f"{'the full host tier demoted' if d['blocks'] else 'demoted'} {d['blocks']} blocks "
        f"({d['bytes'] / 2**20:.1f} MiB, fsynced); save + demotion {d['seconds'] * 1e3:.1f} ms = "
        f"{_num(d['gbps'], '.2f')} GB/s; host entries left {d['host_entries_after']}, on disk "
        f"{d['storage_entries_after']}"
    )
    if "skipped" in x:
        lines.append(f"  restart           skipped: {x['skipped']}")
    else:
        lines += [
            f"  restart           new store on {r['storage_dir']} in {x['open_s'] * 1e3:.1f} ms: "
            f"{x['storage_blocks_found']} blocks found on disk, host tier empty",
            f"  request 2 (disk)  {x['blocks_reused']}/{x['expected_blocks']} blocks hit (host "
            f"{x['blocks_hit']['host']}, disk {x['blocks_hit']['storage']}; {min(x['blocks_reused'], r['blocks_reused'])} "
            f"saved by request 1, the rest by request 2); read {x['disk_bytes'] / 2**20:.1f} MiB "
            f"disk -> host -> device ({x['h2d_bytes'] / 2**20:.1f} MiB h2d) in {x['load_s'] * 1e3:.2f} ms = "
            f"{_num(x['load_gbps'], '.2f')} GB/s",
            f"  TTFT after restart {x['ttft_s'] * 1e3:.1f} ms  (speedup {_num(x['speedup'], '.2f')}x)",
            f"  logits max diff   {x['logits_max_abs_diff']:.3g}; argmax "
            f"{'matches' if x['argmax_match'] else 'DIFFERS'}; KV bytes {'exact' if x['kv_bytes_exact'] else 'DIFFER'}; "
            f"prefix {'hit on disk' if x['hit_on_disk'] else 'did NOT hit on disk'}",
        ]
    lines.append(f"  {'PASS' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)
