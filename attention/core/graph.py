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

The path taken is recorded: ``path`` is "graph" or "plain" and
``fallback_reason`` says why a graph was asked for and not built (None when
``path`` is what was asked for, ``enabled=False`` included). Plain launches
cost more host time than a replay (numba launches: tens of microseconds each,
a decode step through them 278 us against 5.6 us replayed; the decode state's
prebuilt launches about 40 us, notes/bench.md), so a failed capture on a GPU
also emits a ``checks.FallbackWarning`` with the owner's measured costs. The simulator and a machine with no GPU have no
graphs at all (nothing faster to fall back from): recorded, no warning.

Used by ``attention.decode.step.DecodeState`` and ``mla.decode_graph.MLADecodeGraph``.
"""

from __future__ import annotations

import warnings

from numba import cuda

from attention.core.checks import FallbackWarning
from attention.core.device import SIMULATOR, gpu_available

# host time of one decode step (B 32 fp16), notes/bench.md: replayed vs plain numba
# launches (the default costs a warning quotes; owners pass their own)
REPLAY_US, PLAIN_US = 5.6, 278.0


class CapturedLaunches:
    """``enqueue(stream)`` captured as a CUDA graph (``graph`` None when not built).

    ``owner`` names the object in the fallback warning (e.g. "DecodeState");
    ``plain_call`` the method that then runs the plain launches;
    ``plain_hint`` the argument that asks for them (e.g. ``mode="eager"``);
    ``costs``: (plain, replayed) host microseconds of one call, measured
    (notes/bench.md), quoted by the fallback warning.
    """

    def __init__(self, enqueue, warm, enabled=True, *, owner="CapturedLaunches",
                 plain_call="plain launches", plain_hint="graph=False",
                 costs=(PLAIN_US, REPLAY_US)):
        self.graph = None
        self.error = None
        self.path = "plain"
        self.fallback_reason = None
        self._cstream = None  # capture (non-blocking)
        self._rstream = None  # replay (blocking: ordered with the legacy stream)
        if not SIMULATOR:
            cuda.synchronize()
        if not enabled:
            return
        if SIMULATOR:
            self.fallback_reason = "the simulator cannot capture CUDA graphs"
            return
        if not gpu_available():
            self.fallback_reason = "no CUDA GPU"
            return
        try:
            self._capture(enqueue, warm)
            self.path = "graph"
        except Exception as exc:  # the owner keeps working on the plain path
            self.graph = None
            self.error = f"{type(exc).__name__}: {exc}"
            self.fallback_reason = f"graph capture failed ({self.error})"
            warnings.warn(FallbackWarning(
                f"{owner}: {self.fallback_reason}; running {plain_call} instead, about "
                f"{costs[0] / costs[1]:.0f}x the host time of a graph replay ({costs[0]:g} us "
                f"against {costs[1]:g} us a call, notes/bench.md). Ask for plain "
                f"launches ({plain_hint}) to choose them without this warning."), stacklevel=3)

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
