"""Prefill -> decode on one host: two vLLM OpenAI servers and ``tiersync router`` in front.

    python examples/single_host_disagg/run.py [--prompt-tokens 6000] [--requests 3]

The prefill server runs the connector as ``kv_producer``, the decode server as
``kv_consumer``. The router (``tiersync router --prefill URL --decode URL``) sends each request
to the prefill server with one output token and ``kv_transfer_params={"do_remote_decode":
true}``, streams that token to the client, then sends the prompt's token ids and that token
to the decode server with the ``kv_transfer_params`` the prefill server returned; the decode
engine pulls the KV layer by layer instead of computing it. Prints TTFT (the first streamed
token) and TPOT per request, beside the same prompt on the prefill server alone (monolithic),
and whether the greedy tokens are identical.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _openai import OpenAIServer, done, free_port, stream


def kv(role: str, **extra: object) -> dict:
    return {
        "kv_connector": "TierSyncConnector",
        "kv_role": role,
        "kv_connector_module_path": "tiersync.integrations.vllm",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3)
    args = ap.parse_args()
    from tiersync.bench.tiny_llama import write_tiny_llama

    work = tempfile.mkdtemp(prefix="tiersync-pd-")
    model = write_tiny_llama(os.path.join(work, "model"))
    token = os.environ.get("TIERSYNC_TOKEN") or "example-only-token-change-me"  # >= 16 bytes
    prefill = decode = router = None
    same = False
    try:
        prefill = OpenAIServer(model, kv("kv_producer", pd_port=free_port(), pd_token=token), f"{work}/prefill.log")
        decode = OpenAIServer(model, kv("kv_consumer", pd_token=token), f"{work}/decode.log")
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiersync",
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        url = "http://" + router.stdout.readline().split("listening on ")[1].split()[0]
        r, same = random.Random(0), True
        for i in range(args.requests):
            prompt = [r.randrange(3, 4000) for _ in range(args.prompt_tokens)]
            mono_first, _, mono = stream(prefill.url, model, prompt, args.output_tokens)
            pd_first, seconds, pd = stream(url, model, prompt, args.output_tokens)
            same &= pd == mono
            print(
                f"request {i}: monolithic TTFT {mono_first * 1e3:7.0f} ms | prefill->decode TTFT "
                f"{pd_first * 1e3:7.0f} ms ({pd_first / mono_first:.2f}x), TPOT "
                f"{(seconds - pd_first) / (args.output_tokens - 1) * 1e3:5.1f} ms, tokens identical: {pd == mono}"
            )
    except RuntimeError as exc:  # a server did not start
        print(exc, file=sys.stderr)
        same = False
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for server in (decode, prefill):
            if server is not None:
                server.stop()
    return done(work, same)


if __name__ == "__main__":
    sys.exit(main())
