"""Decode-step benchmark: one ``attention.decode.step.DecodeState`` step, eager and graph.

Shape: B 32, H 32, H_kv 8, D 128, every sequence at L 4096 cached positions
(a step appends row L and attends L + 1), caches of capacity L + 512 in
float16 and float32. A step is the state's three launches (prepare, KV
scatter, fast attention with its combine when split), either launched through
numba (``mode="eager"``) or replayed as one CUDA graph (``mode="graph"``).
The lengths are set back to L before each measurement, so every timed step
attends L + 1 .. L + 512 positions.

Columns (``COLUMNS``; a row a (dtype, path)):

* ``host_us_per_step``: host time of one ``step()`` call on an idle queue
  (synchronised before each call), median of 50: what the step costs the
  caller's thread.
* ``device_us_per_step``: the step's device time, CUDA events around one step
  with the L2 flushed and the host's enqueuing covered by a hold before the
  start event (``bench.gpu.Timer``; the graph on its replay stream through
  ``time_on_stream``), median of 20: the kernels alone.
* ``wall_us_per_step``: steps back to back, events around 200 of them
  (device-bound where the host cost is below the device time, host-bound
  where it is above).
* ``max_err``: after the timing, one step compared with the float64 oracle
  for sequence 0 (``attention.oracle.decode_attention_ref``).

``bench_decode_step(rows, log)`` appends the rows and returns them; it needs a
GPU (``bench.gpu`` compiles its helper kernels at import).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

SHAPE = dict(batch=32, heads=32, kv_heads=8, head_dim=128, length=4096)
HEADROOM = 512  # capacity past L: the steps a measurement may take before a reset
DTYPES = ("float16", "float32")
MODES = ("eager", "graph")
COLUMNS = ["path", "dtype", "batch", "heads", "kv_heads", "head_dim", "length", "capacity",
           "host_us_per_step", "device_us_per_step", "wall_us_per_step", "graph",
           "fallback_reason", "n_split", "max_err"]


def _state(dtype, mode, shape, seed):
    from attention.decode.step import DecodeState

    from .gpu import random_array

    b, h, kv, d, length = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim",
                                               "length"))
    cap = length + HEADROOM
    dt = np.dtype(dtype)
    k = random_array((b, kv, cap, d), dt, seed)
    v = random_array((b, kv, cap, d), dt, seed + 1)
    st = DecodeState(b, h, kv, d, cap, dtype=dt, mode=mode, k_cache=k, v_cache=v)
    st.q.copy_to_device(random_array((b, h, d), np.float32, seed + 2))
    st.k_new.copy_to_device(random_array((b, kv, d), dt, seed + 3))
    st.v_new.copy_to_device(random_array((b, kv, d), dt, seed + 4))
    st.set_lengths(np.full(b, length, np.int32))
    return st


def _spot_check(st, length):
    """max |out - oracle| of sequence 0 after one more step from length L."""
    from attention.core.device import to_host
    from attention.oracle import decode_attention_ref

    st.set_lengths(np.full(st.m, length, np.int32))
    st.step(sync=True)
    slot = int(st.slot_table[0])
    kk = np.asarray(to_host(st.k_cache[slot:slot + 1]), np.float64)
    vv = np.asarray(to_host(st.v_cache[slot:slot + 1]), np.float64)
    q = to_host(st.q)[0:1]
    ref, _ = decode_attention_ref(q, kk, vv, [length + 1])
    return float(np.abs(to_host(st.out)[0:1] - ref).max())


def bench_decode_step(rows=None, log=print, *, dtypes=DTYPES, modes=MODES, shape=None,
                      timer=None):
    """Time one decode step in each mode and dtype (module docstring); returns
    ``rows`` (a list of dicts with ``COLUMNS``) with the new rows appended."""
    from numba import cuda

    from .gpu import Timer

    rows = [] if rows is None else rows
    shape = dict(SHAPE, **(shape or {}))
    timer = timer or Timer()
    length = shape["length"]
    for dname in dtypes:
        for mode in modes:
            st = _state(dname, mode, shape, seed=31)
            log(f"  step {dname} {mode}: path {st.path}"
                + (f" (fallback: {st.fallback_reason})" if st.fallback_reason else "")
                + f", n_split {st.n_split}, combine launch: {st.pdl['path']} "
                  f"({st.pdl['reason']})")
            st.check()
            # host cost: one call at a time on an idle queue (median)
            for _ in range(5):
                st.step()
            host = []
            for _ in range(50):
                st.synchronize()
                t0 = time.perf_counter()
                st.step()
                host.append((time.perf_counter() - t0) * 1e6)
            host_us = statistics.median(host)
            # device time: the kernels alone (L2 flushed, host covered)
            st.synchronize()
            st.set_lengths(np.full(st.m, length, np.int32))
            if st.graph is not None:
                dev_ms = timer.time_on_stream(st.step, st._graph.stream_handle)
            else:
                dev_ms = timer.time(st.step)
            # back to back: events on the default stream (a graph replay stream is
            # blocking, so the default stream's events bracket its replays)
            st.synchronize()
            st.set_lengths(np.full(st.m, length, np.int32))
            n = 200
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            for _ in range(n):
                st.step()
            e1.record()
            st.synchronize()
            e1.synchronize()
            wall_us = cuda.event_elapsed_time(e0, e1) / n * 1e3
            st.check()  # no step ran past the capacity
            err = _spot_check(st, length)
            rows.append({"path": mode if st.path == mode else f"{mode}->{st.path}",
                         "dtype": dname, "batch": shape["batch"], "heads": shape["heads"],
                         "kv_heads": shape["kv_heads"], "head_dim": shape["head_dim"],
                         "length": length, "capacity": st.max_seq,
                         "host_us_per_step": round(host_us, 2),
                         "device_us_per_step": round(dev_ms * 1e3, 2),
                         "wall_us_per_step": round(wall_us, 2),
                         "graph": st.graph is not None, "fallback_reason": st.fallback_reason,
                         "n_split": st.n_split, "max_err": err})
            log(f"    host {host_us:8.2f} us/step (median, idle queue), device "
                f"{dev_ms * 1e3:8.2f} us/step, back-to-back {wall_us:8.2f} us/step, "
                f"max err {err:.2e}")
            del st
    return rows


def summary_lines(rows):
    """Markdown lines of the step table."""
    if not rows:
        return []
    r0 = rows[0]
    lines = ["", f"## Decode step (prepare + scatter + attention; B {r0['batch']}, H "
                 f"{r0['heads']}, H_kv {r0['kv_heads']}, D {r0['head_dim']}, L {r0['length']})",
             "", "Host: one step() on an idle queue (median); device: events around one step, "
             "L2 flushed, host covered; back to back: 200 steps in a row.", "",
             "| cache | path | host us / step | device us / step | back-to-back us / step "
             "| max err |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['path']} | {r['host_us_per_step']:.2f} | "
                     f"{r['device_us_per_step']:.2f} | {r['wall_us_per_step']:.2f} | "
                     f"{r['max_err']:.2e} |")
    return lines


if __name__ == "__main__":
    for line in summary_lines(bench_decode_step()):
        print(line)
