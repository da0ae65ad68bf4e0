"""Bounded hand encoding of frame metadata (and registry messages).

Little-endian fixed-width integers, length-prefixed UTF-8 strings and byte
strings, and count-prefixed arrays of 16-byte keys or u64 sizes. Every count is
checked against a bound *before* anything is sliced or allocated, and a reader
must be consumed exactly (:meth:`MetaReader.finish`). Any violation raises
:class:`~tiersync.net.errors.ProtocolError` with fault MALFORMED.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

from tiersync.net.errors import ProtocolError, ProtocolFault

KEY_SIZE = 16
_U8, _U16, _U32, _U64, _F64 = (struct.Struct(f"<{c}") for c in "BHIQd")


def _malformed(message: str, **context: Any) -> ProtocolError:
    return ProtocolError(message, fault=ProtocolFault.MALFORMED, **context)


class MetaWriter:
    """Append-only encoder; :meth:`getvalue` returns the bytes."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, v: int) -> MetaWriter:
        self._parts.append(_U8.pack(v))
        return self

    def u16(self, v: int) -> MetaWriter:
        self._parts.append(_U16.pack(v))
        return self

    def u32(self, v: int) -> MetaWriter:
        self._parts.append(_U32.pack(v))
        return self

    def u64(self, v: int) -> MetaWriter:
        self._parts.append(_U64.pack(v))
        return self

    def f64(self, v: float) -> MetaWriter:
        self._parts.append(_F64.pack(v))
        return self

    def blob(self, v: bytes) -> MetaWriter:
        """u32 length + bytes."""
        self._parts.append(_U32.pack(len(v)))
        self._parts.append(bytes(v))
        return self

    def text(self, v: str) -> MetaWriter:
        return self.blob(v.encode("utf-8"))

    def json(self, v: object) -> MetaWriter:
        """A JSON document (compact UTF-8) as a blob; :meth:`MetaReader.json` reads it back."""
        return self.blob(json.dumps(v, separators=(",", ":")).encode())

    def keys(self, keys: Sequence[bytes]) -> MetaWriter:
        """u32 count + count * 16 bytes."""
        self._parts.append(_U32.pack(len(keys)))
        self._parts.extend(bytes(k) for k in keys)
        return self

    def raw(self, v: bytes) -> MetaWriter:
        """Bytes as they are (a fixed layout the reader knows the size of)."""
        self._parts.append(v)
        return self

    def u64s(self, values: tuple[int, ...] | list[int]) -> MetaWriter:
        self._parts.append(_U32.pack(len(values)))
        self._parts.append(struct.pack(f"<{len(values)}Q", *values))
        return self

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class MetaReader:
    """Bounds-checked decoder over ``data``. Every method raises ProtocolError(MALFORMED)."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._data):
            raise _malformed("metadata truncated", need=n, have=len(self._data) - self._pos)
        view = self._data[self._pos : end]
        self._pos = end
        return view

    def take(self, n: int) -> memoryview:
        """The next ``n`` raw bytes (MALFORMED when fewer are left)."""
        return self._take(n)

    def u8(self) -> int:
        v: int = _U8.unpack(self._take(1))[0]
        return v

    def u16(self) -> int:
        v: int = _U16.unpack(self._take(2))[0]
        return v

    def u32(self) -> int:
        v: int = _U32.unpack(self._take(4))[0]
        return v

    def u64(self) -> int:
        v: int = _U64.unpack(self._take(8))[0]
        return v

    def f64(self) -> float:
        v: float = _F64.unpack(self._take(8))[0]
        return v

    def blob(self, max_len: int) -> bytes:
        n = self.u32()
        if n > max_len:
            raise _malformed("byte string too long", length=n, max=max_len)
        return bytes(self._take(n))

    def text(self, max_len: int) -> str:
        raw = self.blob(max_len)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _malformed("string is not UTF-8") from exc

    def json(self, max_len: int) -> dict[str, Any]:
        """A JSON object written by :meth:`MetaWriter.json` (at most ``max_len`` bytes); anything
        else (bad UTF-8, bad JSON, not an object) is MALFORMED."""
        raw = self.blob(max_len)
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError included; nesting past the limit
            raise _malformed("metadata is not JSON") from exc
        if not isinstance(value, dict):
            raise _malformed("metadata is not a JSON object")
        return value

    def keys(self, max_count: int) -> tuple[bytes, ...]:
        n = self.u32()
        if n > max_count:
            raise _malformed("too many keys", count=n, max=max_count)
        raw = bytes(self._take(n * KEY_SIZE))
        return tuple(raw[i : i + KEY_SIZE] for i in range(0, len(raw), KEY_SIZE))

    def u64s(self, max_count: int) -> tuple[int, ...]:
        n = self.u32()
        if n > max_count:
            raise _malformed("too many values", count=n, max=max_count)
        return struct.unpack(f"<{n}Q", self._take(8 * n))

    def peek_exact(self, fmt: struct.Struct) -> tuple[Any, ...] | None:
        """``fmt`` unpacked from the rest of the data when exactly ``fmt.size`` bytes are left
        (nothing consumed: :meth:`skip` them once the values are accepted); else None."""
        if len(self._data) - self._pos != fmt.size:
            return None
        return fmt.unpack_from(self._data, self._pos)

    def skip(self, n: int) -> None:
        self._take(n)

    def finish(self) -> None:
        """Raise ProtocolError(MALFORMED) when bytes are left over."""
        if self._pos != len(self._data):
            raise _malformed("trailing metadata bytes", extra=len(self._data) - self._pos)
