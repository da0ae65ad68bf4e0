"""TierSyncHiCacheStorage against SGLang's real HiCache storage module (``HiCacheStorage``,
``HiCacheStorageConfig``), its dynamic-backend factory and its page keys (``get_hash_str``).

SGLang's host pool (``MHATokenToKVPoolHost``) cannot be built on this CPU machine: importing
``sglang.srt.mem_cache.memory_pool_host`` pulls in SGLang's model configs, which need a working
torchvision, and PyPI's torchvision does not load beside torch 2.13.0+cpu. ``HostPool`` below
stands in for it with exactly the calls SGLang's backends and cache controller make on a host
pool (``page_size``, ``layout``, ``dtype``, ``get_data_page(index, flat=True)``,
``get_dummy_flat_data_page()``, ``set_from_flat_data_page(index, page)``), written as
``MHATokenToKVPoolHost`` writes them for its "layer_first" layout: a page of a bfloat16
``(2, layers, tokens, heads, head_dim)`` buffer, not contiguous in it, so a flat page is a copy.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

try:
    import torch
    from sglang.srt.mem_cache import hicache_storage as hs
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"sglang is not importable ({exc}); CI installs sglang==0.5.23 and its import-time dependencies",
        allow_module_level=True,
    )

from tiers._damage import damage
from tiersync.errors import UsageError
from tiersync.integrations.sglang import TierSyncHiCacheStorage

pytestmark = pytest.mark.torch
PAGE = 4  # tokens per page
EXTRA = "hicache_storage_backend_extra_config"
DYNAMIC = {
    "backend_name": "tiersync",
    "module_path": "tiersync.integrations.sglang",
    "class_name": "TierSyncHiCacheStorage",
}


class HostPool:
    """The host-pool calls SGLang makes, as MHATokenToKVPoolHost does them (layer_first)."""

    layout, dtype, page_size = "layer_first", torch.bfloat16, PAGE

    def __init__(self, tokens: int = 64, layers: int = 2, heads: int = 2, head_dim: int = 16, seed: int = 0) -> None:
        self.shape = (2, layers, PAGE, heads, head_dim)
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, layers, tokens, heads, head_dim), generator=g).to(self.dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(self.shape)

    def page_bytes(self, slot: int) -> bytes:
        return self.get_data_page(slot).view(torch.uint8).numpy().tobytes()


def storage_config(
    extra: dict, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, model: str = "tiny-llama"
) -> hs.HiCacheStorageConfig:
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config=extra,
    )


def page_keys(n: int, seed: int = 1) -> list[str]:
    """SGLang's own page keys: chained SHA-256 hex strings of each page's token ids."""
    return get_hash_str(list(range(seed * 1000, seed * 1000 + n * PAGE)), None, page_size=PAGE)


def slots(first_page: int, n: int) -> torch.Tensor:
    """``host_indices`` of ``n`` pages from host page ``first_page``: one index per token."""
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


@pytest.fixture
def make(tmp_path):
    """``make(pool, **extra)``: a backend on ``tmp_path/kv`` (unless ``storage_dir`` is given) with
    a 64 KiB host tier (unless ``host_bytes`` is given), registered with ``pool``; every one made
    is closed at the end."""
    made = []

    def _make(pool: HostPool, *, cfg: dict | None = None, **extra) -> TierSyncHiCacheStorage:
        extra.setdefault("storage_dir", str(tmp_path / "kv"))
        extra.setdefault("host_bytes", "64KiB")  # not the default 1GiB: its arena is prefaulted
        extra = {k: v for k, v in extra.items() if v is not None}
        backend = TierSyncHiCacheStorage(storage_config(extra, **(cfg or {})), {})
        backend.register_mem_pool_host(pool)
        made.append(backend)
        return backend

    yield _make
    for b in made:
        b.close()


def test_pages_round_trip_byte_exact_through_both_call_paths(make):
    pool, keys = HostPool(), page_keys(4)
    backend = make(pool)
    assert backend.batch_set_v1(keys[:2], slots(0, 2)) == [True, True]
    assert backend.batch_set(keys[2:], [pool.get_data_page(2 * PAGE), pool.get_data_page(3 * PAGE)]) is True
    assert backend.batch_get_v1(keys, slots(8, 4)) == [True] * 4  # into other host slots
    assert [pool.page_bytes((8 + i) * PAGE) for i in range(4)] == [pool.page_bytes(i * PAGE) for i in range(4)]
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(t, pool.get_data_page(i * PAGE)) for i, t in enumerate(got))
    assert backend.batch_get_v1(keys, slots(8, 3)) == [False] * 4  # host_indices must cover every page
    disk_only = make(pool, host_bytes=0)  # the same pages, read from the disk tier alone
    assert disk_only.batch_get_v1(keys, slots(12, 4)) == [True] * 4
    assert [pool.page_bytes((12 + i) * PAGE) for i in range(4)] == [pool.page_bytes(i * PAGE) for i in range(4)]


@pytest.mark.parametrize("tier", [{"storage_dir": None}, {"host_bytes": 0}], ids=["host", "disk"])
def test_batch_exists_counts_the_prefix_up_to_the_first_gap(make, tier):
    pool, keys = HostPool(), page_keys(5)
    backend = make(pool, **tier)
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]], torch.cat([slots(0, 2), slots(3, 1)])) == [True] * 3
    assert backend.batch_exists(keys) == 2  # keys[3] is stored, but keys[2] is a gap before it
    assert backend.batch_exists(keys[3:]) == 1 and backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    assert backend.batch_get_v1(keys[:4], slots(8, 4)) == [True, True, False, True]


def _segment_holding(directory: str, page: bytes) -> tuple[str, int]:
    for path in glob.glob(os.path.join(directory, "*.seg")):
        with open(path, "rb") as f:
            at = f.read().find(page)
        if at >= 0:
            return path, at
    raise AssertionError("page not found in any segment")


def test_a_page_damaged_on_disk_reads_as_a_miss_and_is_dropped(make, tmp_path):
    pool, keys = HostPool(), page_keys(3)
    first = make(pool)
    assert first.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    first.close()
    path, at = _segment_holding(str(tmp_path / "kv"), pool.page_bytes(PAGE))
    with open(path, "rb") as f:
        buf, _, _ = damage(bytearray(f.read()), "flip", at + 100, 1, 7)
    with open(path, "wb") as f:
        f.write(buf)
    backend = make(pool)  # restart: nothing on host, the disk copy is the only one
    before = pool.page_bytes(9 * PAGE)
    assert backend.batch_get_v1(keys, slots(8, 3)) == [True, False, True]
    assert pool.page_bytes(9 * PAGE) == before  # the damaged page was not written into the pool
    assert pool.page_bytes(8 * PAGE) == pool.page_bytes(0) and pool.page_bytes(10 * PAGE) == pool.page_bytes(2 * PAGE)
    assert backend.tiers.storage.stats().read_corrupt == 1
    assert backend.batch_exists(keys) == 1 and backend.get(keys[1], pool.get_dummy_flat_data_page()) is None
    backend.close()
    assert make(pool).batch_exists(keys) == 1  # dropped for good: a restart does not bring it back


def test_a_missing_page_reads_as_a_miss(make, tmp_path):
    pool, keys = HostPool(), page_keys(2)
    writer = make(pool, host_bytes=0)
    assert writer.batch_set_v1(keys[:1], slots(0, 1)) == [True]
    assert writer.batch_get_v1(keys[1:], slots(8, 1)) == [False]  # never written
    assert writer.get(keys[1], pool.get_dummy_flat_data_page()) is None
    reader = make(pool)
    assert reader.batch_exists(keys) == 1
    for path in glob.glob(str(tmp_path / "kv" / "*.seg")):
        os.remove(path)  # vanished from under the reader (another process cleaned the directory)
    before = pool.page_bytes(8 * PAGE)
    assert reader.batch_get_v1(keys[:1], slots(8, 1)) == [False]
    assert pool.page_bytes(8 * PAGE) == before


def test_a_restarted_backend_finds_the_pages_and_only_in_its_namespace(make):
    pool, keys = HostPool(), page_keys(4)
    first = make(pool, cfg={"tp_rank": 1, "tp_size": 2})
    assert first.batch_set_v1(keys, slots(0, 4)) == [True] * 4
    first.close()
    again = make(pool, cfg={"tp_rank": 1, "tp_size": 2})
    assert again.batch_exists(keys) == 4
    assert again.batch_get_v1(keys, slots(8, 4)) == [True] * 4
    assert [pool.page_bytes((8 + i) * PAGE) for i in range(4)] == [pool.page_bytes(i * PAGE) for i in range(4)]
    assert make(pool, cfg={"tp_rank": 0, "tp_size": 2}).batch_exists(keys) == 0  # another TP shard
    assert make(pool, cfg={"tp_rank": 1, "tp_size": 2, "model": "other"}).batch_exists(keys) == 0
    assert make(pool, weights_version="1", cfg={"tp_rank": 1, "tp_size": 2}).batch_exists(keys) == 0
    other_layout = HostPool()
    other_layout.layout = "page_first"  # the same page bytes would be read in another order
    assert make(other_layout, cfg={"tp_rank": 1, "tp_size": 2}).batch_exists(keys) == 0


def test_mla_pages_are_shared_by_every_tp_rank(make):
    """Both ranks start together; rank 0 (SGLang's only MLA writer) writes, rank 1 finds its pages."""
    pool, keys = HostPool(), page_keys(2)
    rank0, rank1 = (make(pool, cfg={"mla": True, "tp_rank": r, "tp_size": 2}) for r in (0, 1))
    assert rank1.batch_exists(keys) == 0
    assert rank0.batch_set_v1(keys, slots(0, 2)) == [True] * 2
    assert rank1.batch_exists(keys) == 2 and rank1.batch_get_v1(keys, slots(8, 2)) == [True] * 2
    assert pool.page_bytes(9 * PAGE) == pool.page_bytes(PAGE)


def test_a_damaged_host_copy_is_never_served(make):
    pool, keys = HostPool(), page_keys(1)
    host_only = make(pool, storage_dir=None)
    both = make(pool)
    for backend in (host_only, both):
        assert backend.batch_set_v1(keys, slots(0, 1)) == [True]
        arena = backend.tiers.arena
        (block,) = [b for b in range(arena.num_blocks) if arena.key_of(b) is not None]
        arena.memory[block][100] ^= 0x5A
    before = pool.page_bytes(8 * PAGE)
    assert host_only.batch_get_v1(keys, slots(8, 1)) == [False] and pool.page_bytes(8 * PAGE) == before
    assert host_only.batch_exists(keys) == 0  # dropped
    assert both.batch_get_v1(keys, slots(8, 1)) == [True]  # served from disk instead
    assert pool.page_bytes(8 * PAGE) == pool.page_bytes(0)


def test_the_host_tier_evicts_its_coldest_pages(make):
    pool, keys = HostPool(), page_keys(6)
    page_nbytes = len(pool.page_bytes(0))
    backend = make(pool, host_bytes=str(4 * page_nbytes), storage_dir=None)  # room for 4 pages
    assert backend.batch_set_v1(keys[:4], slots(0, 4)) == [True] * 4
    assert backend.batch_get_v1(keys[:1], slots(8, 1)) == [True]  # keys[0] is now the most recently used
    assert backend.batch_set_v1(keys[4:], slots(4, 2)) == [True] * 2  # evicts keys[1] and keys[2]
    assert backend.batch_exists(keys) == 1 and backend.batch_exists(keys[3:]) == 3
    assert backend.batch_get_v1(keys[3:], slots(10, 3)) == [True] * 3
    assert [pool.page_bytes((10 + i) * PAGE) for i in range(3)] == [pool.page_bytes((3 + i) * PAGE) for i in range(3)]


def test_clear_forgets_every_page_for_good(make):
    pool, keys = HostPool(), page_keys(3)
    backend = make(pool)
    assert backend.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0
    backend.close()
    assert make(pool).batch_exists(keys) == 0


def test_a_hybrid_models_extra_host_pool_is_refused_at_registration(make):
    """SGLang's hybrid cache controller registers Mamba / sliding-window pools through
    ``register_mem_host_pool_v2`` and then calls the v2 methods this backend does not have: the
    registration must fail (SGLang's attach then fails loudly), not its prefetch thread later."""
    backend = make(HostPool())
    with pytest.raises(UsageError) as info:
        backend.register_mem_host_pool_v2(HostPool(), "mamba")
    assert info.value.argument == "host_pool_name" and not getattr(backend, "registered_pools", None)


def test_the_disk_tier_keeps_at_most_disk_bytes_deleting_the_least_recently_used(make):
    """Unbounded, the disk tier grew until the disk was full and every later write failed."""
    pool = HostPool()
    page = pool.get_dummy_flat_data_page().numel() * pool.get_dummy_flat_data_page().element_size()
    keys = page_keys(8)
    backend = make(pool, host_bytes=0, disk_bytes=4 * page)  # disk only: every read is the disk's
    assert backend.batch_set_v1(keys[:4], slots(0, 4)) == [True] * 4
    assert backend.batch_get_v1(keys[:1], slots(8, 1)) == [True]  # page 0 is now the most recent
    assert backend.batch_set_v1(keys[4:6], slots(4, 2)) == [True, True]  # room made: pages 1, 2 go
    stored = [backend.exists(k) for k in keys[:6]]
    assert stored == [True, False, False, True, True, True] and backend.tiers.storage.num_blocks == 4
    assert backend.batch_get_v1([keys[0], keys[5]], slots(9, 2)) == [True, True]
    assert [pool.page_bytes(9 * PAGE), pool.page_bytes(10 * PAGE)] == [pool.page_bytes(0), pool.page_bytes(5 * PAGE)]
    fresh = make(pool, host_bytes=0, disk_bytes=4 * page, storage_dir=str(backend.config.storage_dir) + "-2")
    assert fresh.batch_set_v1(keys[:6], slots(0, 6)) == [True] * 4 + [False] * 2  # more than the bound


def _held(obj, name: str, after: bool):
    """Make ``obj.name`` (a real StorageTier method) wait for the returned event before it runs
    (``after``: once it has run, before it returns): the interleaving the test needs, the real
    method doing the work."""
    import threading

    real, go, entered = getattr(obj, name), threading.Event(), threading.Event()

    def held(*args, **kwargs):
        if after:
            done = real(*args, **kwargs)
            done.result(30)  # the read has landed its pages
        entered.set()
        go.wait(30)
        return done if after else real(*args, **kwargs)

    setattr(obj, name, held)
    return go, entered


@pytest.mark.parametrize("call", ["put", "get"])
def test_a_clear_during_a_put_or_get_keeps_none_of_its_pages(make, call):
    """``clear()`` (what SGLang's /clear_hicache_storage_backend calls after a weight update) ran
    while a put was writing or a get was reading the disk: the put's pages outlived the clear
    on disk, and the get put the pages it read back on host; both are KV of the old weights."""
    import threading

    pool, keys = HostPool(), page_keys(2)
    if call == "get":  # on disk only, written by another backend: this one's get reads the disk
        assert make(pool, host_bytes=0).batch_set_v1(keys, slots(0, 2)) == [True, True]
    backend = make(pool)
    # put: its segment is written after the clear deleted every page; get: its disk read is
    # done before the clear, and it caches the pages on host after it
    go, entered = _held(backend.tiers.storage, "write" if call == "put" else "read", after=call == "get")
    run = (
        (lambda: backend.batch_set_v1(keys, slots(0, 2)))
        if call == "put"
        else (lambda: backend.batch_get_v1(keys, slots(8, 2)))
    )
    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(30)
    assert backend.clear() is True
    go.set()
    worker.join(30)
    assert backend.batch_exists(keys) == 0  # neither on disk nor on host
    backend.close()
    assert make(pool).batch_exists(keys) == 0  # nor after a restart


def test_loaded_through_sglangs_dynamic_backend_factory(tmp_path):
    """As HiCacheController.attach_storage_backend does it, then its generic page calls
    (``_generic_page_set`` / ``_generic_page_get``: the default for a dynamic backend)."""
    pool, keys = HostPool(), page_keys(3)
    extra = {**DYNAMIC, "storage_dir": str(tmp_path / "kv"), "host_bytes": "64KiB", "interface_v1": 0}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    try:
        backend.register_mem_pool_host(pool)
        assert type(backend) is TierSyncHiCacheStorage
        host_indices = slots(0, 3)
        pages = [pool.get_data_page(host_indices[i * PAGE]) for i in range(len(keys))]
        assert backend.batch_set(keys, pages) is True
        assert backend.batch_exists(keys) == 3
        got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        into = slots(8, 3)
        for i, page in enumerate(got):
            pool.set_from_flat_data_page(into[i * PAGE], page)
        assert [pool.page_bytes((8 + i) * PAGE) for i in range(3)] == [pool.page_bytes(i * PAGE) for i in range(3)]
    finally:
        backend.close()


@pytest.mark.parametrize(
    "extra, argument",
    [
        ({"host_byte": "1GiB"}, f"{EXTRA}.host_byte"),
        ({"host_bytes": "lots"}, f"{EXTRA}.host_bytes"),
        ({"host_bytes": 0}, f"{EXTRA}.storage_dir"),
        ({"eviction": "mru"}, f"{EXTRA}.eviction"),
        ({"fsync": "maybe"}, f"{EXTRA}.fsync"),
        ({"disk_bytes": "lots"}, f"{EXTRA}.disk_bytes"),
        ({"disk_bytes": 0}, f"{EXTRA}.disk_bytes"),
    ],
)
def test_bad_settings_are_refused_by_name(extra, argument):
    with pytest.raises(UsageError) as err:
        StorageBackendFactory.create_backend("dynamic", storage_config({**DYNAMIC, **extra}), None)
    assert err.value.argument == argument


def test_importing_tiersync_imports_no_sglang():
    code = (
        "import sys, tiersync, tiersync.integrations.sglang as s; s.HiCacheConfig(); "
        "bad = [m for m in ('sglang', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
