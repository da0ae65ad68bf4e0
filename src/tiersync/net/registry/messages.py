"""Hand-encoded bytes messages of the registry gRPC service (no protoc step).

Built on :mod:`tiersync.net.codec`: bounded, and a malformed message raises
:class:`~tiersync.net.errors.ProtocolError` (MALFORMED).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiersync.net.codec import MetaReader, MetaWriter
from tiersync.net.errors import ProtocolError, ProtocolFault
from tiersync.net.registry.base import StoreInfo

MAX_KEYS = 65536
MAX_TEXT = 512
MAX_ITEMS = 65536


def _count(r: MetaReader, bound: int) -> int:
    n = r.u32()
    if n > bound:
        raise ProtocolError("too many items", fault=ProtocolFault.MALFORMED, count=n, max=bound)
    return n


def _texts(w: MetaWriter, items: Sequence[str]) -> None:
    w.u32(len(items))
    for item in items:
        w.text(item)


def _read_texts(r: MetaReader) -> tuple[str, ...]:
    n = _count(r, MAX_ITEMS)
    return tuple(r.text(MAX_TEXT) for _ in range(n))


def enc_keys(keys: Sequence[bytes]) -> bytes:
    return MetaWriter().keys(keys).getvalue()


def dec_keys(data: bytes) -> tuple[bytes, ...]:
    r = MetaReader(data)
    keys = r.keys(MAX_KEYS)
    r.finish()
    return keys


def enc_owners(owners: list[tuple[str, ...]]) -> bytes:
    w = MetaWriter().u32(len(owners))
    for row in owners:
        _texts(w, row)
    return w.getvalue()


def dec_owners(data: bytes) -> list[tuple[str, ...]]:
    r = MetaReader(data)
    n = _count(r, MAX_KEYS)
    out = [_read_texts(r) for _ in range(n)]
    r.finish()
    return out


def enc_store_keys(store_id: str, keys: Sequence[bytes]) -> bytes:
    return MetaWriter().text(store_id).keys(keys).getvalue()


def dec_store_keys(data: bytes) -> tuple[str, tuple[bytes, ...]]:
    r = MetaReader(data)
    out = (r.text(MAX_TEXT), r.keys(MAX_KEYS))
    r.finish()
    return out


def _write_info(w: MetaWriter, info: StoreInfo) -> None:
    w.text(info.store_id).text(info.address).u64(info.free_blocks).text(info.pool_group).u64(info.capacity_blocks)
    w.u64(info.incarnation)


def _read_info(r: MetaReader) -> StoreInfo:
    return StoreInfo(r.text(MAX_TEXT), r.text(MAX_TEXT), r.u64(), r.text(MAX_TEXT), r.u64(), r.u64())


def enc_infos(infos: Sequence[StoreInfo]) -> bytes:
    w = MetaWriter().u32(len(infos))
    for info in infos:
        _write_info(w, info)
    return w.getvalue()


def dec_infos(data: bytes) -> list[StoreInfo]:
    r = MetaReader(data)
    n = _count(r, MAX_ITEMS)
    out = [_read_info(r) for _ in range(n)]
    r.finish()
    return out


def enc_heartbeat(store_id: str, free_blocks: int) -> bytes:
    return MetaWriter().text(store_id).u64(free_blocks).getvalue()


def dec_heartbeat(data: bytes) -> tuple[str, int]:
    r = MetaReader(data)
    out = (r.text(MAX_TEXT), r.u64())
    r.finish()
    return out


def enc_targets(pool_group: str, count: int, exclude: Sequence[str]) -> bytes:
    w = MetaWriter().text(pool_group).u32(count)
    _texts(w, exclude)
    return w.getvalue()


def dec_targets(data: bytes) -> tuple[str, int, tuple[str, ...]]:
    r = MetaReader(data)
    out = (r.text(MAX_TEXT), r.u32(), _read_texts(r))
    r.finish()
    return out


def enc_text(value: str) -> bytes:
    return MetaWriter().text(value).getvalue()


def dec_text(data: bytes) -> str:
    r = MetaReader(data)
    out = r.text(MAX_TEXT)
    r.finish()
    return out
