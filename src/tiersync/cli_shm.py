"""``tiersync shm list|reclaim``: the shared-memory segments of host arenas and weight sync.

``list`` prints each segment with its header (or why it is unusable, or, for a weight-sync
segment, whether its owner still runs); ``reclaim`` unlinks segments no live process holds.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_shm", "cmd_shm_list", "cmd_shm_reclaim"]


def add_shm(sub: Any) -> None:
    s = sub.add_parser("shm", help="inspect or reclaim shared-memory segments")
    ss = s.add_subparsers(dest="shm_command", metavar="ACTION", required=True)
    ls = ss.add_parser("list", help="list tiersync segments and their headers")
    ls.add_argument("--dir", default="/dev/shm", help="directory to scan (default /dev/shm)")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=cmd_shm_list)
    rc = ss.add_parser("reclaim", help="unlink segments no live process has attached")
    rc.add_argument("paths", nargs="+", metavar="PATH")
    rc.set_defaults(func=cmd_shm_reclaim)


def cmd_shm_list(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tiersync.tiers.shm import ShmSegment

    infos = [
        asdict(i) if hasattr(i, "__dataclass_fields__") else dict(vars(i)) for i in ShmSegment.list_segments(args.dir)
    ]
    for i in infos:
        p = i.get("problem")
        i["problem"] = None if p is None else getattr(p, "value", str(p))
        i.update(_weights_owner(i["path"]))
    if args.json:
        import json

        print(json.dumps(infos, default=str))
        return 0
    if not infos:
        print(f"no tiersync segments in {args.dir}")
    for i in infos:
        state = (
            (_weights_state(i) or f"UNUSABLE ({i['problem']})")
            if i["problem"]
            else (
                f"model={i.get('model_id')} blocks={i.get('num_blocks')} x {i.get('block_nbytes')} B "
                f"valid={i.get('valid_blocks')}"
            )
        )
        print(f"{i['path']}  {i['size']} B  {state}")
    return 0


def cmd_shm_reclaim(args: argparse.Namespace) -> int:
    """Reclaim every path; report each failure and exit 1 if any failed."""
    from tiersync.errors import TierSyncError, UsageError
    from tiersync.tiers.shm import ShmSegment

    failed = 0
    for path in args.paths:
        try:
            owner = _weights_owner(path)
            if owner.get("stale") is False:  # not flock-ed: its owner's pid decides
                raise UsageError(f"{path} belongs to running process {owner['owner_pid']}", argument="path")
            ShmSegment.reclaim(path)
            print(f"reclaimed {path}")
        except TierSyncError as exc:
            failed += 1
            print(f"tiersync shm reclaim: {exc}", file=sys.stderr)
    return 1 if failed else 0  # EXIT_ERROR


def _weights_owner(path: str) -> dict[str, Any]:
    """``owner_pid`` and ``stale`` (that process is gone) of a weight-sync segment, else {}."""
    from tiersync.tiers.shm import pid_alive
    from tiersync.weights.segment import segment_owner

    pid = segment_owner(path)
    if pid is None:
        return {}
    return {"owner_pid": pid, "stale": not pid_alive(pid)}


def _weights_state(info: dict[str, Any]) -> str | None:
    if "owner_pid" not in info:
        return None
    how = "exited: stale, reclaim it" if info["stale"] else "running"
    return f"weight-sync segment of pid {info['owner_pid']} ({how})"
