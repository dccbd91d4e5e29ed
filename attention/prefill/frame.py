"""The host frame the prefill launchers share: integer and alignment checks, the
tile plan's checks, the optional output buffers, T == 0, and handing results
back (``attention.prefill.kernels``, ``attention.prefill.mma``,
``attention.prefill.tf32``).

Shapes: out [T, H*D] float32, lse [H, T] float32.
"""

from __future__ import annotations

import numpy as np

from attention.core import checks
from attention.core.device import device_empty, finish, is_host_array, output_array


def int_arg(name, value):
    """``value`` as an int; ``checks.DTypeError`` naming ``name`` otherwise (bools too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise checks.DTypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def check_aligned(name, x):
    """A device array must start on 16 bytes (``cp.async`` copies 16-byte chunks);
    torch tensors answer through ``data_ptr`` (a bfloat16 one has no usable
    ``__cuda_array_interface__``)."""
    if type(x).__module__.startswith("torch"):
        if x.is_cuda and x.data_ptr() % 16:
            raise checks.LayoutError(f"{name}: expected a device address aligned to 16 bytes "
                                     f"(cp.async copies), got {x.data_ptr():#x}")
        return
    checks.check_aligned(name, x, 16)


def check_tiles(warps, block_n, max_warps, block_ns):
    """The plan keywords of a tensor-core prefill: ``warps`` in 1 .. max_warps,
    ``block_n`` None or one of ``block_ns``. Returns (warps, block_n)."""
    warps = int_arg("warps", warps)
    checks.check_range("warps", warps, 1, max_warps, what="warps a block")
    if block_n is not None:
        block_n = int_arg("block_n", block_n)
        if block_n not in block_ns:
            raise checks.RangeError(f"block_n: expected one of {block_ns} or None, got {block_n}")
    return warps, block_n


def check_outputs(out, lse, t_len, n_heads, head_dim):
    """The caller's optional buffers: out [T, H*D] and lse [H, T] float32.
    Returns (out shape, lse shape)."""
    o_shape, s_shape = (t_len, n_heads * head_dim), (n_heads, t_len)
    for name, given, shape in (("out", out, o_shape), ("lse", lse, s_shape)):
        if given is not None:
            checks.check_array(name, given, (("T" if name == "out" else "H", shape[0]),
                                             ("H*D" if name == "out" else "T", shape[1])),
                               dtypes=(np.float32,))
    return o_shape, s_shape


def empty_results(host, o_shape, s_shape, stream):
    """The results of T == 0: numpy when the inputs are, else device arrays."""
    if host:
        return np.zeros(o_shape, np.float32), np.zeros(s_shape, np.float32)
    return device_empty(o_shape, np.float32, stream), device_empty(s_shape, np.float32, stream)


def outputs(out, lse, o_shape, s_shape, stream):
    """Device buffers for out and lse: the caller's (device ones in place, numpy
    ones staged) or new ones."""
    return output_array("out", out, o_shape, stream), output_array("lse", lse, s_shape, stream)


def deliver(host, d_out, d_lse, out, lse, stream):
    """The launch's results as the caller gets them: numpy when the inputs were
    (into the caller's numpy buffers when given), else the device arrays (a
    numpy buffer given with device inputs receives a copy); synchronises when
    ``stream`` is None."""
    result = (d_out, d_lse)
    if host:
        result = tuple(d.copy_to_host(ary=given, stream=stream or 0) if is_host_array(given)
                       else d.copy_to_host(stream=stream or 0)
                       for d, given in ((d_out, out), (d_lse, lse)))
    elif is_host_array(out) or is_host_array(lse):
        result = tuple(d.copy_to_host(ary=given, stream=stream or 0) if is_host_array(given)
                       else d for d, given in ((d_out, out), (d_lse, lse)))
    finish(stream)
    return result
