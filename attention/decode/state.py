"""Batched decode state: pooled KV caches, per-sequence lengths, a done mask.

``DecodeBatch`` is one layer's decode-time state for M sequences:

* ``k_cache``, ``v_cache``: device ``[KV_SLOTS, H_kv, max_seq, D]`` pools;
  sequence ``m`` lives in slot ``slot_table[m]`` (distinct slots; slots not
  in the table are never read or written);
* ``lengths``: host int32 ``[M]``, positions cached per sequence;
* ``done``: host bool ``[M]``; a finished sequence is given length 0 by the
  kernels: it is neither read nor written and its output is zeros (LSE -inf).

``step(q, k_new, v_new)`` is one decode step: scatter each live sequence's new
K/V row at position ``lengths[m]``, attend over ``lengths[m] + 1`` positions,
advance ``lengths``. A step that would run a live sequence past ``max_seq``
raises ``checks.RangeError`` before anything is written.

Planted defects (``defect=``, falsification suite only): the state's own
"length_not_advanced" (lengths stay put after a step) and "done_slot_read"
(finished sequences keep their length for the kernel); any defect of the
attention kernels (``attention.reference.warp_decode.KERNEL_DEFECTS``) or of the scatter
(``attention.cache.scatter.SCATTER_DEFECTS``) is passed on to that kernel.
"""

from __future__ import annotations

import numpy as np

from attention.core import checks
from attention.reference.warp_decode import KERNEL_DEFECTS
from attention.core.device import (
    device_fill,
    finish,
    host_ints,
    is_host_array,
    launch_stream,
    to_device,
)
from attention.reference.split_decode import decode
from attention.cache.scatter import SCATTER_DEFECTS, _threads, scatter_kernel

STATE_DEFECTS = ("length_not_advanced", "done_slot_read")
ALL_DEFECTS = KERNEL_DEFECTS + SCATTER_DEFECTS + STATE_DEFECTS
STATE_DTYPES = (np.float32,)


