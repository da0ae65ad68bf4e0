"""Prefill -> decode across two hosts, here two network namespaces joined by a veth pair.

    sudo python examples/multihost_disagg/run.py [--prompt-tokens 6000] [--requests 2]

"Host" A (namespace ``tsA``, 10.78.0.1) runs the prefill engine and its KV server; host B
(``tsB``, 10.78.0.2) runs the decode engine and the router, and this script's client. The
KV crosses the veth link over TCP: the script prints the link's byte counters next to TTFT
and TPOT. Needs root and iproute2 (``ip netns``); removes the namespaces when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from tiersync.bench.engine_server import start
from tiersync.bench.serve_engine import make_prompt
from tiersync.bench.tiny_llama import write_tiny_llama

NS = ("tsA", "tsB")
ADDR = ("10.78.0.1", "10.78.0.2")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def make_hosts() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", "tsvA", "type", "veth", "peer", "name", "tsvB")
    for ns, dev, addr in zip(NS, ("tsvA", "tsvB"), ADDR):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def rx_bytes() -> int:
    return int(sh("ip", "netns", "exec", NS[1], "cat", "/sys/class/net/tsvB/statistics/rx_bytes"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (ip netns)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="tiersync-mh-")
    model = write_tiny_llama(os.path.join(work, "model"))
    base = {"model": model, "connector": "tiersync"}
    py, servers = sys.executable, []
    make_hosts()
    ok = False
    try:
        on = [["ip", "netns", "exec", ns] for ns in NS]
        prefill = start(
            [
                "engine",
                json.dumps({**base, "kv_role": "kv_producer", "extra": {"pd_host": ADDR[0], "pd_port": 17800}}),
                "0",
                ADDR[0],
            ],
            os.path.join(work, "prefill.log"),
            py,
            prefix=on[0],
        )
        servers.append(prefill)
        decode = start(
            ["engine", json.dumps({**base, "kv_role": "kv_consumer"}), "0", ADDR[1]],
            os.path.join(work, "decode.log"),
            py,
            prefix=on[1],
        )
        servers.append(decode)
        ok = True
        client = [
            *on[1],
            py,
            "-c",
            "import json,sys; from tiersync.bench.engine_server import post; "
            "print(json.dumps(post(sys.argv[1], json.loads(sys.argv[2]))))",
        ]
        for i in range(args.requests):
            prompt = make_prompt(args.prompt_tokens, 200 + i, 4096)
            before = rx_bytes()
            first = json.loads(
                sh(
                    *client,
                    prefill.url + "/generate",
                    json.dumps(
                        {"prompt_token_ids": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
                    ),
                )
            )
            out = json.loads(
                sh(
                    *client,
                    decode.url + "/generate",
                    json.dumps(
                        {
                            "prompt_token_ids": prompt,
                            "max_tokens": args.output_tokens,
                            "kv_transfer_params": first["kv_transfer_params"],
                        }
                    ),
                )
            )
            mono = json.loads(
                sh(
                    *client,
                    prefill.url + "/generate",
                    json.dumps({"prompt_token_ids": prompt, "max_tokens": args.output_tokens}),
                )
            )
            moved = rx_bytes() - before
            same = out["tokens"] == mono["tokens"]
            ok &= same
            tpot = out["seconds"] / args.output_tokens
            print(
                f"request {i}: prefill on A {first['seconds'] * 1e3:6.0f} ms, decode on B {out['seconds'] * 1e3:6.0f} ms "
                f"({out['cached_tokens']} prompt tokens pulled over the link, {moved / 1e6:.1f} MB received by B), "
                f"TTFT ~{(first['seconds'] + out['seconds'] - (args.output_tokens - 1) * tpot) * 1e3:.0f} ms, "
                f"tokens identical to monolithic: {same}"
            )
    finally:
        for s in servers:
            s.kill()
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
    if ok:  # the model and logs are kept only when something went wrong
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print("logs kept in", work, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
