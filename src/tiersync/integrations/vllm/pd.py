"""Build the prefill -> decode half of the connector from vLLM's configs."""

from __future__ import annotations

from typing import Any

from tiersync.disagg.config import DisaggConfig
from tiersync.disagg.dropper import KVDropper
from tiersync.disagg.geometry import KVOrder, PagedKVLayout
from tiersync.errors import UsageError
from tiersync.integrations.vllm.config import ConnectorConfig
from tiersync.integrations.vllm.pd_scheduler import PDScheduler
from tiersync.integrations.vllm.pd_worker import PDWorker

__all__ = ["build_pd", "paged_layout"]


def paged_layout(vllm_config: Any, kv_cache_config: Any) -> PagedKVLayout:
    """This engine's per-layer KV geometry (vLLM's CPU backend: head-major blocks)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise UsageError(
            "prefill->decode supports vLLM's CPU backend in this build",
            argument="device",
            platform=str(current_platform.device_name),
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UsageError("one KV cache group (full attention) is supported", argument="kv_cache_config")
    spec = groups[0].kv_cache_spec
    return PagedKVLayout(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
        head_dim=spec.head_size,
        block_size=spec.block_size,
        num_blocks=kv_cache_config.num_blocks,
        dtype=str(spec.dtype),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        order=KVOrder.HEAD_MAJOR,
    )


def build_pd(
    vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, *, producer: bool, scheduler: bool
) -> PDScheduler | PDWorker:
    """The scheduler or worker half of ``kv_producer`` / ``kv_consumer``. The producer's
    rank ``r`` serves on ``pd_port + r`` (``pd_port`` must be set: the scheduler advertises it)."""
    layout = paged_layout(vllm_config, kv_cache_config)
    if producer and cfg.pd_port == 0:
        raise UsageError("a producer needs a fixed port", argument="kv_connector_extra_config.pd_port")
    addresses = tuple(f"{cfg.pd_host}:{cfg.pd_port + r}" for r in range(layout.tp_size))
    dcfg = DisaggConfig(timeout_s=cfg.load_timeout_s, token=cfg.pd_token, route=cfg.pd_route)
    if scheduler:  # a decode scheduler tells prefill ranks what it will not read
        return PDScheduler(
            producer=producer, layout=layout, addresses=addresses, dropper=None if producer else KVDropper(dcfg)
        )
    rank = vllm_config.parallel_config.rank
    return PDWorker(
        producer=producer,
        layout=layout,
        rank=rank,
        config=dcfg,
        host=cfg.pd_host,
        port=cfg.pd_port + rank if producer else 0,
        huge_pages=cfg.huge_pages,
        share_kv=cfg.share_kv,
    )
