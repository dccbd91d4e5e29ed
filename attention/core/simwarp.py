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
* ``activemask()`` is a rendezvous of the warp's lanes that are still running
  and returns their mask (the simulator cannot see branch divergence: in
  converged code this is the hardware's answer; lanes that returned early are
  excluded).

``install()`` is idempotent and does nothing unless the simulator is enabled;
``attention/__init__.py`` calls it, so importing this project is enough.
"""

from __future__ import annotations

import threading

__all__ = ["gather", "install", "installed", "WarpSyncError"]

FULL_MASK = 0xFFFFFFFF
WARP = 32

_installed = False


class WarpSyncError(RuntimeError):
    """A warp collective whose mask is inconsistent with the lanes that run it."""


class _Aborted(RuntimeError):
    pass


_ACTIVE = "active"  # key of the activemask() round


class _Round:
    __slots__ = ("members", "values", "done", "error", "waiters")

    def __init__(self, members):
        self.members = members
        self.values = {}
        self.done = False
        self.error = None
        self.waiters = []  # the conditions of the lanes waiting for it


def _wake(waiters):
    """(lock held) wake the threads waiting on these conditions."""
    for cond in waiters:
        cond.notify()
    waiters.clear()


class _Block:
    """Synchronisation state of one simulated block: one lock for everything.

    Every wait goes through ``wait_for``, which also detects a stall: all live
    threads of the block waiting on rounds that cannot complete. A stall first
    completes pending ``activemask()`` rounds with the lanes that reached them
    (lanes of a divergent branch); if there are none, it is a deadlock (the
    hardware would hang) and every waiter raises ``WarpSyncError``.

    Each thread waits on its own condition (over the block's one lock), and a
    completed round or barrier wakes only the threads that wait for it; a
    thread's exit, a stall and an abort wake every waiter. (One shared
    condition woke the whole block at every warp collective: the simulated
    tensor-core kernels spent most of their time there.)
    """

    def __init__(self, n_threads):
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)  # ``with block.cv`` holds the lock
        self.live = n_threads
        self.waiting = {}  # thread -> (predicate that ends its wait, its condition)
        self.conds = {}  # thread -> its condition (over the block's lock)
        self.aborted = False
        self.deadlock = None
        self.barrier = _BlockBarrier(self)
        self.warps = [
            _Rendezvous(range(min(WARP, n_threads - w * WARP)), self)
            for w in range((n_threads + WARP - 1) // WARP)
        ]

    def check(self):
        if self.aborted:
            raise _Aborted("another simulated thread failed")
        if self.deadlock:
            raise WarpSyncError(self.deadlock)

    def wait_for(self, done, waiters):
        """Block (lock held) until ``done()``; detects stalls. ``waiters``: the
        list of whatever ends the wait (a round, the barrier), which gets this
        thread's condition to wake it by."""
        me = threading.current_thread()
        cond = self.conds.get(me)
        if cond is None:
            cond = self.conds[me] = threading.Condition(self.lock)
        while not done():
            self.check()
            self.waiting[me] = (done, cond)
            try:
                if len(self.waiting) == self.live and not any(
                        d() for d, _ in self.waiting.values()):
                    self._resolve_stall()
                    continue
                waiters.append(cond)
                cond.wait()
            finally:
                del self.waiting[me]
        self.check()

    def wake_all(self):
        """(lock held) wake every waiting thread."""
        for _, cond in self.waiting.values():
            cond.notify()

    def _resolve_stall(self):
        completed = False
        for warp in self.warps:
            rnd = warp.pending.pop(_ACTIVE, None)
            if rnd is not None:
                rnd.done = completed = True
        if not completed:
            self.deadlock = (
                "deadlock: every live thread of the block waits on a barrier or warp "
                "collective that the others never reach (divergent syncthreads or a "
                "mask naming lanes that took another path)"
            )
        self.wake_all()

    def leave(self, thread_id):
        """A thread returned from the kernel."""
        with self.cv:
            self.live -= 1
            self.warps[thread_id // WARP].leave(thread_id % WARP)
            self.barrier.leave()
            self.wake_all()

    def abort(self):
        with self.cv:
            self.aborted = True
            self.wake_all()


class _Rendezvous:
    """Warp collectives among the lanes of one warp, some of which may exit early.

    ``arrive(lane, mask, value)`` blocks until every lane named in ``mask`` has
    arrived with the same mask, then returns ``{lane: value}`` for the round.
    Each call gets a fresh round object, so consecutive collectives never mix.
    """

    def __init__(self, lanes, block):
        self.block = block
        self.lanes = frozenset(lanes)
        self.live = set(lanes)
        self.pending = {}
        self.members = {}  # mask -> the warp's lanes it names

    def arrive(self, lane, mask, value):
        block = self.block
        with block.cv:
            block.check()
            members = self.members.get(mask)
            if members is None:
                members = self.members[mask] = frozenset(
                    x for x in self.lanes if (mask >> x) & 1)
            if lane not in members:
                raise WarpSyncError(
                    f"lane {lane} executes a warp collective with mask "
                    f"{mask:#010x} that does not name it"
                )
            if len(self.live) < len(self.lanes):  # a lane has exited
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
            # a lane arrives once a round (it waits for the round to end)
            if len(rnd.values) == len(rnd.members):
                del self.pending[mask]
                rnd.done = True
                _wake(rnd.waiters)
            else:
                block.wait_for(lambda: rnd.done or rnd.error is not None, rnd.waiters)
            if rnd.error:
                raise WarpSyncError(rnd.error)
            return rnd.values

    def arrive_active(self, lane):
        """Rendezvous of the lanes still running; returns their mask.

        A lane that exits while others wait drops out of the round, as an exited
        lane drops out of the hardware's active mask.
        """
        block = self.block
        with block.cv:
            block.check()
            rnd = self.pending.get(_ACTIVE)
            if rnd is None:
                rnd = self.pending[_ACTIVE] = _Round(None)
            rnd.values[lane] = True
            self._complete_active()
            block.wait_for(lambda: rnd.done, rnd.waiters)
            return sum(1 << other for other in rnd.values)

    def _complete_active(self):
        rnd = self.pending.get(_ACTIVE)
        if rnd is not None and self.live <= rnd.values.keys():
            del self.pending[_ACTIVE]
            rnd.done = True
            _wake(rnd.waiters)

    def leave(self, lane):
        """(lock held) ``lane`` has returned from the kernel."""
        self.live.discard(lane)
        self._complete_active()
        for mask, rnd in list(self.pending.items()):
            if mask is not _ACTIVE and lane in rnd.members:
                del self.pending[mask]
                rnd.error = (
                    f"lane {lane} exited while named in the mask "
                    f"{mask:#010x} of a pending warp collective"
                )


class _BlockBarrier:
    """``syncthreads``: waits for every thread of the block that has not exited."""

    def __init__(self, block):
        self.block = block
        self.arrived = 0
        self.generation = 0
        self.waiters = []

    def wait(self):
        block = self.block
        with block.cv:
            block.check()
            gen = self.generation
            self.arrived += 1
            if self.arrived == block.live:
                self._release()
            else:
                block.wait_for(lambda: self.generation != gen, self.waiters)

    def _release(self):
        self.arrived = 0
        self.generation += 1
        _wake(self.waiters)

    def leave(self):
        """(lock held) one thread fewer to wait for."""
        if self.arrived and self.arrived == self.block.live:
            self._release()


def _current():
    return threading.current_thread()


def _lane_and_warp(t):
    return t.thread_id % WARP, t._manager._sync.warps[t.thread_id // WARP]


def _collective(mask, value):
    t = _current()
    lane, warp = _lane_and_warp(t)
    return lane, warp.arrive(lane, int(mask) & FULL_MASK, value)


def gather(value, mask=FULL_MASK):
    """One warp collective over the lanes of ``mask``: ``{lane: value}`` of the
    round. For the simulator's stand-ins of instructions that read other lanes'
    registers (``mma``, ``ldmatrix``): one rendezvous returns what a shuffle
    from each source lane would, where a shuffle a value took one each."""
    return _collective(mask, value)[1]


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
    lane, warp = _lane_and_warp(t)
    return warp.arrive_active(lane)


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

    n_threads = 1
    for extent in self._block_dim:
        n_threads *= extent
    block = self._sync = _Block(n_threads)

    threads = []
    for block_point in _ndindex(self._block_dim):
        holder = {}

        def target(holder=holder):
            t = holder["thread"]
            try:
                self._f(*args)
            except BaseException:
                block.abort()
                raise
            finally:
                block.leave(t.thread_id)

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
    self._manager._sync.barrier.wait()


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
