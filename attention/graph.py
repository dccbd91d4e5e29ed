"""Launches captured once as a CUDA graph through cuda.core, then replayed.

A numba launch accepts a cuda.core ``GraphBuilder`` where the stream goes, so
any function that enqueues numba launches on a given stream can be captured:
``CapturedLaunches(enqueue, warm)`` runs ``warm()`` first (outside the capture:
it compiles and loads every kernel), then captures ``enqueue(builder)``.
``launch()`` replays the graph with one driver call, on a stream created
blocking: like every launch on numba's default (legacy) stream, a replay
starts after the work queued there before it (new lengths or queries written
with ``copy_to_device``), and work queued there after it starts once the
replay has finished (the capture itself runs on a non-blocking stream of its
own, which capture requires). Where no graph can be
built (the simulator, no GPU, a capture error) ``graph`` is None and
``error`` says why; the owner then launches plainly.

Used by ``attention.decode_graph.DecodeStep`` and ``mla.decode_graph.MLADecodeGraph``.
"""

from __future__ import annotations

from numba import cuda

from .device import SIMULATOR, gpu_available


class CapturedLaunches:
    """``enqueue(stream)`` captured as a CUDA graph (``graph`` None when not built)."""

    def __init__(self, enqueue, warm, enabled=True):
        self.graph = None
        self.error = None
        self._cstream = None  # capture (non-blocking)
        self._rstream = None  # replay (blocking: ordered with the legacy stream)
        if not SIMULATOR:
            cuda.synchronize()
        if enabled and gpu_available():
            try:
                self._capture(enqueue, warm)
            except Exception as exc:  # the owner keeps working on the plain path
                self.graph = None
                self.error = f"{type(exc).__name__}: {exc}"

    def _capture(self, enqueue, warm):
        from cuda.core import Device, StreamOptions

        dev = Device()
        dev.set_current()
        warm()
        cuda.synchronize()
        self._cstream = dev.create_stream()
        builder = self._cstream.create_graph_builder()
        builder.begin_building()
        enqueue(builder)
        builder.end_building()
        self.graph = builder.complete()
        self._rstream = dev.create_stream(options=StreamOptions(nonblocking=False))
        self.graph.upload(self._rstream)
        self._rstream.sync()

    @property
    def stream_handle(self):
        """The replay stream as an int handle (None without a graph)."""
        return None if self._rstream is None else int(self._rstream.handle)

    def launch(self, sync=False):
        """Replay the graph on the replay stream (after the default stream's
        queued work); ``sync`` waits for it."""
        self.graph.launch(self._rstream)
        if sync:
            self._rstream.sync()

    def synchronize(self):
        if self._rstream is not None:
            self._rstream.sync()
        cuda.synchronize()
