"""tiersync weight sync on a real local Ray cluster, as RL trainers on Ray use it.

The actors of ``examples/ray_weight_sync``: a named trainer actor (a torch model's state_dict
behind a :class:`~tiersync.weights.WeightPublisher`) and sampler actors (each a
:class:`~tiersync.weights.WeightReceiver`) that find the trainer's address through Ray by its
name. The driver loop: ``train_step`` -> ``publish(v)`` -> every sampler reports the sha256,
shape and dtype of each tensor it serves, compared with the trainer's own slices.

The kill test makes sure the kill lands mid-sync with a hook, not with timing: the victim's
progress hook blocks forever after the first chunk of the version landed (one copy thread, so
that chunk is not the whole version), so the version can neither finish nor be answered;
the test waits for that event, checks that the publish is still in flight and that only part
of the bytes landed, then ``ray.kill``s the actor.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (.venv/bin/pip install ray==2.60.0)")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(REPO, "examples", "ray_weight_sync")
sys.path.insert(0, EXAMPLE)

from ray_workers import SamplerWorker, TrainerWorker  # noqa: E402

from _ray_stall import StallingSampler  # noqa: E402
from tiersync.weights import SyncStatus, TransportKind  # noqa: E402

TOKEN = "ray-weight-sync-test-token-0001"
TIMEOUT = 120


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster sized for a 2-core CI machine; its workers import the example's
    actors and the stalling sampler by module name."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 << 20,
        namespace="tiersync-ray-test",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([EXAMPLE, HERE])}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def deployment(name: str) -> Iterator[tuple]:
    """A named trainer actor and a dict rank -> sampler actor to fill; every actor killed at
    the end, the trainer closed first."""
    trainer = (
        ray.remote(TrainerWorker)
        .options(name=name, num_cpus=0)
        .remote(TOKEN, hidden=256, layers=4, publish_timeout_s=TIMEOUT)
    )
    samplers: dict[int, object] = {}
    try:
        yield trainer, samplers
    finally:
        for s in samplers.values():
            ray.kill(s)  # a sampler owns no /dev/shm segment (and one may be stuck mid-sync)
        ray.get(trainer.close.remote(), timeout=TIMEOUT)  # unlinks the trainer's segment
        ray.kill(trainer)


def add_samplers(samplers: dict, ranks, dp: int, tp: int, trainer: str, cls=SamplerWorker, **kw) -> None:
    """Start sampler actors of ``ranks``; return once each has registered with the trainer."""
    new = {r: ray.remote(cls).options(num_cpus=0).remote(r, dp, tp, TOKEN, trainer=trainer, **kw) for r in ranks}
    assert ray.get([s.ready.remote() for s in new.values()], timeout=TIMEOUT) == list(new)
    samplers.update(new)


def confirm(trainer, samplers: dict, version: int, dp: int, tp: int) -> dict[int, dict]:
    """Every sampler in ``samplers`` holds ``version``, bitwise its slice of the trainer's
    weights; the trainer's digests per rank."""
    held = ray.get([s.wait_version.remote(version, TIMEOUT) for s in samplers.values()], timeout=TIMEOUT)
    want = ray.get(trainer.expected.remote(dp, tp), timeout=TIMEOUT)
    for rank, h in zip(samplers, held):
        assert h["version"] == version, (rank, h["version"])
        assert h["tensors"] == want[rank], f"sampler {rank} differs from the trainer at version {version}"
        assert h["transports"] == [TransportKind.SHM.value]  # same host: the /dev/shm segment
    return want


def publish(trainer, version: int):
    ray.get(trainer.train_step.remote(), timeout=TIMEOUT)
    return ray.get(trainer.publish.remote(version, TIMEOUT), timeout=TIMEOUT)


@pytest.mark.parametrize("dp, tp", [(3, 1), (1, 2)], ids=["replicated-x3", "tp2-resharded"])
def test_each_version_reaches_every_sampler_actor_bitwise(cluster, dp, tp):
    with deployment(f"trainer-{dp}x{tp}") as (trainer, samplers):
        add_samplers(samplers, range(dp * tp), dp, tp, f"trainer-{dp}x{tp}")
        ray.get(trainer.wait_for_samplers.remote(dp * tp, TIMEOUT), timeout=TIMEOUT)
        before = None
        for version in (1, 2, 3):
            result = publish(trainer, version)
            assert result.ok and [o.rank for o in result.outcomes] == list(range(dp * tp)), result
            want = confirm(trainer, samplers, version, dp, tp)
            assert want != before  # the step changed the weights: this version is new bytes
            before = want
        if tp > 1:  # resharded: each sampler holds its rows of every tensor
            shapes = {rank: {n: d[0] for n, d in w.items()} for rank, w in want.items()}
            assert shapes[0]["0.weight"] == shapes[1]["0.weight"] == (128, 256)


