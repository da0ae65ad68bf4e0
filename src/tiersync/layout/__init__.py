"""Layer 1: describe KV pools and weights, and view numpy/torch/JAX tensors in place."""

from tiersync.layout.adapters import as_pool, kv_layout
from tiersync.layout.pool import Device, DevicePool, KVLayout, PoolSpec, Region

__all__ = ["Device", "DevicePool", "KVLayout", "PoolSpec", "Region", "as_pool", "kv_layout"]
