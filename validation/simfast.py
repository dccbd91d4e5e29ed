"""Faster simulated kernels: the same results from numba's CUDA simulator in less time.

The tests' simulator process and the simulator's validation runs spend most of
their time not in the kernels' arithmetic but in the simulator's machinery.
``install()`` (a no-op unless ``NUMBA_ENABLE_CUDASIM=1``; ``tests/conftest.py``
and the validation runner's workers call it) replaces five pieces of it:

* **Warp butterflies.** ``attention.core.warp``'s ``warp_sum``, ``warp_max``,
  ``group_sum`` and ``group_max`` are shuffle butterflies: each step needs
  every lane's value of the step before, so each step is a rendezvous of the
  warp's 32 simulated threads (32 thread switches). ``butterfly`` meets once
  and replays the whole butterfly for every lane: the same operation on the
  same operands in the same order (lane ``l`` takes ``op(own, partner)``,
  partner ``l ^ off``, or its own value where the partner is not in the warp,
  as ``shfl_xor_sync`` gives), so the same bits in every lane. The helpers'
  device functions keep their objects (every kernel holds them); their Python
  bodies are swapped, and ``SHUFFLE_FORMS`` keeps the originals for the test
  that compares the two (``tests/test_simwarp.py``).
* **Device-function calls.** The simulator swaps its fake ``cuda`` module into
  a device function's module on every call and back after it (two locks, a
  scan of the module's globals and an import each time). ``_kernel_call``
  swaps a module once a launch and holds it until the launch returns or
  raises, then undoes every swap.
* **Shared arrays.** ``cuda.shared.array`` keyed its one array a call site and
  block by a ``traceback.extract_stack`` (which stats every source file on the
  stack) in every thread; ``_shared_array`` takes the same key, the caller's
  (file, line), from its frame, and makes the array atomically
  (``dict.setdefault``: two threads could each make their own before).
* **16-bit registers.** The mma stand-in of ``attention.gemm.mma16`` decodes
  each 16-bit half of a register through numpy scalars; ``_halves`` reads it
  from a table of the 65,536 patterns (``tests/test_mma16.py`` checks every
  pattern against the bit casts).
* **Scalar casts.** A kernel's ``float32(x)`` is numba's type object called on
  a value: ``Type.__call__`` imports ``numba.core.typing`` and runs an ABC
  ``isinstance`` on every call before numpy's cast. ``_number_call`` takes the
  cast at once for a plain Python or numpy scalar (never a numba type), the
  rest the way numba does (``float32(float32)`` is still a signature).

None of this is kernel code: it lives outside the kernel packages, so the
kernels' source hash (``validation.provenance``), and with it the freshness of
every GPU report, does not move with it. Measured on a 2-core machine, two
workers: the tests' simulator process went from 588 s to 385 s
(notes/bench.md, "The simulator's machinery, made faster").
"""

from __future__ import annotations

import operator
import sys
import threading

_installed = False
SHUFFLE_FORMS = {}  # name -> the Python body of attention.core.warp's device function
_BUTTERFLY = "butterfly"  # key of a round's replayed butterfly, beside the lanes' values
_held_swaps = []  # the device functions' module swaps held until the launch ends
_original_call = None
# set by install(), so the calls below need no import: numba's simulator modules
# (kernel, kernelapi) and attention.core.simwarp.gather
_kernel = _kernelapi = _gather = None


def butterfly(value, offsets, op):
    """``for off in offsets: value = op(value, shfl_xor_sync(FULL, value, off))``
    for the calling lane, in one rendezvous of its warp (simulator only)."""
    vals = _gather(value)
    key = (_BUTTERFLY, tuple(offsets), op)
    out = vals.get(key)
    if out is None:  # the first lane back replays it for every lane of the round
        # dict(vals): one C-level copy, so no other lane's insert lands mid-way
        cur = {x: v for x, v in dict(vals).items() if type(x) is int}
        for off in offsets:
            cur = {x: op(v, cur.get(x ^ off, v)) for x, v in cur.items()}
        out = vals.setdefault(key, cur)
    return out[threading.current_thread().thread_id % 32]


def _offsets(lanes):  # the steps of group_sum / group_max: lanes // 2, ..., 1
    offs, off = [], int(lanes) // 2
    while off > 0:
        offs.append(off)
        off //= 2
    return tuple(offs)


def _warp_sum(v):
    return butterfly(v, (16, 8, 4, 2, 1), operator.add)


def _warp_max(v):
    return butterfly(v, (16, 8, 4, 2, 1), max)


def _group_sum(v, lanes):
    offs = _offsets(lanes)
    return butterfly(v, offs, operator.add) if offs else v


def _group_max(v, lanes):
    offs = _offsets(lanes)
    return butterfly(v, offs, max) if offs else v