def test_sampler_actor_killed_mid_sync_is_reported_and_the_others_finish_bitwise(cluster):
    dp, name = 3, "trainer-kill"
    with deployment(name) as (trainer, samplers):
        add_samplers(samplers, [0, 1], dp, 1, name)
        add_samplers(samplers, [2], dp, 1, name, cls=StallingSampler, stall=2)
        ray.get(trainer.wait_for_samplers.remote(dp, TIMEOUT), timeout=TIMEOUT)
        assert publish(trainer, 1).ok
        confirm(trainer, samplers, 1, dp, 1)

        ray.get(trainer.train_step.remote(), timeout=TIMEOUT)
        pending = trainer.publish.remote(2, TIMEOUT)
        victim = samplers[2]
        done, total = ray.get(victim.wait_stalled.remote(TIMEOUT), timeout=TIMEOUT)
        assert 0 < done < total  # part of version 2 landed in the victim, not all of it
        assert ray.wait([pending], timeout=0)[0] == []  # the publish is waiting for the victim
        ray.kill(victim, no_restart=True)

        result = ray.get(pending, timeout=TIMEOUT)
        by_rank = {o.rank: o for o in result.outcomes}
        assert sorted(by_rank) == [0, 1, 2]
        assert by_rank[0].status is SyncStatus.OK and by_rank[1].status is SyncStatus.OK
        assert by_rank[2].status is SyncStatus.DISCONNECTED and by_rank[2].error, by_rank[2]
        assert not result.ok and [o.sampler for o in result.failed] == ["sampler-2"]
        del samplers[2]
        confirm(trainer, samplers, 2, dp, 1)  # the survivors: version 2, bitwise
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(victim.ready.remote(), timeout=TIMEOUT)

        # A replacement actor of rank 2 (what a Ray actor restart would start) rejoins
        add_samplers(samplers, [2], dp, 1, name)
        ray.get(trainer.wait_for_samplers.remote(dp, TIMEOUT), timeout=TIMEOUT)
        result = publish(trainer, 3)
        assert result.ok and len(result.outcomes) == dp, result
        confirm(trainer, samplers, 3, dp, 1)


def test_example_script_runs_as_a_second_driver_of_the_cluster(cluster):
    """``run.py`` as a user runs it (here joining the test's cluster instead of starting one):
    4 samplers, tp 2, every step checked; exit 0 only when every sampler matched."""
    address = ray.get_runtime_context().gcs_address
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(EXAMPLE, "run.py"),
            "--address",
            address,
            "--samplers",
            "4",
            "--tp",
            "2",
            "--steps",
            "2",
            "--hidden",
            "256",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert sum("ok via shm" in line and "bytes match" in line for line in lines) == 8, run.stdout
    assert lines[-1].endswith("all samplers match"), run.stdout


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_vllm_server_actor_as_a_sampler_serves_the_published_checkpoint(request, tmp_path):
    """A Ray actor owning vLLM's OpenAI server (tiersync weight-transfer backend, vLLM venv)
    joins the named trainer actor; after publish + update it answers as a server started from
    the published checkpoint (float32 engines: greedy tokens compared exactly)."""
    from _vllm_engine import require_vllm

    require_vllm()
    request.getfixturevalue("cluster")  # started only once the vLLM venv is known to be there
    from _ray_vllm import CheckpointTrainer, VllmSampler
    from tiersync.bench.serve_engine import make_prompt
    from tiersync.bench.tiny_llama import write_tiny_llama

    model_a, model_b = (write_tiny_llama(str(tmp_path / n), seed=s) for n, s in (("a", 0), ("b", 1)))
    prompts = [make_prompt(200, seed=s, vocab=1000) for s in (1, 2)]
    vllm_actor = ray.remote(VllmSampler).options(num_cpus=0)
    ref = vllm_actor.remote(model_b, str(tmp_path / "ref.log"))
    try:
        expected = ray.get([ref.complete.remote(p) for p in prompts], timeout=900)
    finally:
        ray.get(ref.close.remote(), timeout=TIMEOUT)
        ray.kill(ref)
    trainer = ray.remote(CheckpointTrainer).options(name="trainer-vllm", num_cpus=0).remote(TOKEN, model_b, 600)
    engine = vllm_actor.remote(model_a, str(tmp_path / "engine.log"))
    try:
        assert ray.get([engine.complete.remote(p) for p in prompts], timeout=900) != expected  # A differs from B
        ray.get(engine.join.remote("trainer-vllm", TOKEN), timeout=600)
        ray.get(trainer.wait_for_samplers.remote(1, TIMEOUT), timeout=TIMEOUT)
        pending = trainer.publish.remote(1, 600)
        assert ray.get(engine.update.remote(1), timeout=600) == "1"
        result = ray.get(pending, timeout=600)
        assert result.ok and [(o.status, o.transport) for o in result.outcomes] == [
            (SyncStatus.OK, TransportKind.SHM)
        ], result
        assert ray.get([engine.complete.remote(p) for p in prompts], timeout=600) == expected
    finally:
        ray.get([engine.close.remote(), trainer.close.remote()], timeout=TIMEOUT)
        ray.kill(engine)
        ray.kill(trainer)
