"""Decode side: pull a request's KV from the prefill ranks into local landing blocks, per layer.

One :class:`KVConsumer` per decode rank. Typical use from an engine connector::

    consumer = KVConsumer(layout, rank=tp_rank, config=DisaggConfig(token=secret))
    source = SourceSpec.from_dict(kv_transfer_params["tiersync"])   # what prefill published
    handle = consumer.start_read(req_id, source, local_block_ids, host_layers)
    for l in range(num_layers):          # layer-wise load
        handle.wait_layer(l, timeout)    # True: host_layers[l] holds the layer -> copy H2D
    ...  # every engine step:
    status = consumer.poll()             # done_receiving / failed_receiving

The consumer plans (:mod:`tiersync.disagg.reshard`) which prefill ranks feed this rank, takes
a pooled connection to each such rank (:class:`~tiersync.net.pool.ChannelPool`: token,
TLS, one handshake per connection, not per request), opens the request (KV_OPEN), asks for
each layer as it becomes ready (KV_NEXT), pulls its route bytes with several pulls in flight
(KV_PULL, each answer scattered in place into the destination blocks of ``host_layers``)
or, when the producer is on this host, copies them out of its memory straight into those
blocks (KV_PULL_LOCAL + ``process_vm_readv``, verified), and says it is done (KV_DONE, which
must be COMMITTED). A layer *arrives* when every feeding rank delivered it and it was
verified. Decode rank 0 also notifies prefill ranks nobody reads from (unused replicas) so
they can finish. A request is FAILED when ``config.timeout_s`` passes, a producer refuses,
disconnects or dies, or a frame is bad; a FAILED read may have written part of its
destination blocks (never reported as arrived), and :meth:`KVConsumer.poll` reports it only
once no thread can write them any more. A read that fails (or is abandoned:
:meth:`KVConsumer.close`) tells the prefill ranks it reads or notifies that neither counted
nor refused it to drop the request (KV_DROP, sent off-thread by a
:class:`~tiersync.disagg.dropper.KVDropper`): a rank it never reached (the first one refused,
or died, while it connected to the others) would otherwise hold the request's blocks until
its ``timeout_s``. A rank that refused it keeps the request as it was, for another reader.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tiersync.disagg.blocksums import region_unit
from tiersync.disagg.config import DisaggConfig, FinishedRequests, RequestState, check_side
from tiersync.disagg.dropper import KVDropper
from tiersync.disagg.geometry import PagedKVLayout
from tiersync.disagg.link import pull_route
from tiersync.disagg.messages import ReadRequest, check_request_id
from tiersync.disagg.ops import KV
from tiersync.disagg.read_handle import LayerCallback, ReadHandle
from tiersync.disagg.reshard import ReshardPlanner, block_table, default_planner
from tiersync.disagg.spanio import byte_view
from tiersync.errors import ClosedError, RemoteError, TierSyncError, UsageError, check_positive_int
from tiersync.net.config import parse_address
from tiersync.net.errors import NetTimeoutError, PeerClosedError, RequestError, log_level
from tiersync.net.pool import ChannelPool
from tiersync.net.tcp import TcpChannel, TcpTransport

log = logging.getLogger(__name__)

__all__ = ["KVConsumer", "ReadHandle", "SourceSpec"]


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """Where a request's KV is: the prefill group's ``layout``, ``addresses[r]`` of prefill rank
    ``r``'s producer ("host:port"), the request's prefill ``block_ids`` and ``num_tokens``.
    JSON-able via :meth:`to_dict` / :meth:`from_dict` (for kv_transfer_params)."""

    layout: PagedKVLayout
    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.layout, PagedKVLayout):
            raise UsageError("must be a PagedKVLayout", argument="source.layout")
        addresses = tuple(self.addresses) if isinstance(self.addresses, (list, tuple)) else ()
        if len(addresses) != self.layout.tp_size:
            raise UsageError(
                "needs one address per prefill rank", argument="source.addresses", tp_size=self.layout.tp_size
            )
        for i, a in enumerate(addresses):
            parse_address(a, f"source.addresses[{i}]")
        check_positive_int(self.num_tokens, "source.num_tokens")
        object.__setattr__(self, "addresses", addresses)
        object.__setattr__(self, "block_ids", _block_ids(self.block_ids))

    def to_dict(self) -> dict[str, object]:
        return {
            "layout": self.layout.to_dict(),
            "addresses": list(self.addresses),
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
        }

    @classmethod
    def from_dict(cls, data: Any) -> SourceSpec:
        """Inverse of :meth:`to_dict`; any JSON value (a client's kv_transfer_params) raises
        UsageError naming ``source`` or the field, nothing else."""
        if not isinstance(data, dict) or set(data) != {"layout", "addresses", "block_ids", "num_tokens"}:
            raise UsageError("malformed source description", argument="source")
        return cls(
            PagedKVLayout.from_dict(data["layout"], argument="source.layout"),
            data["addresses"],
            data["block_ids"],
            data["num_tokens"],
        )


def _block_ids(values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of block ids (ints >= 0, numpy ints too); UsageError otherwise."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        values = values.tolist()
    if not isinstance(values, (list, tuple, range)) or not all(
        isinstance(b, numbers.Integral) and not isinstance(b, bool) and int(b) >= 0 for b in values
    ):
        raise UsageError("must be a list of block ids (ints >= 0)", argument="source.block_ids")
    return tuple(int(b) for b in values)


class KVConsumer:
    """Pulls requests into this decode rank (``rank`` of ``layout``'s TP group). Thread-safe."""

    def __init__(
        self,
        layout: PagedKVLayout,
        rank: int,
        config: DisaggConfig | None = None,
        *,
        planner: ReshardPlanner | None = None,
    ) -> None:
        self.config = check_side(layout, rank, config)
        self.layout, self.rank = layout, rank
        self._planner = planner or default_planner()
        self._lock = threading.Lock()
        self._reads: dict[str, ReadHandle] = {}
        self._unreported: list[tuple[str, RequestState]] = []
        self._progress = threading.Event()  # set when a read became final since the last poll
        self._closed = False
        self._pool = ChannelPool(TcpTransport(self.config.tcp_config(server=False), KV))
        self._dropper: KVDropper | None = None  # made at the first failed read with ranks to tell
        self._dropper_closed = False

    def start_read(
        self,
        request_id: str,
        source: SourceSpec,
        dst_block_ids: Sequence[int],
        landing: Sequence[Any],
        on_layer: LayerCallback | None = None,
    ) -> ReadHandle:
        """Start pulling ``request_id`` from ``source`` into ``landing[l]`` (layer ``l``'s host
        buffer in this rank's layout, writable, exactly ``layout.layer_nbytes``) at
        ``dst_block_ids``. Returns at once. ``on_layer(request_id, layer)`` runs on an I/O thread
        after each arrival (keep it short; an exception fails the read). Landing buffers are
        written until the request is reported by :meth:`poll`; requests may share the buffers
        (a host pool per layer) with distinct block ids. All-or-nothing; raises
        UsageError naming ``request_id`` (bad or already reading), ``source``, ``landing[i]``,
        ``src_block_ids``/``dst_block_ids``/``dst.<field>`` (from the planner)."""
        check_request_id(request_id)
        if not isinstance(source, SourceSpec):
            raise UsageError("must be a SourceSpec", argument="source")
        if isinstance(landing, (str, bytes)) or len(landing) != self.layout.num_layers:
            raise UsageError("needs one host buffer per layer", argument="landing", expected=self.layout.num_layers)
        n = self.layout.layer_nbytes
        views = [byte_view(b, n, writable=True, argument=f"landing[{i}]") for i, b in enumerate(landing)]
        plan = self._planner.plan(source.layout, self.layout, source.block_ids, dst_block_ids, source.num_tokens)
        sources = plan.sources_of(self.rank)
        dst_ids = tuple(block_table(dst_block_ids, self.layout, source.num_tokens, "dst_block_ids").tolist())
        notify = plan.idle_sources() if self.rank == 0 else ()
        ranks, addresses = sources + notify, source.addresses
        handle = ReadHandle(
            request_id,
            plan,
            sources,
            views,
            time.monotonic() + self.config.timeout_s,
            on_layer,
            self._progress,
            on_fail=lambda h: self._tell_unread(h, ranks, addresses),
        )
        with self._lock:
            if self._closed:
                raise ClosedError("consumer is closed", argument="self")
            if request_id in self._reads:
                raise UsageError("already being read", argument="request_id", value=request_id)
            self._reads[request_id] = handle
        for src_rank in ranks:
            handle._start()
            read = ReadRequest(
                request_id,
                src_rank,
                self.rank,
                self.layout,
                dst_ids,
                source.block_ids,
                source.num_tokens,
                source.layout,
                notify_only=src_rank in notify,
            )
            if not self._spawn(handle, source.addresses[src_rank], read):
                break
        return handle

    def _spawn(self, handle: ReadHandle, address: str, read: ReadRequest) -> bool:
        """Start the thread that pulls ``read``; without one to be had the read fails (poll
        reports it) and False is returned."""
        try:
            name = "tiersync-kv-recv"
            threading.Thread(target=self._pull, args=(handle, address, read), daemon=True, name=name).start()
        except RuntimeError as exc:
            handle._fail(RemoteError(f"cannot start a reader thread: {exc}", peer=address))
            handle._stop()
            return False
        return True

    def poll(self) -> FinishedRequests:
        """Fail overdue reads, then report (once) every read that became DONE or FAILED."""
        now = time.monotonic()
        with self._lock:
            reads = list(self._reads.values())
        for h in reads:
            if h.state is RequestState.PENDING and now >= h.deadline:
                h._fail(NetTimeoutError("read timed out", request=h.request_id, timeout_s=self.config.timeout_s))
        with self._lock:
            self._progress.clear()
            for h in list(self._reads.values()):
                if h.state is not RequestState.PENDING and h._quiet():
                    self._unreported.append((h.request_id, h.state))
                    del self._reads[h.request_id]
            items, self._unreported = self._unreported, []
        done = frozenset(i for i, s in items if s is RequestState.DONE)
        return FinishedRequests(done_receiving=done, failed_receiving=frozenset(i for i, _ in items) - done)

    def wait_progress(self, timeout: float) -> bool:
        """Block (GIL released) until a read became final that :meth:`poll` has not yet
        reported (True at once if one already did), or ``timeout`` seconds pass (False).
        Deadlines are only enforced by :meth:`poll`; call it after waiting."""
        return self._progress.wait(timeout)

    def get(self, request_id: str) -> ReadHandle | None:
        """The handle of a read not yet reported by :meth:`poll`, else None."""
        with self._lock:
            return self._reads.get(request_id)

    def close(self) -> None:
        """Fail every pending read and refuse new ones; the drops of failed reads (theirs too)
        are given ``config.connect_timeout_s`` in all to go out. Idempotent."""
        with self._lock:
            self._closed = True
            reads = list(self._reads.values())
        for h in reads:
            h._fail(PeerClosedError("consumer closed", request=h.request_id))
        for h in reads:  # their channels are closed: the threads end at once
            h._quiet(timeout=5.0)
        self._pool.close()
        with self._lock:
            dropper, self._dropper, self._dropper_closed = self._dropper, None, True
        if dropper is not None:  # the drops of the reads just failed go out first, for a while
            end = time.monotonic() + self.config.connect_timeout_s
            dropper.flush(self.config.connect_timeout_s)
            dropper.close(timeout=max(0.0, end - time.monotonic()))

    def _tell_unread(self, handle: ReadHandle, ranks: tuple[int, ...], addresses: tuple[str, ...]) -> None:
        """``handle`` failed: tell the prefill ranks of ``ranks`` that neither counted nor
        refused it to drop the request now. A rank the read joined also fails it as the read's
        connection closes, and refuses the drop, as does one that no longer knows the request:
        both harmless. A rank no other decode rank joined yet frees it for them too: their reads
        are of no use any more, since the engine recomputes a request whose load failed on any
        rank."""
        unsettled = handle._unsettled(ranks)
        dropper = self._drop_sender() if unsettled else None
        if dropper is None:
            return
        try:
            dropper.drop(handle.request_id, tuple(addresses[r] for r in unsettled))
        except UsageError as exc:  # an id the wire cannot carry: their timeout frees it
            log.warning("cannot tell the prefill ranks to drop %s: %s", handle.request_id, exc)

    def _drop_sender(self) -> KVDropper | None:
        """The dropper (started at first need: most consumers never fail a read); None once
        closed, or when it cannot be started (the prefill ranks' timeout frees the request)."""
        with self._lock:
            if self._dropper is None and not self._dropper_closed:
                try:
                    self._dropper = KVDropper(self.config)
                except Exception as exc:  # noqa: BLE001 - no thread, a TLS file gone: drops are an optimisation
                    log.warning("cannot start sending KV drops: %s", exc)
            return self._dropper

    def __enter__(self) -> KVConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one pooled connection per feeding prefill rank and read -----------------------------
    def _pull(self, handle: ReadHandle, address: str, read: ReadRequest) -> None:
        try:
            with self._pool.acquire(address) as pooled:
                channel = cast(TcpChannel, pooled)  # the pool connects with a TcpTransport
                if not handle._attach(channel):
                    return
                spans = handle.plan.route_spans(read.src_rank, self.rank)
                try:
                    pull_route(
                        channel,
                        read,
                        spans,
                        handle.plan.num_layers,
                        handle.deadline,
                        self.config,
                        handle._buffer,
                        handle._landed,
                        src_unit=region_unit(handle.plan.src),
                    )
                    handle._counted(read.src_rank, notify_only=read.notify_only)
                finally:
                    if not handle._detach(channel):  # the read failed meanwhile and closes it: so do we,
                        channel.close()  # before the pool takes it back
        except (TierSyncError, OSError) as exc:
            log.log(log_level(exc), "read of %s from %s failed: %s", handle.request_id, address, exc)
            if isinstance(exc, RequestError):  # an ERROR answer: that rank needs no drop
                handle._refused(read.src_rank)
            if not read.notify_only:
                err = exc if isinstance(exc, TierSyncError) else RemoteError(str(exc), peer=address)
                handle._fail(err)
        except Exception as exc:  # noqa: BLE001 - e.g. the on_layer callback raised
            handle._fail(RemoteError(f"layer callback failed: {exc!r}", peer=address))
        finally:
            handle._stop()
