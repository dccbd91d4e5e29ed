"""Warp intrinsics and a waiting (not polling) barrier for numba's CUDA simulator.

The simulator of numba-cuda 0.30.4 (``NUMBA_ENABLE_CUDASIM=1``) runs each CUDA
thread as a Python thread but has no warp operations at all (numba issue 8433),
and its block barrier is a manager thread that busy-polls every CUDA thread
while holding the GIL. This module adds, for this project:

* ``shfl_sync``, ``shfl_up_sync``, ``shfl_down_sync``, ``shfl_xor_sync``,
  ``syncwarp``, ``activemask``, ``all_sync``, ``any_sync``, ``ballot_sync``,
  ``eq_sync`` and ``lanemask_lt`` on the simulator's fake ``cuda`` module;
* a block runner whose ``syncthreads`` waits on a condition variable.

Semantics (per warp, so blocks of several warps and partial last warps work):

* Warp ``w`` of a block is the threads with linear id ``32*w .. 32*w+31``; a
  thread's lane is its linear id modulo 32, as on the hardware.
* A collective with ``mask`` is a rendezvous of the lanes named in ``mask``
  that belong to the warp. It completes when all of them have arrived; each
  call gets its own round, so consecutive collectives never mix values.
* Source lanes follow PTX's ``shfl.sync`` with a 32-lane segment: ``shfl_sync``
  takes ``src % 32``; ``shfl_up_sync`` / ``shfl_down_sync`` /
  ``shfl_xor_sync`` return the caller's own value when the source lane falls
  outside 0..31. A source lane that exists but is not in the round (not named
  in ``mask``, or absent from a partial warp) is undefined on the hardware;
  here the caller gets its own value back, deterministically.
* Naming the caller's lane out of ``mask``, or a lane that has already exited,
  is a programming error on the hardware (a hang or undefined result): here it
  raises ``WarpSyncError`` so the defect is visible in tests.
* ``activemask()`` returns the lanes of the warp that have not exited (the
  simulator cannot see branch divergence).

``install()`` is idempotent and does nothing unless the simulator is enabled;
``attention/__init__.py`` calls it, so importing this project is enough.
"""

from __future__ import annotations

import threading

__all__ = ["install", "installed", "WarpSyncError"]

FULL_MASK = 0xFFFFFFFF
WARP = 32

_installed = False


class WarpSyncError(RuntimeError):
    """A warp collective whose mask is inconsistent with the lanes that run it."""


class _Aborted(RuntimeError):
    pass


class _Round:
    __slots__ = ("members", "values", "done", "error")

    def __init__(self, members):
        self.members = members
        self.values = {}
        self.done = False
        self.error = None


class _Rendezvous:
    """Collectives among a fixed set of lanes, some of which may exit early.

    ``arrive(lane, mask, value)`` blocks until every live member named in
    ``mask`` has arrived with the same mask, then returns ``{lane: value}``
    for the round. One condition variable, one wait per call.
    """

    def __init__(self, lanes, cv):
        self.cv = cv
        self.lanes = frozenset(lanes)
        self.live = set(lanes)
        self.pending = {}
        self.aborted = False

    def _members(self, mask):
        return frozenset(lane for lane in self.lanes if (mask >> lane) & 1)

    def _complete_ready(self):
        for mask, rnd in list(self.pending.items()):
            if rnd.members <= rnd.values.keys():
                del self.pending[mask]
                rnd.done = True
                self.cv.notify_all()

    def arrive(self, lane, mask, value):
        with self.cv:
            if self.aborted:
                raise _Aborted("another simulated thread failed")
            members = self._members(mask)
            if lane not in members:
                raise WarpSyncError(
                    f"lane {lane} executes a warp collective with mask "
                    f"{mask:#010x} that does not name it"
                )
            exited = members - self.live
            if exited:
                raise WarpSyncError(
                    f"warp collective with mask {mask:#010x} names lanes "
                    f"{sorted(exited)} that have already exited"
                )
            rnd = self.pending.get(mask)
            if rnd is None:
                rnd = self.pending[mask] = _Round(members)
            rnd.values[lane] = value
            if rnd.members <= rnd.values.keys():
                del self.pending[mask]
                rnd.done = True
                self.cv.notify_all()
            else:
                while not (rnd.done or rnd.error or self.aborted):
                    self.cv.wait()
            if self.aborted:
                raise _Aborted("another simulated thread failed")
            if rnd.error:
                raise WarpSyncError(rnd.error)
            return rnd.values

    def leave(self, lane):
        """``lane`` has returned from the kernel."""
        with self.cv:
            self.live.discard(lane)
            for mask, rnd in list(self.pending.items()):
                if lane in rnd.members:
                    del self.pending[mask]
                    rnd.error = (
                        f"lane {lane} exited while named in the mask "
                        f"{mask:#010x} of a pending warp collective"
                    )
                    self.cv.notify_all()

    def abort(self):
        with self.cv:
            self.aborted = True
            self.cv.notify_all()