class DecodeBatch:
    """Decode state of M sequences over pooled caches (see module docstring).

    m, n_heads, n_kv_heads, head_dim, max_seq: the batch and cache geometry
    kv_slots:   cache slots (default M; must be >= M)
    slot_table: [M] distinct ints in [0, kv_slots) (default ``arange(M)``)
    dtype:      cache dtype (float32)
    method:     attention path: "warp", "split", "fast" or "auto" (``attention.reference.split_decode.decode``)
    fill:       initial value of every cache element (NaN makes stray reads visible)
    defect:     planted defect (falsification suite only)
    """

    def __init__(self, m, n_heads, n_kv_heads, head_dim, max_seq, *, kv_slots=None,
                 slot_table=None, dtype=np.float32, method="warp", fill=0.0, defect=None,
                 split_chunk=None):
        for name, value, lo in (("m", m, 1), ("n_heads", n_heads, 1),
                                ("n_kv_heads", n_kv_heads, 1), ("max_seq", max_seq, 1)):
            if not isinstance(value, (int, np.integer)) or value < lo:
                raise checks.RangeError(f"{name}: expected an int >= {lo}, got {value!r}")
        checks.check_head_dim("head_dim", int(head_dim))
        checks.check_heads(int(n_heads), int(n_kv_heads), q_name="n_heads", kv_name="n_kv_heads")
        kv_slots = int(m) if kv_slots is None else kv_slots
        if not isinstance(kv_slots, (int, np.integer)) or kv_slots < m:
            raise checks.RangeError(f"kv_slots: expected an int >= M={m}, got {kv_slots!r}")
        if np.dtype(dtype) not in [np.dtype(d) for d in STATE_DTYPES]:
            raise checks.DTypeError(f"dtype: expected float32, got {np.dtype(dtype)}")
        if method not in ("warp", "split", "fast", "auto"):
            raise checks.AttentionInputError(
                f"method: expected 'warp', 'split', 'fast' or 'auto', got {method!r}")
        if defect not in (None,) + ALL_DEFECTS:
            raise ValueError(f"defect: expected one of {ALL_DEFECTS} or None, got {defect!r}")
        self.m, self.n_heads, self.n_kv_heads = int(m), int(n_heads), int(n_kv_heads)
        self.head_dim, self.max_seq, self.kv_slots = int(head_dim), int(max_seq), int(kv_slots)
        self.dtype = np.dtype(dtype)
        self.method = method
        self.split_chunk = split_chunk
        self.defect = defect
        self.slot_table = checks.check_slot_table(
            None if slot_table is None else host_ints(slot_table), self.m, self.kv_slots,
            distinct=True)
        self._d_slots = to_device(self.slot_table)
        shape = (self.kv_slots, self.n_kv_heads, self.max_seq, self.head_dim)
        self.k_cache = device_fill(shape, self.dtype, fill)
        self.v_cache = device_fill(shape, self.dtype, fill)
        self.lengths = np.zeros(self.m, np.int32)
        self.done = np.zeros(self.m, bool)

    # -- seeding the cache -------------------------------------------------

    @property
    def cache_shape(self):
        return (self.kv_slots, self.n_kv_heads, self.max_seq, self.head_dim)

    def load(self, k_cache, v_cache, lengths):
        """Replace the caches' contents and set the lengths (all sequences live).

        k_cache, v_cache: [KV_SLOTS, H_kv, max_seq, D] of the state's dtype
        (numpy or device); lengths: [M] ints in [0, max_seq].
        """
        dims = tuple(zip(("KV_SLOTS", "H_kv", "max_seq", "D"), self.cache_shape))
        checks.check_array("k_cache", k_cache, dims, dtypes=(self.dtype,))
        checks.check_array("v_cache", v_cache, dims, dtypes=(self.dtype,))
        lens = checks.check_lengths("lengths", host_ints(lengths), self.max_seq, count=self.m)
        for mine, given in ((self.k_cache, k_cache), (self.v_cache, v_cache)):
            mine.copy_to_device(given if is_host_array(given) else to_device(given))
        self.lengths = lens.copy()
        self.done = np.zeros(self.m, bool)
        return self

    def prefill(self, k, v, lengths):
        """Write positions ``0..lengths[m]-1`` of each sequence's slot.

        k, v: host [M, H_kv, L, D] arrays of the state's dtype with
        L >= max(lengths); lengths: [M] ints in [0, max_seq]. Other positions
        and slots are left as they are.
        """
        lens = checks.check_lengths("lengths", host_ints(lengths), self.max_seq, count=self.m)
        longest = int(lens.max()) if lens.size else 0
        for name, x in (("k", k), ("v", v)):
            shape = checks.check_array(
                name, x, (("M", self.m), ("H_kv", self.n_kv_heads), ("L", None),
                          ("D", self.head_dim)), dtypes=(self.dtype,))
            if shape[2] < longest:
                raise checks.ShapeError(
                    f"{name}: expected at least L={longest} positions (the longest length), "
                    f"got {shape[2]}")
        k, v = np.asarray(k), np.asarray(v)
        for m in range(self.m):
            slot, length = int(self.slot_table[m]), int(lens[m])
            if length == 0:
                continue
            for g in range(self.n_kv_heads):
                self.k_cache[slot, g, :length].copy_to_device(
                    np.ascontiguousarray(k[m, g, :length]))
                self.v_cache[slot, g, :length].copy_to_device(
                    np.ascontiguousarray(v[m, g, :length]))
        self.lengths = lens.copy()
        self.done = np.zeros(self.m, bool)
        return self

    # -- lifecycle ---------------------------------------------------------

    def finish(self, m):
        """Mark sequence ``m`` done: from now on it is neither read nor written."""
        checks.check_range("m", int(m), 0, self.m - 1, what="sequence index")
        self.done[int(m)] = True

    def restart(self, m, length=0):
        """Make sequence ``m`` live again with ``length`` cached positions."""
        checks.check_range("m", int(m), 0, self.m - 1, what="sequence index")
        checks.check_range("length", int(length), 0, self.max_seq, what="length")
        self.done[int(m)] = False
        self.lengths[int(m)] = int(length)

    def kernel_lengths(self, extra=0):
        """Per-sequence lengths the kernels see: ``lengths + extra``, 0 when done."""
        if self.defect == "done_slot_read":
            return (self.lengths + np.where(self.done, 0, extra)).astype(np.int32)
        return np.where(self.done, 0, self.lengths + extra).astype(np.int32)

    # -- one decode step ---------------------------------------------------

    def step(self, q, k_new, v_new, *, return_lse=False, stream=None):
        """Scatter this token's K/V, attend, advance.

        q:            [M, H, D] float32
        k_new, v_new: [M, H_kv, D] of the cache dtype (rows of done sequences
                      are ignored)
        Returns out [M, H, D] (and lse [M, H]): numpy when q is numpy. Done
        sequences get zeros (LSE -inf).
        """
        checks.check_array("q", q, (("M", self.m), ("H", self.n_heads), ("D", self.head_dim)),
                           dtypes=(np.float32,))
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            checks.check_array(name, x, (("M", self.m), ("H_kv", self.n_kv_heads),
                                         ("D", self.head_dim)), dtypes=(self.dtype,))
        live = ~self.done
        full = live & (self.lengths >= self.max_seq)
        if full.any():
            m = int(np.flatnonzero(full)[0])
            raise checks.RangeError(
                f"step: sequence {m} already holds max_seq={self.max_seq} positions; "
                f"another token does not fit (nothing was written)")

        # -- scatter: live rows at their length; done rows get position max_seq,
        #    which the scatter kernel skips --
        positions = np.where(live, self.lengths, self.max_seq).astype(np.int32)
        st = launch_stream(stream)
        scatter_defect = self.defect if self.defect in SCATTER_DEFECTS else None
        scatter_kernel(True, scatter_defect)[(self.m, self.n_kv_heads),
                                             _threads(self.head_dim), st](
            to_device(k_new, stream), to_device(v_new, stream), self.k_cache, self.v_cache,
            to_device(positions, stream), self._d_slots)

        # -- attend over length + 1 positions (0 for done sequences) --
        kernel_defect = self.defect if self.defect in KERNEL_DEFECTS else None
        extra = {} if self.split_chunk is None or self.method == "warp" \
            else {"chunk": self.split_chunk}
        result = decode(q, self.k_cache, self.v_cache, self.kernel_lengths(extra=1),
                        self.slot_table, method=self.method, stream=stream,
                        return_lse=return_lse, defect=kernel_defect, **extra)

        # -- advance --
        if self.defect != "length_not_advanced":
            self.lengths = np.where(live, self.lengths + 1, self.lengths).astype(np.int32)
        finish(stream)
        return result
