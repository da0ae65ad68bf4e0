"""Torch state_dicts and JAX arrays (bfloat16 included) as trainer inputs, bitwise at the samplers.

Each case runs in a fresh interpreter: JAX and the bf16 path import ml_dtypes, which registers
bfloat16 with numpy for the rest of a process and would change what other suites see.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import tiersync

COMMON = """
    import numpy as np
    from tiersync.weights import Mesh, Sharding
    from tiersync.weights.config import PublisherConfig, ReceiverConfig, TransportKind
    from tiersync.weights.publisher import WeightPublisher
    from tiersync.weights.receiver import WeightReceiver
    from tiersync.weights.tensors import as_torch, host_bytes

    def sync(local, src, dst, count, transport, global_shapes=None, rank=0):
        pub = WeightPublisher(local, src, rank=rank, global_shapes=global_shapes)
        recs = [WeightReceiver(dst, ReceiverConfig((pub.address,), rank=r, transport=transport)) for r in range(count)]
        pub.wait_for_samplers(count, 30)
        assert pub.publish(1).result(60).ok
        out = []
        for r in recs:
            r.receive(1).result(60)
            with r.acquire(10) as lease:
                out.append({k: v.copy() for k, v in lease.tensors.items()})
            r.close()
        pub.close()
        return out
"""


def _run(code: str, needs: str) -> None:
    if importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    src = os.path.dirname(os.path.dirname(tiersync.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COMMON) + textwrap.dedent(code)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout


@pytest.mark.torch
def test_torch_bf16_state_dict_tp2_to_samplers():
    _run(
        """
        import torch
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
        sd = net.state_dict()
        src = Sharding.replicated(Mesh((1,), ("t",)))
        dst = {k: Sharding(Mesh((2,), ("tp",)), ("tp",)) for k in sd}  # row-parallel on dim 0
        for transport in (TransportKind.AUTO, TransportKind.TCP):
            out = sync(sd, src, dst, 2, transport)
            for rank, got in enumerate(out):
                for k, t in sd.items():
                    n = t.shape[0] // 2
                    want = t[rank * n:(rank + 1) * n] if rank == 0 else t[n:]
                    g = as_torch(got[k], "bfloat16")
                    assert g.dtype == torch.bfloat16 and g.shape == want.shape, k
                    assert torch.equal(g.view(torch.int16), want.contiguous().view(torch.int16)), k
        print("OK")
    """,
        "torch",
    )


@pytest.mark.jax
def test_jax_bf16_arrays_two_trainer_shards():
    _run(
        """
        import jax, jax.numpy as jnp
        full = {"w": jax.random.normal(jax.random.PRNGKey(0), (10, 6), dtype=jnp.bfloat16),
                "b": jnp.arange(10, dtype=jnp.float32)}
        src = Sharding(Mesh((2,), ("fsdp",)), ("fsdp",))
        shapes = {k: v.shape for k, v in full.items()}
        pubs = [WeightPublisher({k: v[r * 5:(r + 1) * 5] for k, v in full.items()}, src, rank=r,
                                global_shapes=shapes) for r in range(2)]
        dst = Sharding.replicated(Mesh((1,), ("dp",)))
        rec = WeightReceiver(dst, ReceiverConfig(tuple(p.address for p in pubs)))
        for p in pubs:
            p.wait_for_samplers(1, 30)
        assert all(f.result(60).ok for f in [p.publish(1) for p in pubs])
        rec.receive(1).result(60)
        with rec.acquire(10) as lease:
            for k, v in full.items():
                assert lease.tensors[k].dtype.name == str(v.dtype), (k, lease.tensors[k].dtype)
                assert host_bytes(lease.tensors[k]).tobytes() == host_bytes(v).tobytes(), k
        # JAX arrays are immutable: a new version passes new arrays
        new = {k: v[:5] + 1 for k, v in full.items()}
        futs = [pubs[0].publish(2, new), pubs[1].publish(2)]  # every shard publishes the version
        assert all(f.result(60).ok for f in futs)
        rec.receive(2).result(60)
        with rec.acquire(10) as lease:
            assert host_bytes(lease.tensors["w"][:5]).tobytes() == host_bytes(new["w"]).tobytes()
        rec.close()
        for p in pubs:
            p.close()
        print("OK")
    """,
        "jax",
    )
