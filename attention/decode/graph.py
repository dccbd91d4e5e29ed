"""A decode step with almost no host cost: scatter + attention, captured once.

One decode step over a pooled cache (ARCHITECTURE.md, "Data flow"):

    1. batched KV scatter   cache[slot_table[m], :, positions[m], :] = k_new[m], v_new[m]
    2. lengths              seq_lens[m] = positions[m] + 1   (then positions[m] += 1
                            when ``advance``, so the next step writes the next row)
    3. fast attention       ``attention.decode.fast`` (split-KV kernel + combine)

Capacity: a sequence whose position is outside [0, max_seq) at a step (it has
run past the cache's capacity, or ``positions`` was filled out of range) is
neither written nor attended: its scatter writes nothing, its ``seq_lens`` is
0 (output zeros, LSE -inf), its position does not advance, and the step sets
an error flag on the device (the step itself never syncs with the host, so a
replayed graph stays free of host round trips). ``check()``, and every
``step(sync=True)`` / ``step_plain(sync=True)``, read the flag and raise
``checks.RangeError`` naming the first such sequence and the capacity. Nothing
is clamped. (``attention.decode.state.DecodeBatch``, whose lengths live on the
host, raises before launching instead.)

``DecodeStep`` validates and allocates once, plans the attention for the
cache's full capacity (blocks past a sequence's length exit at once), and
captures the launches as a CUDA graph through cuda.core (a numba launch
accepts a ``GraphBuilder`` where the stream goes). ``step()`` then replays the
graph: one driver call, a few microseconds of host time, however many kernels
the step holds. ``step_plain()`` runs the same launches through numba's
ordinary launch path, for comparison (and where no graph can be built, e.g.
the simulator, ``step()`` falls back to it). ``path`` ("graph" / "plain") and
``fallback_reason`` record which one ``step()`` runs and why; a failed capture
on a GPU emits a ``checks.FallbackWarning`` (``attention.core.graph``). ``pdl``
records whether the combine is a programmatic dependent launch and why
(``attention.core.pdl.status``; inside a graph it is launched plainly).

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

from attention.core import checks
from attention.decode.fast import check_fast, launch, plan, scratch
from attention.core.device import (
    device_empty,
    host_ints,
    is_host_array,
    jit,
    to_device,
    to_host,
)
from attention.core.graph import CapturedLaunches
from attention.cache.scatter import scatter_kernel
from attention.core.pdl import status as pdl_status


# flag[0]: nonzero once a kernel of a step met a position out of capacity since
# the last check (each such kernel adds 1); flag[1]: the smallest such sequence
# index (NO_SEQUENCE when none)
NO_SEQUENCE = np.iinfo(np.int32).max


def clear_flag():
    """The initial (clear) value of the capacity flag: [0, NO_SEQUENCE] int32."""
    return np.array([0, NO_SEQUENCE], np.int32)


@functools.lru_cache(maxsize=None)
def lengths_kernel(advance):
    """``seq_lens[m] = positions[m] + 1``; with ``advance`` also
    ``positions[m] += 1``. A position outside ``[0, max_seq)`` gets
    ``seq_lens[m] = 0``, is not advanced, and raises the flag (``flag[0] += 1``,
    ``flag[1] = min(flag[1], m)``). Grid ceil(M/128), block 128.

    positions [M] int32, seq_lens [M] int32, max_seq int32, flag [2] int32.
    """
    ADVANCE = advance

    def kernel(positions, seq_lens, max_seq, flag):
        m = cuda.grid(1)
        if m < positions.shape[0]:
            pos = positions[m]
            if pos < 0 or pos >= max_seq:
                seq_lens[m] = 0
                cuda.atomic.add(flag, 0, 1)
                cuda.atomic.min(flag, 1, m)
            else:
                seq_lens[m] = pos + 1
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

    ``path`` ("graph" / "plain"), ``fallback_reason`` (None, or why a graph
    was asked for and not built) and ``pdl`` (``{"path", "reason"}`` of the
    combine's launch) record what ``step()`` runs. A position outside
    ``[0, max_seq)`` at a step raises a device flag that ``check()`` (and a
    ``sync=True`` step) turns into ``checks.RangeError`` (module docstring).
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
        self._flag = to_device(clear_flag())
        self._graph = CapturedLaunches(self.enqueue, lambda: self.enqueue(0, advance=False),
                                       enabled=graph, owner="DecodeStep",
                                       plain_call="step_plain()'s launches at every step()")
        self.graph, self.graph_error = self._graph.graph, self._graph.error
        self.path, self.fallback_reason = self._graph.path, self._graph.fallback_reason
        self.pdl = self._pdl_record()

    def _pdl_record(self):
        if self.plan["n_split"] <= 1:
            return {"path": "none", "reason": "one split: no combine launch"}
        record = pdl_status(self.plan["pdl"])
        if record["path"] == "pdl" and self.path == "graph":
            return {"path": "plain", "reason": "step() replays a graph, where the combine "
                                               "is launched plainly (decode_fast.launch)"}
        return record

    # -- the launches of one step, on any stream-like object --
    def enqueue(self, stream, advance=None):
        m_count, _, n_kv, max_seq, _ = self.shape
        adv = self.advance if advance is None else advance
        scatter_kernel(True, checked=True)[(m_count, n_kv), self._threads, stream](
            self.d_k_new, self.d_v_new, self.d_k, self.d_v, self.d_pos, self.d_slots,
            self._flag)
        lengths_kernel(adv)[(m_count + 127) // 128, 128, stream](
            self.d_pos, self.d_lens, np.int32(max_seq), self._flag)
        launch(self.plan, self.d_q, self.d_k, self.d_v, self.d_lens, self.d_slots, self.scale,
               self.out, self.lse, self.d_pa, self.d_pm, stream)

    def step(self, sync=False):
        """Run one step (graph replay when built). ``sync`` waits for it and
        then ``check()``s the capacity."""
        if self.graph is None:
            self.step_plain(sync=sync)
            return
        self._graph.launch(sync)
        if sync:
            self.check()

    def step_plain(self, stream=0, sync=False):
        """The same step through numba's ordinary launches (no graph). ``sync``
        waits for it and then ``check()``s the capacity."""
        self.enqueue(stream)
        if sync:
            cuda.synchronize()
            self.check()

    def check(self):
        """Raise ``checks.RangeError`` if a step since the last check met a
        position outside ``[0, max_seq)`` (that sequence was neither written
        nor attended); clears the flag. Waits for the work queued so far and
        reads two ints from the device."""
        self.synchronize()
        raised, first = (int(x) for x in to_host(self._flag))
        if raised:
            self._flag.copy_to_device(clear_flag())
            max_seq = self.shape[3]
            raise checks.RangeError(
                f"positions: sequence {first} is at position {int(to_host(self.d_pos)[first])}, "
                f"outside the cache's capacity max_seq={max_seq} (positions in [0, {max_seq})) "
                f"at a step since the last check: its row was not written and it attended "
                f"nothing (seq_lens 0)")

    def synchronize(self):
        self._graph.synchronize()
