"""Per-slot caches allocated separately, read through a table of device pointers.

A pooled cache ``[KV_SLOTS, H_kv, max_seq, D]`` is one allocation addressed by
slot index. Some callers own one allocation per slot instead (a list of
``[H_kv, max_seq, D]`` device arrays); kernels then read slot ``s`` through
``ptrs[s]``, a ``uint64`` device address, exactly as the per-slot pointer
arrays of the reference design do.

* ``load_f32(base, index)``: an inlined device intrinsic: ``inttoptr`` of the
  ``uint64`` address ``base`` to ``float*``, then the float32 at element
  ``index`` (int64). GPU only: the simulator has no device addresses.
* ``pointer_table(arrays, name)``: validates the list (same shape, float32,
  C-contiguous, device-resident) and returns ``(table, shape, keep)``: the
  ``uint64 [KV_SLOTS]`` device table, the per-slot shape ``(H_kv, max_seq, D)``
  and the device arrays the table points into (keep them alive until the
  kernel has run).
"""

from __future__ import annotations

import numpy as np

from attention.core import checks
from attention.core.device import SIMULATOR, is_host_array, to_device


class PointerTableUnavailable(RuntimeError):
    """Per-slot pointer caches need a GPU: the simulator cannot dereference addresses."""


def is_cache_list(x) -> bool:
    """True for a per-slot cache given as a list/tuple of arrays."""
    return isinstance(x, (list, tuple))


if SIMULATOR:

    def load_f32(base, index):  # pragma: no cover - never compiled in the simulator
        raise PointerTableUnavailable(
            "load_f32: device pointers cannot be dereferenced under the CUDA simulator")

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load_f32(typingctx, base, index):
        """float32 at ``((float*)base)[index]``; base uint64, index int64 (device)."""
        if base != types.uint64 or index not in (types.int64, types.int32, types.uint64):
            return None

        def codegen(context, builder, sig, args):
            address, offset = args
            if sig.args[1] != types.int64:
                offset = builder.sext(offset, ir.IntType(64)) if sig.args[1] == types.int32 \
                    else offset
            pointer = builder.inttoptr(address, ir.PointerType(ir.FloatType()))
            return builder.load(builder.gep(pointer, [offset]))

        return types.float32(base, index), codegen


def pointer_table(arrays, name, *, shape=None, stream=None):
    """Validate a per-slot cache list and build its ``uint64`` pointer table.

    arrays: list of KV_SLOTS float32 C-contiguous ``[H_kv, max_seq, D]`` device
            arrays (numba, ``__cuda_array_interface__`` or DLPack);
    shape:  the expected per-slot shape (None: the first entry's).
    Returns ``(table [KV_SLOTS] uint64 device array, (H_kv, max_seq, D), views)``.
    Raises the named ``checks`` errors before anything is copied, and
    ``PointerTableUnavailable`` under the simulator.
    """
    if len(arrays) == 0:
        raise checks.ShapeError(f"{name}: expected at least one per-slot cache, got none")
    dims = (("H_kv", None), ("max_seq", None), ("D", None)) if shape is None else tuple(
        (label, int(n)) for label, n in zip(("H_kv", "max_seq", "D"), shape))
    for i, a in enumerate(arrays):
        got = checks.check_array(f"{name}[{i}]", a, dims, dtypes=(np.float32,))
        if shape is None:
            shape = got
            dims = tuple((label, int(n)) for label, n in zip(("H_kv", "max_seq", "D"), shape))
        if is_host_array(a):
            raise checks.LayoutError(
                f"{name}[{i}]: per-slot caches are read through device pointers: expected a "
                f"device array, got a numpy array (use a pooled [KV_SLOTS, H_kv, max_seq, D] "
                f"cache for host data)")
    if SIMULATOR:
        raise PointerTableUnavailable(
            f"{name}: per-slot caches (a list of device arrays) are read through device "
            f"pointers, which the CUDA simulator cannot dereference: use a pooled "
            f"[KV_SLOTS, H_kv, max_seq, D] cache there")
    views = [to_device(a, stream) for a in arrays]
    table = np.array([int(v.__cuda_array_interface__["data"][0]) for v in views], np.uint64)
    return to_device(table, stream), tuple(int(s) for s in shape), views
