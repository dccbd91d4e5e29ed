"""Launches with prebuilt arguments, enqueued through ``cuda.core``.

A numba launch (``kernel[grid, block, stream](*args)``) types, packs and
checks its arguments at every call: tens of microseconds of host time. A
launch whose arguments are the same device buffers every time can do that
work once:

* ``ArgTemplate``: a kernel's argument list in numba's packed form, built once
  (for an array: ``meminfo 0, parent 0, size, itemsize, data pointer,
  shape..., strides in bytes...``; scalars as ctypes values), in which a
  caller may overwrite the data pointers from one call to the next
  (``attention.decode.plan.DecodePlan``);
* ``PrebuiltLaunch(kernel, args, grid, block)``: one numba kernel compiled for
  ``args``' types, its ``cuda.core`` handle and its packed arguments; calling
  it with a stream enqueues the launch and does nothing else;
* ``core_stream(stream, cache)``: the ``cuda.core`` stream (or graph builder)
  for a numba, torch, cuda.core or int stream.

GPU only: the simulator has no ``cuda.core`` launch (its callers launch
through numba there).
"""

from __future__ import annotations

import numpy as np


class ArgTemplate:
    """A kernel's argument list in numba's packed form, built once.

    ``add_array(shape, itemsize)`` appends ``0, 0, size, itemsize, ptr,
    shape..., C strides in bytes...`` and returns the index of ``ptr``;
    ``add(value)`` appends a scalar (a ctypes value)."""

    def __init__(self):
        self.words = []

    def add_array(self, shape, itemsize, ptr=0):
        strides, step = [], itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(int(n), 1)
        at = len(self.words) + 4
        self.words += [0, 0, int(np.prod(shape, dtype=np.int64)), int(itemsize), int(ptr)]
        self.words += [int(n) for n in shape] + list(reversed(strides))
        return at

    def add(self, value):
        self.words.append(value)


def array_ptr(a):
    """Device address of numba device array ``a`` (0 when empty)."""
    return a.device_ctypes_pointer.value or 0


def core_stream(stream, cache):
    """A ``cuda.core`` stream (or graph builder) for ``stream``: None or 0 (the
    default stream), a numba stream, a cuda.core stream / graph builder, a
    torch stream (``.cuda_stream``) or an int handle. ``cache``: a dict of
    handles already wrapped."""
    from cuda.core import Stream

    if stream is None or isinstance(stream, int):
        handle = int(stream or 0)
    elif isinstance(stream, Stream):
        return stream
    elif hasattr(stream, "cuda_stream"):  # torch
        handle = int(stream.cuda_stream)
    elif hasattr(stream, "handle") and type(stream).__module__.startswith("numba"):
        from numba.cuda.cudadrv import driver

        return driver._to_core_stream(stream)
    else:
        from attention.core.pdl import is_graph_builder

        if is_graph_builder(stream):
            return stream
        raise TypeError(f"stream: expected None, 0, a numba, cuda.core or torch stream, got "
                        f"{type(stream).__name__}")
    core = cache.get(handle)
    if core is None:
        if len(cache) > 64:
            cache.clear()
        core = cache[handle] = Stream.from_handle(handle)
    return core


class PrebuiltLaunch:
    """``kernel[grid, block, stream, shared](*args)`` with ``args`` fixed.

    kernel: a numba CUDA dispatcher; args: device arrays and numpy scalars
    (the same objects at every launch: their contents may change, not the
    buffers); grid, block: ints or tuples; shared: dynamic shared memory bytes.
    The kernel is compiled for the arguments' types and loaded when this is
    made; ``launch(stream)`` (a ``core_stream`` result) only enqueues. Keeps
    ``args`` alive as long as it lives.
    """

    def __init__(self, kernel, args, grid, block, shared=0):
        from cuda.core import LaunchConfig
        from cuda.core import launch as core_launch

        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(f"PrebuiltLaunch: argument {i} is a host array; a prebuilt "
                                "launch takes device arrays and scalars")
        self.args = tuple(args)
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in self.args))
        retr, packed = [], []
        for ty, val in zip(compiled.argument_types, self.args):
            compiled._prepare_args(ty, val, 0, retr, packed)
        if retr:  # pragma: no cover - device arguments need no copy back
            raise TypeError("PrebuiltLaunch: an argument needs a copy back after the launch")
        self.words = packed
        self.kernel = compiled._codelibrary.get_cufunc().kernel
        self.config = LaunchConfig(grid=grid, block=block, shmem_size=int(shared))
        self._launch = core_launch

    def launch(self, stream):
        """Enqueue the launch on ``stream`` (a cuda.core stream or graph builder)."""
        self._launch(stream, self.config, self.kernel, *self.words)
