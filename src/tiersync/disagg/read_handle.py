"""One request a decode rank is receiving: :class:`ReadHandle`, its state and its layers.

The engine side waits on it (:meth:`ReadHandle.wait_layer`, :meth:`ReadHandle.wait`); the
:class:`~tiersync.disagg.consumer.KVConsumer`'s pulling threads, one per feeding prefill
rank, drive it through its underscore methods: register while they may write the landing
buffers (``_start``/``_stop``), attach their connection (closed when the read fails), take
a layer's landing buffer (``_buffer``, refused once the read is final), report each
verified part of a layer (``_landed``: the layer *arrives* once every source delivered
it) and each prefill rank's KV_DONE (``_counted``: DONE once every layer arrived and every
source counted the read), note a rank's refusal (``_refused``), or fail it (``_fail``, which
hands the handle to ``on_fail``: the consumer tells the prefill ranks that neither counted nor
refused the read, ``_unsettled``, to free the request).
``_quiet`` says when no pulling thread can write its buffers any more (only then does the
consumer report it final).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from tiersync.completion import Completion
from tiersync.disagg.config import RequestState
from tiersync.disagg.reshard import ReshardPlan
from tiersync.errors import UsageError
from tiersync.net.errors import PeerClosedError
from tiersync.net.tcp import TcpChannel

__all__ = ["LayerCallback", "ReadHandle"]

LayerCallback = Callable[[str, int], None]
FailCallback = Callable[["ReadHandle"], None]


class ReadHandle(Completion[None]):
    """One request being received (a :class:`~tiersync.completion.Completion`): ``state``,
    ``error`` (why it FAILED), ``arrived_layers``.

    :meth:`wait_layer` blocks until a layer landed in its host buffer (True), the timeout
    passed (False) or the read failed (raises the RemoteError behind it).
    """

    def __init__(
        self,
        request_id: str,
        plan: ReshardPlan,
        sources: tuple[int, ...],
        views: list[np.ndarray],
        deadline: float,
        on_layer: LayerCallback | None,
        progress: threading.Event | None = None,
        on_fail: FailCallback | None = None,
    ) -> None:
        super().__init__()
        self.request_id, self.plan, self.sources = request_id, plan, sources
        self._progress = progress  # set once this read becomes final
        self._on_fail = on_fail  # runs once, when the read failed (after its connections closed)
        self._settled_at: set[int] = set()  # prefill ranks that counted or refused this read
        self.deadline = deadline
        self._views, self._on_layer = views, on_layer
        self._counts = [0] * plan.num_layers
        self._commits = 0
        self._arrived: list[int] = []
        self._channels: set[TcpChannel] = set()
        self._pulling = 0  # threads that may still write the landing buffers

    what = "prefill -> decode read"

    @property
    def state(self) -> RequestState:
        """PENDING while receiving, then DONE or FAILED."""
        return self.status

    @property
    def error(self) -> BaseException | None:
        """Why the read FAILED (None otherwise)."""
        return self._error

    @property
    def arrived_layers(self) -> tuple[int, ...]:
        """Layers landed so far, in arrival order."""
        with self._cond:
            return tuple(self._arrived)

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait for ``layer``; raises the failure when the read FAILED. ``timeout=None`` waits
        until the request's deadline."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.plan.num_layers:
            raise UsageError("must be in [0, num_layers)", argument="layer", value=layer)
        end = self.deadline if timeout is None else time.monotonic() + timeout
        with self._cond:
            while layer not in self._arrived and self.state is RequestState.PENDING:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if layer in self._arrived:
                return True
            raise cast(BaseException, self._error)  # FAILED (DONE needs every layer): set by _fail

    def wait(self, timeout: float | None = None) -> RequestState:
        """Wait until DONE or FAILED (or the timeout); returns the state."""
        end = self.deadline if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.state is RequestState.PENDING and end > time.monotonic():
                self._cond.wait(end - time.monotonic())
            return self.state

    # -- used by the consumer's threads --------------------------------------------------------
    def _start(self) -> None:
        with self._cond:
            self._pulling += 1

    def _stop(self) -> None:
        with self._cond:
            self._pulling -= 1
            self._cond.notify_all()
        if self._progress is not None and self.state is not RequestState.PENDING:
            self._progress.set()

    def _attach(self, channel: TcpChannel) -> bool:
        with self._cond:
            if self.state is not RequestState.PENDING:
                return False
            self._channels.add(channel)
            return True

    def _detach(self, channel: TcpChannel) -> bool:
        """Give ``channel`` back from the read; False when the read failed meanwhile and took it
        to close (it must then not go back to a pool, where another read would get it)."""
        with self._cond:
            owned = channel in self._channels
            self._channels.discard(channel)
            return owned

    def _buffer(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s landing buffer, for a pulling thread (refused once the read is final)."""
        with self._cond:
            if self.state is not RequestState.PENDING:
                raise PeerClosedError("read already final", request=self.request_id)
            return self._views[layer]

    def _landed(self, layer: int) -> None:
        """One source's part of a layer landed and was verified; the layer has arrived once
        every source delivered it."""
        with self._cond:
            if self.state is not RequestState.PENDING:
                raise PeerClosedError("read already final", request=self.request_id)
            self._counts[layer] += 1
            if self._counts[layer] < len(self.sources):
                return
            self._arrived.append(layer)
            self._cond.notify_all()
        if self._on_layer is not None:
            self._on_layer(self.request_id, layer)

    def _quiet(self, timeout: float = 0.0) -> bool:
        """No pulling thread of this read is still running (none can write its buffers);
        waits up to ``timeout`` seconds for that."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pulling == 0, timeout)

    def _counted(self, src_rank: int, *, notify_only: bool = False) -> None:
        """Prefill rank ``src_rank`` counted this reader (KV_DONE COMMITTED: it kept its buffers
        until every byte was sent; a ``notify_only`` rank sent none). DONE once every layer
        arrived and every source counted the read."""
        with self._cond:
            self._settled_at.add(src_rank)
            if notify_only:
                return
            self._commits += 1
            if self.state is not RequestState.PENDING or self._commits < len(self.sources):
                return
            if len(self._arrived) != self.plan.num_layers or not self._settle(None):
                return
        if self._progress is not None:
            self._progress.set()

    def _refused(self, src_rank: int) -> None:
        """Prefill rank ``src_rank`` answered one of this read's requests with an ERROR: it
        needs no drop (a refused KV_OPEN leaves the request there as it was, for another
        reader; one already final there is freed; a read it joined fails there as its
        connection closes)."""
        with self._cond:
            self._settled_at.add(src_rank)

    def _unsettled(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Those of ``ranks`` that neither counted nor refused this read (not reached, cut
        off, or not answering)."""
        with self._cond:
            return tuple(r for r in ranks if r not in self._settled_at)

    def _fail(self, error: BaseException) -> bool:
        """FAILED (once): close every connection of the request (a prefill rank the read joined
        fails it when its connection ends), then run ``on_fail``. True when this call failed it."""
        with self._cond:  # re-entrant: the state and the channels change together
            if not super()._fail(error):
                return False
            channels, self._channels = list(self._channels), set()
        for channel in channels:
            channel.close()
        if self._on_fail is not None:
            self._on_fail(self)
        if self._progress is not None:
            self._progress.set()
        return True
