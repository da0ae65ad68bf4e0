"""Layer 3: tiers that hold blocks — the host arena (optionally in /dev/shm)."""
