"""``tiersync demo``: prefix reuse of a real transformer's KV cache through the host tier.

A tiny random-weight Llama (bundled config, fixed seed, float32, CPU; nothing
is downloaded) prefills a long prompt; its KV is paged into a block pool and
offloaded to a host arena by prefix key. A second request sharing the prefix
loads those blocks back into other device blocks and runs only its suffix;
its next-token logits are checked against a full recompute.

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
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # for tests
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)  # the check must fail
    return p


def _settings(args: argparse.Namespace) -> Any:
    from tiersync.demo.run import Settings

    prompt, shared, repeats = PRESETS["tiny" if args.tiny else "quick" if args.quick else "default"]
    prompt = args.prompt_tokens or prompt
    shared = args.shared_tokens if args.shared_tokens is not None else min(shared, prompt - 1)
    return Settings(prompt_tokens=prompt, shared_tokens=shared, seed=args.seed,
                    repeats=args.repeats or repeats, inject_fault=args.inject_fault)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; print a report (or JSON with ``--json``); 0 iff the logits check passed."""
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
        f"{m['params'] / 1e6:.1f}M params, float32, CPU (random weights)",
        f"  prompts           {r['prompt_tokens']} tokens, {r['shared_tokens']} shared; blocks of {r['block_size']} "
        f"tokens = {r['block_bytes'] / 1024:.0f} KiB",
        f"  request 1         prefill {r['prefill1_s']:.3f} s; offloaded {r['blocks_offloaded']} blocks "
        f"({r['d2h_bytes'] / 2**20:.1f} MiB) d2h in {r['d2h_s'] * 1e3:.2f} ms = {_num(r['d2h_gbps'], '.2f')} GB/s",
        f"  request 2 reuse   {r['blocks_reused']} blocks ({r['reused_tokens']} tokens, "
        f"{r['h2d_bytes'] / 2**20:.1f} MiB) h2d in {r['h2d_s'] * 1e3:.2f} ms = {_num(r['h2d_gbps'], '.2f')} GB/s; "
        f"ran {r['suffix_tokens']} suffix tokens",
        f"  timing            fastest of {r['repeats']} run(s); the reuse TTFT includes lookup, h2d and cache rebuild",
        f"  TTFT no reuse     {r['ttft_no_reuse_s'] * 1e3:.1f} ms",
        f"  TTFT reuse        {r['ttft_reuse_s'] * 1e3:.1f} ms  (speedup {_num(r['speedup'], '.2f')}x)",
        f"  logits max diff   {r['logits_max_abs_diff']:.3g} (atol {r['atol']:g}); argmax "
        f"{'matches' if r['argmax_match'] else 'DIFFERS'}; KV bytes {'exact' if r['kv_bytes_exact'] else 'DIFFER'}",
        f"  {'PASS' if r['passed'] else 'FAIL'}",
    ]
    return "\n".join(lines)
