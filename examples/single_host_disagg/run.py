"""Prefill -> decode on one host: a router, a prefill engine and a decode engine, each its
own process, talking HTTP (router) and tiersync's KV protocol (prefill -> decode, TCP).

    python examples/single_host_disagg/run.py [--prompt-tokens 6000] [--requests 3]

The router sends each request to the prefill engine (one output token, with
``kv_transfer_params={"do_remote_decode": true}``), then to the decode engine with the
``kv_transfer_params`` the prefill engine returned; the decode engine pulls the prompt's KV
layer by layer instead of computing it. Prints TTFT (time to the decode engine's first
token) and TPOT per request, beside the same prompt on one engine (monolithic).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tiersync.bench.engine_server import start
from tiersync.bench.serve_engine import make_prompt
from tiersync.bench.tiny_llama import write_tiny_llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--pd-port", type=int, default=17700, help="the prefill engine's KV server port")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tiersync-pd-")
    model = write_tiny_llama(os.path.join(work, "model"))
    base = {"model": model, "connector": "tiersync"}
    py = sys.executable
    servers = []
    try:
        prefill = start(["engine", json.dumps({**base, "kv_role": "kv_producer",
                                               "extra": {"pd_port": args.pd_port}}), "0"],
                        os.path.join(work, "prefill.log"), py)
        servers.append(prefill)
        decode = start(["engine", json.dumps({**base, "kv_role": "kv_consumer"}), "0"],
                       os.path.join(work, "decode.log"), py)
        servers.append(decode)
        router = start(["router", prefill.url, decode.url, "0"], os.path.join(work, "router.log"), py)
        servers.append(router)
        same = True
        for i in range(args.requests):
            prompt = make_prompt(args.prompt_tokens, 100 + i, 4096)
            mono_first = prefill.generate(prompt, 1)["seconds"]  # monolithic TTFT
            mono = prefill.generate(prompt, args.output_tokens)
            pd_first = router.generate(prompt, 1)["seconds"]  # prefill + transfer + decode's first token
            pd = router.generate(prompt, args.output_tokens)
            tpot = (pd["seconds"] - pd_first) / (args.output_tokens - 1)
            same &= pd["tokens"] == mono["tokens"]
            print(f"request {i}: monolithic TTFT {mono_first * 1e3:7.0f} ms | prefill->decode TTFT "
                  f"{pd_first * 1e3:7.0f} ms ({pd_first / mono_first:.2f}x), TPOT {tpot * 1e3:5.1f} ms, "
                  f"{pd['cached_tokens']} prompt tokens pulled, tokens identical: {pd['tokens'] == mono['tokens']}")
        print("logs:", work)
        return 0 if same else 1
    finally:
        for s in servers:
            s.kill()


if __name__ == "__main__":
    sys.exit(main())
