"""Argument validation shared by every launcher in this project.

Every launcher validates *before* it allocates, copies or launches anything,
so bad input leaves caches untouched. Errors are ``ValueError`` subclasses
(``AttentionInputError`` and below) whose message names the argument and what
was expected, e.g. ``k_cache: expected shape [H_kv=2, max_seq, D=40], got
(2, 16, 41)``.

A launcher that takes a slower path than the one asked for (a CUDA graph that
could not be captured, a GEMM scratch too large for the fast path) says so
with a ``FallbackWarning`` naming the path taken, why, and how to avoid it.
"""

from __future__ import annotations

import numpy as np

MAX_HEAD_DIM = 256


class AttentionInputError(ValueError):
    """Base class: an argument does not fit the kernel's contract."""


class ShapeError(AttentionInputError):
    """Wrong number of dimensions or wrong extents."""


class DTypeError(AttentionInputError):
    """Unsupported or mismatched element type."""


class LayoutError(AttentionInputError):
    """Not C-contiguous where the kernel indexes rows directly."""


class RangeError(AttentionInputError):
    """A length, position, head count or head size out of range."""


class FallbackWarning(UserWarning):
    """A slower path was taken than the one asked for (more than 2x slower):
    the message names the path, the reason and how to avoid it."""


def _shape(x):
    return tuple(int(s) for s in x.shape)


def _dtype(x):
    dt = x.dtype
    try:
        return np.dtype(dt)
    except TypeError:
        # torch dtypes and the like: go through their string name
        return np.dtype(str(dt).replace("torch.", ""))


def _is_c_contiguous(x):
    if hasattr(x, "flags"):
        flags = x.flags
        try:
            return bool(flags["C_CONTIGUOUS"])
        except (TypeError, KeyError):
            return bool(getattr(flags, "c_contiguous", True))
    if hasattr(x, "is_contiguous"):
        return bool(x.is_contiguous())
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        strides = cai.get("strides")
        if strides is None:
            return True
        expected = np.dtype(cai["typestr"]).itemsize
        for extent, stride in zip(reversed(cai["shape"]), reversed(strides)):
            if extent > 1 and stride != expected:
                return False
            expected *= extent
        return True
    return True


def dim_names(names):
    return ", ".join(names)


def check_array(name, x, dims, *, dtypes=None, contiguous=True):
    """Check ``x`` against ``dims``: a tuple of (label, extent-or-None).

    ``extent`` None accepts any size (the label names it in the message).
    Returns the concrete shape.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise DTypeError(f"{name}: expected an array, got {type(x).__name__}")
    shape = _shape(x)
    want = "[" + ", ".join(
        label if extent is None else f"{label}={extent}" for label, extent in dims
    ) + "]"
    if len(shape) != len(dims) or any(
        extent is not None and s != extent for s, (_, extent) in zip(shape, dims)
    ):
        raise ShapeError(f"{name}: expected shape {want}, got {shape}")
    if dtypes is not None:
        dt = _dtype(x)
        allowed = [np.dtype(d) for d in dtypes]
        if dt not in allowed:
            raise DTypeError(
                f"{name}: expected dtype {' or '.join(str(a) for a in allowed)}, got {dt}"
            )
    if contiguous and not _is_c_contiguous(x):
        raise LayoutError(f"{name}: expected a C-contiguous array of shape {want}")
    return shape


def device_address(x):
    """The data address of a device array (``__cuda_array_interface__``), or
    None for anything else (host arrays are copied into fresh, aligned memory)."""
    cai = getattr(x, "__cuda_array_interface__", None)
    if not isinstance(cai, dict) or not cai.get("data"):
        return None
    return int(cai["data"][0])


def check_aligned(name, x, nbytes):
    """A device array ``x`` must start at a multiple of ``nbytes``: a kernel
    reads its rows with vector loads of that size, which fault on any other
    address (a view that starts mid-row, say)."""
    addr = device_address(x)
    if addr is not None and addr % nbytes:
        raise LayoutError(f"{name}: expected a device address aligned to {nbytes} bytes "
                          f"(vector loads), got {addr:#x}")


def check_same_dtype(names_and_arrays):
    dts = [(n, _dtype(a)) for n, a in names_and_arrays]
    first_name, first = dts[0]
    for n, dt in dts[1:]:
        if dt != first:
            raise DTypeError(f"{n}: expected dtype {first} (as {first_name}), got {dt}")


def check_range(name, value, lo, hi, what="value"):
    """``lo <= value <= hi`` (inclusive), else RangeError naming the bounds."""
    if not (lo <= value <= hi):
        raise RangeError(f"{name}: expected {what} in [{lo}, {hi}], got {value}")


def check_heads(n_heads, n_kv_heads, q_name="q", kv_name="k_cache"):
    """``n_heads`` (H, of ``q_name``) and ``n_kv_heads`` (H_kv, of ``kv_name``)
    at least 1, and H_kv dividing H; the error names the array at fault."""
    if n_heads < 1:
        raise RangeError(f"{q_name}: expected at least one query head, got H={n_heads}")
    if n_kv_heads < 1:
        raise RangeError(f"{kv_name}: expected at least one kv head, got H_kv={n_kv_heads}")
    if n_heads % n_kv_heads:
        raise RangeError(
            f"{kv_name}: H_kv={n_kv_heads} must divide the {n_heads} query heads of {q_name}"
        )


def check_head_dim(name, d, hi=MAX_HEAD_DIM):
    check_range(name, d, 1, hi, what="head_dim")


def check_scale(scale, head_dim):
    """Default ``1/sqrt(D)``; a given scale must be finite and positive."""
    if scale is None:
        return float(1.0 / np.sqrt(head_dim))
    scale = float(scale)
    if not np.isfinite(scale) or scale <= 0:
        raise RangeError(f"scale: expected a finite positive number, got {scale}")
    return scale


def check_lengths(name, lengths, max_seq, count=None):
    """Per-sequence lengths: ints, ``0 <= len <= max_seq``. Returns int32 host copy."""
    if lengths is None:
        raise DTypeError(f"{name}: expected an integer array of shape [M={count}], got None")
    arr = np.asarray(lengths)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or (count is not None and arr.shape[0] != count):
        raise ShapeError(f"{name}: expected shape [M={count}], got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DTypeError(f"{name}: expected integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > max_seq):
        bad = int(arr[(arr < 0) | (arr > max_seq)][0])
        raise RangeError(f"{name}: expected lengths in [0, max_seq={max_seq}], got {bad}")
    return arr.astype(np.int32)


def check_slot_table(slot_table, count, n_slots, *, distinct=False):
    """``slot_table[m]`` in ``[0, n_slots)``; ``distinct`` forbids a slot used twice
    (writers need it: two sequences scattering into one slot would race).
    Returns an int32 host copy."""
    if slot_table is None:
        return np.arange(count, dtype=np.int32)
    arr = np.asarray(slot_table)
    if arr.ndim != 1 or arr.shape[0] != count:
        raise ShapeError(f"slot_table: expected shape [M={count}], got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DTypeError(f"slot_table: expected integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= n_slots):
        bad = int(arr[(arr < 0) | (arr >= n_slots)][0])
        raise RangeError(f"slot_table: expected slots in [0, KV_SLOTS={n_slots}), got {bad}")
    if distinct and len(np.unique(arr)) != arr.size:
        raise RangeError("slot_table: expected distinct slots, got a slot used twice")
    return arr.astype(np.int32)
