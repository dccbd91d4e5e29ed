"""Programmatic dependent launch: a kernel that starts before the one ahead of it ends.

A split-KV decode is two launches: the main kernel writes partials, the combine
merges them. Launched plainly, the combine's blocks are scheduled only after
the main kernel has finished and its writes are flushed, so the combine's
launch and ramp (a few microseconds, about as long as its work at B 1) sit on
the critical path. With a programmatic dependent launch (sm_90 and later):

* the dependent (the combine) is launched with the stream attribute
  ``programmatic_stream_serialization`` (``launch_dependent``);
* every block of the primary (the main kernel) executes
  ``griddepcontrol.launch_dependents`` (``release_dependents()``) as it
  starts, so the dependent's blocks may be scheduled once every primary block
  is running, on the room the primary leaves;
* the dependent executes ``griddepcontrol.wait`` (``wait_for_primary()``)
  before it reads anything: that returns once the primary grid has completed
  and its memory operations are visible. Launched plainly, a kernel's
  ``griddepcontrol.wait`` returns at once (nothing to wait for), so the same
  compiled kernels serve both launches.

Kernels take the two device functions from ``grid_dependency_ops(enabled)``:
real instructions where ``enabled`` (compiled for sm_90 or later), empty
functions elsewhere (older GPUs, the simulator, compile-only runs for other
targets). ``capable()`` says whether this process can use it (sm_90 or later,
a ``cuda.core`` whose ``LaunchConfig`` has the attribute, not the simulator);
``off_reason()`` says why not, and ``status()`` records the path a plan's
combine takes and why (PDL off costs a few microseconds at most: recorded, no
warning).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from attention.core.device import SIMULATOR, device_fn, gpu_available, ptx_statement

MIN_CC = (9, 0)


@functools.lru_cache(maxsize=None)
def _config_has_attribute():
    try:
        from cuda.core import LaunchConfig

        LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
        return True
    except Exception:  # an older cuda.core: plain launches only
        return False


def off_reason():
    """Why kernels cannot be launched as programmatic dependents here (a
    string), or None where they can. Plain launches are then used: they give
    the same results and cost the dependent's launch and ramp (a few
    microseconds), so this is recorded, not warned about."""
    if SIMULATOR:
        return "the simulator has no programmatic dependent launch"
    if not gpu_available():
        return "no CUDA GPU"
    cc = tuple(cuda.get_current_device().compute_capability)
    if cc < MIN_CC:
        return (f"compute capability {cc[0]}.{cc[1]} < "
                f"{MIN_CC[0]}.{MIN_CC[1]} (griddepcontrol needs sm_90)")
    if not _config_has_attribute():
        return ("this cuda.core's LaunchConfig has no programmatic_stream_serialization "
                "attribute")
    return None


def capable():
    """True where kernels may be launched as programmatic dependents (a GPU
    of compute capability >= 9.0 and a ``cuda.core`` that can ask for it)."""
    return off_reason() is None


def status(requested=None):
    """Which launch a split plan's combine gets, and why: a dict
    ``{"path": "pdl" | "plain", "reason": str}``. ``requested``: the plan's
    ``pdl`` (None: ``capable()`` decides, as ``decode_fast.plan`` does)."""
    why_not = off_reason()
    if requested is False:
        return {"path": "plain", "reason": "pdl=False was asked for"}
    if why_not is None:
        return {"path": "pdl", "reason": "sm_90 or later and cuda.core can ask for it"}
    if requested:
        return {"path": "pdl", "reason": f"pdl=True was asked for ({why_not})"}
    return {"path": "plain", "reason": why_not}


@functools.lru_cache(maxsize=None)
def grid_dependency_ops(enabled):
    """``(release_dependents, wait_for_primary)`` device functions: inline
    ``griddepcontrol`` PTX where ``enabled``, empty functions otherwise."""
    if not enabled:
        def nothing():
            pass

        nothing = device_fn(nothing)
        return nothing, nothing

    return (ptx_statement("griddepcontrol.launch_dependents;"),
            ptx_statement("griddepcontrol.wait;"))


def is_graph_builder(stream):
    """True for a ``cuda.core`` graph builder (a launch being captured)."""
    try:
        from cuda.core.graph import GraphBuilder
    except Exception:
        return False
    return isinstance(stream, GraphBuilder)


def launch_dependent(kernel, grid, block, stream, args, shared=0):
    """Launch numba kernel ``kernel`` (a dispatcher) like
    ``kernel[grid, block, stream, shared](*args)``, marked as a programmatic
    dependent of the kernel launched before it on ``stream`` (a numba stream
    or 0). ``args`` must be device arrays and scalars (nothing is copied
    back). The kernel must call ``wait_for_primary()`` before it reads what
    the primary wrote."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv import driver

    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            raise TypeError(f"launch_dependent: argument {i} is a host array; pass device "
                            "arrays (a launch that copies back cannot overlap its primary)")
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    compiled = kernel.compile(argtypes)
    retr, packed = [], []
    for ty, val in zip(compiled.argument_types, args):
        compiled._prepare_args(ty, val, stream, retr, packed)
    config = LaunchConfig(grid=grid, block=block, shmem_size=int(shared),
                          programmatic_stream_serialization=True)
    fn = compiled._codelibrary.get_cufunc()
    core_launch(driver._to_core_stream(stream), config, fn.kernel, *packed)
