"""A decode step with almost no host cost: scatter + attention, captured once.

One decode step over a pooled cache (ARCHITECTURE.md, "Data flow"):

    1. batched KV scatter   cache[slot_table[m], :, positions[m], :] = k_new[m], v_new[m]
    2. lengths              seq_lens[m] = positions[m] + 1   (then positions[m] += 1
                            when ``advance``, so the next step writes the next row)
    3. fast attention       ``attention.decode_fast`` (split-KV kernel + combine)

``DecodeStep`` validates and allocates once, plans the attention for the
cache's full capacity (blocks past a sequence's length exit at once), and
captures the launches as a CUDA graph through cuda.core (a numba launch
accepts a ``GraphBuilder`` where the stream goes). ``step()`` then replays the
graph: one driver call, a few microseconds of host time, however many kernels
the step holds. ``step_plain()`` runs the same launches through numba's
ordinary launch path, for comparison (and where no graph can be built, e.g.
the simulator, ``step()`` falls back to it).

Buffers (all device arrays; read or fill them between steps):
    q           [M, H, D]                     float32 or the cache dtype
    k_new       [M, H_kv, D]                  cache dtype
    v_new       [M, H_kv, D]                  cache dtype
    k_cache     [KV_SLOTS, H_kv, max_seq, D]  float32 / float16 / bfloat16
    v_cache     [KV_SLOTS, H_kv, max_seq, D]
    positions   [M] int32 (row written this step, < max_seq)
    slot_table  [M] int32 distinct slots
    seq_lens    [M] int32 (written by the step)
    out         [M, H, D] float32, lse [M, H] float32
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from . import checks
from .decode_fast import check_fast, launch, plan, scratch
from .device import (
    device_empty,
    host_ints,
    is_host_array,
    jit,
    to_device,
)
from .graph import CapturedLaunches
from .kv_cache import scatter_kernel


@functools.lru_cache(maxsize=None)
def lengths_kernel(advance):
    """``seq_lens[m] = min(positions[m] + 1, max_seq)``; with ``advance`` also
    ``positions[m] += 1``. Grid ceil(M/128), block 128.

    positions [M] int32, seq_lens [M] int32, max_seq int32.
    """
    ADVANCE = advance

    def kernel(positions, seq_lens, max_seq):
        m = cuda.grid(1)
        if m < positions.shape[0]:
            pos = positions[m]
            seq_lens[m] = min(pos + 1, max_seq)
            if ADVANCE:
                positions[m] = pos + 1

    kernel.__name__ = kernel.__qualname__ = "decode_step_lengths" + (
        "_advance" if advance else "")
    return jit(kernel)


class DecodeStep:
    """A prebuilt decode step (scatter + lengths + attention) over fixed buffers.

    q [M, H, D]; k_new, v_new [M, H_kv, D]; k_cache, v_cache
    [KV_SLOTS, H_kv, max_seq, D] (float32 / float16 / bfloat16); positions [M]
    int; slot_table [M] int (distinct; default arange(M)). numpy inputs are
    copied to the device once; device arrays are used in place (the step
    writes the caches, ``positions`` when ``advance``, ``seq_lens``, ``out``
    and ``lse``). ``graph=False`` never builds a graph.
    """

    def __init__(self, q, k_new, v_new, k_cache, v_cache, positions, slot_table=None, *,
                 scale=None, advance=True, n_split=None, graph=True):
        n_slots, n_kv, max_seq, head_dim = checks.check_array(
            "k_cache", k_cache,
            (("KV_SLOTS", None), ("H_kv", None), ("max_seq", None), ("D", None)))
        if not hasattr(q, "shape") or len(q.shape) != 3 or int(q.shape[0]) == 0:
            raise checks.ShapeError(f"q: expected shape [M>=1, H, D], got "
                                    f"{tuple(getattr(q, 'shape', ()))}")
        m_count = int(q.shape[0])
        # q / caches / slots follow attention's own rules
        _, n_heads, _, _, _, kind, _, slots = check_fast(
            q, k_cache, v_cache, np.zeros(m_count, np.int32), slot_table)
        slots = checks.check_slot_table(slots, m_count, n_slots, distinct=True)
        for name, rows in (("k_new", k_new), ("v_new", v_new)):
            checks.check_array(name, rows, (("M", m_count), ("H_kv", n_kv), ("D", head_dim)),
                               dtypes=(checks._dtype(k_cache),))
        # positions: rows written this step, 0 <= pos < max_seq
        pos = checks.check_lengths("positions", host_ints(positions), max_seq - 1,
                                   count=m_count)
        if not (is_host_array(positions) or isinstance(positions, (list, tuple))):
            checks.check_array("positions", positions, (("M", m_count),), dtypes=(np.int32,))
        self.scale = checks.check_scale(scale, head_dim)
        self.shape = (m_count, n_heads, n_kv, max_seq, head_dim)
        self.d_q = to_device(q, None)
        self.d_k_new, self.d_v_new = to_device(k_new, None), to_device(v_new, None)
        self.d_k, self.d_v = to_device(k_cache, None), to_device(v_cache, None)
        # a device positions array is used (and advanced) in place
        self.d_pos = (to_device(pos) if is_host_array(positions) or
                      isinstance(positions, (list, tuple)) else to_device(positions))
        self.d_slots = to_device(slots)
        self.d_lens = device_empty((m_count,), np.int32)
        self.out = device_empty((m_count, n_heads, head_dim), np.float32)
        self.lse = device_empty((m_count, n_heads), np.float32)
        self.plan = plan(m_count, n_heads, n_kv, head_dim, max_seq, kind, n_split=n_split)
        self.d_pa, self.d_pm = scratch(m_count, n_heads, head_dim, self.plan["n_split"])
        self.advance = bool(advance)
        self._threads = int(min(128, max(32, (head_dim + 31) // 32 * 32)))
        self._graph = CapturedLaunches(self.enqueue, lambda: self.enqueue(0, advance=False),
                                       enabled=graph)
        self.graph, self.graph_error = self._graph.graph, self._graph.error

    # -- the launches of one step, on any stream-like object --
    def enqueue(self, stream, advance=None):
        m_count, _, n_kv, max_seq, _ = self.shape
        adv = self.advance if advance is None else advance
        scatter_kernel(True)[(m_count, n_kv), self._threads, stream](
            self.d_k_new, self.d_v_new, self.d_k, self.d_v, self.d_pos, self.d_slots)
        lengths_kernel(adv)[(m_count + 127) // 128, 128, stream](
            self.d_pos, self.d_lens, np.int32(max_seq))
        launch(self.plan, self.d_q, self.d_k, self.d_v, self.d_lens, self.d_slots, self.scale,
               self.out, self.lse, self.d_pa, self.d_pm, stream)

    def step(self, sync=False):
        """Run one step (graph replay when built). ``sync`` waits for it."""
        if self.graph is None:
            self.step_plain(sync=sync)
            return
        self._graph.launch(sync)

    def step_plain(self, stream=0, sync=False):
        """The same step through numba's ordinary launches (no graph)."""
        self.enqueue(stream)
        if sync:
            cuda.synchronize()

    def synchronize(self):
        self._graph.synchronize()