FUSED_FORMS = {"warp_sum": _warp_sum, "warp_max": _warp_max,
               "group_sum": _group_sum, "group_max": _group_max}


def _kernel_call(self, *args):
    """``FakeCUDAKernel.__call__``: a launch as the simulator makes it; a device
    function called inside a launch swaps the fake ``cuda`` into its module only
    if no swap holds it yet, and that swap is held until the launch ends."""
    ctx = _kernel._kernel_context
    if ctx is None:  # a launch, or a device function called from host code (which
        try:          # holds no swap: the loop below then has nothing to undo)
            return _original_call(self, *args)
        finally:
            while _held_swaps:
                _held_swaps.pop().__exit__(None, None, None)
    # (a swap raises the module's count only after its globals are swapped: a
    # thread that reads it non-zero finds the module ready; two threads that both
    # read 0 hold two swaps, both undone at the end)
    if not _kernelapi._swap_refcount.get(id(self.fn.__globals__)):
        swap = _kernelapi.swapped_cuda_module(self.fn, ctx)
        swap.__enter__()
        _held_swaps.append(swap)
    return self.fn(*args)


def _shared_array(self, shape, dtype, alignment=None):
    """The simulator's ``cuda.shared.array`` (one array a call site and block; a
    ``shape`` of 0 is the dynamic shared memory), keyed by the caller's frame."""
    import numpy as np
    from numba.cuda import types
    from numba.cuda.np import numpy_support

    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    dtype = np.dtype(dtype)
    if shape == 0:
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    caller = sys._getframe(1)
    site = (caller.f_code.co_filename, caller.f_lineno)
    res = self._allocations.get(site)
    if res is None:
        res = self._allocations.setdefault(site, np.empty(shape, dtype))
    return res


_VALUE_TYPES = set()  # Python and numpy scalar types: values, never numba types
_type_call = None  # numba's Type.__call__


def _number_call(self, *args):
    """``Number.__call__``: a cast of one plain scalar at once, the rest as numba."""
    if len(args) == 1 and type(args[0]) in _VALUE_TYPES:
        return self.cast_python_value(args[0])
    return _type_call(self, *args)


_TABLES = {}


def values16(kind):
    """The float value of each of the 65,536 bit patterns of ``kind`` ("f16": as
    numpy's float16; "bf16": as the top half of a float32), widened exactly."""
    table = _TABLES.get(kind)
    if table is None:
        import numpy as np

        bits = np.arange(1 << 16, dtype=np.uint32)
        with np.errstate(invalid="ignore"):  # the signalling NaNs' patterns
            if kind == "f16":
                wide = bits.astype(np.uint16).view(np.float16).astype(np.float64)
            else:
                wide = (bits << 16).view(np.float32).astype(np.float64)
        table = _TABLES.setdefault(kind, wide.tolist())
    return table


def _halves(word, kind):
    """The float values of the two 16-bit elements of a uint32 word."""
    w = int(word) & 0xFFFFFFFF
    values = values16(kind)
    return values[w & 0xFFFF], values[w >> 16]


def install():
    """Install the five replacements (idempotent). Does nothing unless the
    simulator is on; returns whether they are installed."""
    global _installed, _original_call, _kernel, _kernelapi, _gather, _type_call
    if _installed:
        return True
    from numba.cuda.core import config

    if not config.ENABLE_CUDASIM:
        return False
    import numpy as np
    from numba.core.types import abstract
    from numba.cuda.simulator import kernel, kernelapi

    from attention.core import simwarp, warp
    from attention.gemm import mma16
    # imported here, outside any simulated kernel: ``mma16.k_step_sum`` (the mma
    # stand-in) imports tgemm on its first call, and a module's first import inside
    # a simulated kernel runs its ``device_fn`` definitions while the simulator's
    # fake ``cuda`` module (which has no ``jit``) stands in for numba.cuda
    from attention.gemm import tgemm  # noqa: F401

    simwarp.install()
    _kernel, _kernelapi, _gather = kernel, kernelapi, simwarp.gather
    for name, fused in FUSED_FORMS.items():
        fn = getattr(warp, name)
        SHUFFLE_FORMS[name] = fn.fn
        fn.fn = fused
    _original_call = kernel.FakeCUDAKernel.__call__
    kernel.FakeCUDAKernel.__call__ = _kernel_call
    kernelapi.FakeCUDAShared.array = _shared_array
    mma16._halves = _halves
    _VALUE_TYPES.update({bool, int, float, np.bool_, np.float16, np.float32, np.float64,
                         np.int8, np.int16, np.int32, np.int64,
                         np.uint8, np.uint16, np.uint32, np.uint64})
    _type_call = abstract.Type.__call__
    abstract.Number.__call__ = _number_call
    _installed = True
    return True


def installed():
    """True once ``install()`` has patched the simulator."""
    return _installed
