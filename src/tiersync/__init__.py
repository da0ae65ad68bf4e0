"""tiersync: move LLM KV caches and weights between device, host, storage and peers.

Importing this package is cheap: it imports numpy-free modules only, configures no
logging and never imports torch or JAX. Import the layer you need, for example
``from tiersync.transfer import TransferEngine``.
"""

from tiersync.errors import (
    CapacityError,
    ClosedError,
    IntegrityError,
    RemoteError,
    TierSyncError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "ClosedError",
    "IntegrityError",
    "RemoteError",
    "TierSyncError",
    "UsageError",
    "__version__",
]