class _BlockBarrier:
    """``syncthreads`` for one block: waits for every thread that has not exited."""

    def __init__(self, n_threads, cv):
        self.cv = cv
        self.live = n_threads
        self.arrived = 0
        self.generation = 0
        self.aborted = False

    def _release(self):
        self.arrived = 0
        self.generation += 1
        self.cv.notify_all()

    def wait(self):
        with self.cv:
            if self.aborted:
                raise _Aborted("another simulated thread failed")
            gen = self.generation
            self.arrived += 1
            if self.arrived == self.live:
                self._release()
            else:
                while self.generation == gen and not self.aborted:
                    self.cv.wait()
            if self.aborted:
                raise _Aborted("another simulated thread failed")

    def leave(self):
        with self.cv:
            self.live -= 1
            if self.arrived and self.arrived == self.live:
                self._release()

    def abort(self):
        with self.cv:
            self.aborted = True
            self.cv.notify_all()


def _current():
    return threading.current_thread()


def _lane_and_warp(t):
    return t.thread_id % WARP, t._manager._warps[t.thread_id // WARP]


def _collective(mask, value):
    t = _current()
    lane, warp = _lane_and_warp(t)
    return lane, warp.arrive(lane, int(mask) & FULL_MASK, value)


# -- the intrinsics, as methods of the simulator's FakeCUDAModule ------------


def _shfl_sync(self, mask, value, src_lane):
    lane, vals = _collective(mask, value)
    return vals.get(int(src_lane) % WARP, value)


def _shfl_up_sync(self, mask, value, delta):
    lane, vals = _collective(mask, value)
    src = lane - int(delta)
    return vals.get(src, value) if 0 <= src < WARP else value


def _shfl_down_sync(self, mask, value, delta):
    lane, vals = _collective(mask, value)
    src = lane + int(delta)
    return vals.get(src, value) if 0 <= src < WARP else value


def _shfl_xor_sync(self, mask, value, lane_mask):
    lane, vals = _collective(mask, value)
    src = lane ^ int(lane_mask)
    return vals.get(src, value) if 0 <= src < WARP else value


def _syncwarp(self, mask=FULL_MASK):
    _collective(mask, None)


def _activemask(self):
    t = _current()
    _, warp = _lane_and_warp(t)
    with warp.cv:
        return sum(1 << lane for lane in warp.live)


def _lanemask_lt(self):
    return (1 << (_current().thread_id % WARP)) - 1


def _all_sync(self, mask, predicate):
    _, vals = _collective(mask, bool(predicate))
    return all(vals.values())


def _any_sync(self, mask, predicate):
    _, vals = _collective(mask, bool(predicate))
    return any(vals.values())


def _eq_sync(self, mask, value):
    _, vals = _collective(mask, value)
    first = next(iter(vals.values()))
    return all(v == first for v in vals.values())


def _ballot_sync(self, mask, predicate):
    _, vals = _collective(mask, bool(predicate))
    bits = sum(1 << lane for lane, p in vals.items() if p)
    # ballot_sync is int32 on the device: lane 31 is the sign bit.
    return bits - (1 << 32) if bits >= (1 << 31) else bits


# -- the block runner ---------------------------------------------------------


def _block_run(self, grid_point, *args):
    """Replacement for ``BlockManager.run``: start the threads, then join them.

    Barriers wait on a condition variable instead of being polled by this
    thread, and a failing thread aborts the others' waits so the block ends.
    """
    from numba.cuda.simulator.kernel import BlockThread

    cv = threading.Condition()
    n_threads = 1
    for extent in self._block_dim:
        n_threads *= extent
    self._barrier = _BlockBarrier(n_threads, cv)
    self._warps = [
        _Rendezvous(range(min(WARP, n_threads - w * WARP)), cv)
        for w in range((n_threads + WARP - 1) // WARP)
    ]

    def abort_all():
        self._barrier.abort()
        for warp in self._warps:
            warp.abort()

    threads = []
    for block_point in _ndindex(self._block_dim):
        holder = {}

        def target(holder=holder):
            t = holder["thread"]
            try:
                self._f(*args)
            except BaseException:
                abort_all()
                raise
            finally:
                self._warps[t.thread_id // WARP].leave(t.thread_id % WARP)
                self._barrier.leave()

        t = BlockThread(target, self, grid_point, block_point, self._debug)
        holder["thread"] = t
        threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Report the root cause, not the waits it aborted.
    failed = [t for t in threads if t.exception]
    primary = [t for t in failed if not isinstance(t.exception[0], _Aborted)]
    for t in primary or failed:
        raise t.exception[0].with_traceback(t.exception[1])


def _ndindex(shape):
    import numpy as np

    return np.ndindex(*shape)


def _thread_syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    self._manager._barrier.wait()


def install():
    """Add the warp intrinsics and the waiting barrier to the simulator.

    Does nothing when the simulator is not enabled. Safe to call repeatedly.
    """
    global _installed
    if _installed:
        return True
    from numba.cuda.core import config

    if not config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernel, kernelapi

    mod = kernelapi.FakeCUDAModule
    mod.shfl_sync = _shfl_sync
    mod.shfl_up_sync = _shfl_up_sync
    mod.shfl_down_sync = _shfl_down_sync
    mod.shfl_xor_sync = _shfl_xor_sync
    mod.syncwarp = _syncwarp
    mod.activemask = _activemask
    mod.lanemask_lt = _lanemask_lt
    mod.all_sync = _all_sync
    mod.any_sync = _any_sync
    mod.eq_sync = _eq_sync
    mod.ballot_sync = _ballot_sync
    kernel.BlockManager.run = _block_run
    kernel.BlockThread.syncthreads = _thread_syncthreads
    _installed = True
    return True


def installed():
    """True once ``install()`` has patched the simulator."""
    return _installed
