"""Layer 2: async block copies between device pools and the host arena."""
from tiersync.transfer.engine import TransferConfig, TransferEngine
from tiersync.transfer.future import Direction, TransferFuture, TransferStatus
from tiersync.transfer.kernel import KERNEL

__all__ = ["KERNEL", "Direction", "TransferConfig", "TransferEngine", "TransferFuture", "TransferStatus"]
