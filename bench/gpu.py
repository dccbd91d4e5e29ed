"""Device-side helpers for the benchmarks: timing, L2 flush, random fill, ceilings."""

from __future__ import annotations

import statistics

import numpy as np
from numba import cuda, float32, int64

# L2 flush: the H200 has 60 MB of L2. Writing 512 MB (> 2x L2) between
# repeats evicts whatever the timed kernel read last time, and the write takes
# ~120 us, longer than a numba launch's host cost, so the start event that is
# enqueued behind it never waits on the host (the GPU is still busy flushing
# while the timed launch is prepared).
FLUSH_BYTES = 512 << 20


@cuda.jit
def _flush_kernel(buf, value):
    """buf [N] int32: every element written (evicts L2)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    for j in range(i, buf.shape[0], stride):
        buf[j] = value


@cuda.jit(device=True, inline="always")
def _hash32(j, seed):
    """A 32-bit mix of index ``j`` and ``seed`` (multiply-xorshift), as int64."""
    h = (int64(j) * 2654435761 + seed) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


@cuda.jit
def _hash_fill_f32(a, seed):
    """a [N] float32: uniform in [-1, 1) from a hash of the index."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    for j in range(i, a.shape[0], stride):
        h = _hash32(j, seed)
        a[j] = float32(h) * float32(2.0 / 4294967296.0) - float32(1.0)


@cuda.jit
def _hash_fill_bits16(a, seed, exp_lo, mant_bits):
    """a [N] uint16 holding fp16 / bf16 bit patterns: random sign, exponent
    exp_lo or exp_lo+1 (values of size 0.25..1), random mantissa."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    for j in range(i, a.shape[0], stride):
        h = _hash32(j, seed)
        sign = h & 1
        e = exp_lo + ((h >> 1) & 1)
        mant = (h >> 2) & ((1 << mant_bits) - 1)
        a[j] = (sign << 15) | (e << mant_bits) | mant


@cuda.jit(fastmath=True)
def _fma_kernel(out, iters):
    """FMA-bound: 8 independent fp32 FMA chains per thread; out [threads] float32."""
    i = cuda.grid(1)
    b = float32(0.9999)
    c = float32(1e-4)
    a0 = float32(i) * float32(1e-9)
    a1 = a0 + float32(1.0)
    a2 = a0 + float32(2.0)
    a3 = a0 + float32(3.0)
    a4 = a0 + float32(4.0)
    a5 = a0 + float32(5.0)
    a6 = a0 + float32(6.0)
    a7 = a0 + float32(7.0)
    for _ in range(iters):
        for _r in range(4):  # 32 FMAs per loop trip: loop overhead out of the way
            a0 = a0 * b + c
            a1 = a1 * b + c
            a2 = a2 * b + c
            a3 = a3 * b + c
            a4 = a4 * b + c
            a5 = a5 * b + c
            a6 = a6 * b + c
            a7 = a7 * b + c
    if i < out.shape[0]:
        out[i] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7


GRID = 132 * 16


class Timer:
    """CUDA-event timing on the default stream with an L2 flush before each repeat."""

    def __init__(self):
        self.flush_buf = cuda.device_array(FLUSH_BYTES // 4, np.int32)
        self.e0, self.e1 = cuda.event(), cuda.event()
        self._n = 0

    def flush(self):
        self._n += 1
        _flush_kernel[GRID, 256](self.flush_buf, np.int32(self._n))

    def time(self, fn, reps=20, warmup=3, flush=True):
        """Median ms of ``fn()`` (which enqueues work on the default stream)."""
        for _ in range(warmup):
            fn()
        cuda.synchronize()
        times = []
        for _ in range(reps):
            if flush:
                self.flush()
            self.e0.record()
            fn()
            self.e1.record()
            self.e1.synchronize()
            times.append(cuda.event_elapsed_time(self.e0, self.e1))
        return statistics.median(times)


    def time_on_stream(self, fn, handle, reps=20, warmup=3):
        """Median ms of ``fn()``, which enqueues on the stream of int ``handle``
        (e.g. a cuda.core stream replaying a graph): the flush runs and finishes
        on the default stream first, then events on that stream bracket ``fn``."""
        ext = cuda.external_stream(handle)
        for _ in range(warmup):
            fn()
        cuda.synchronize()
        ext.synchronize()
        times = []
        for _ in range(reps):
            self.flush()
            cuda.synchronize()
            self.e0.record(ext)
            fn()
            self.e1.record(ext)
            self.e1.synchronize()
            times.append(cuda.event_elapsed_time(self.e0, self.e1))
        return statistics.median(times)


class TorchTimer:
    """The same protocol for torch work (torch events, torch flush buffer)."""

    def __init__(self, torch):
        self.torch = torch
        self.buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self.e0 = torch.cuda.Event(enable_timing=True)
        self.e1 = torch.cuda.Event(enable_timing=True)

    def time(self, fn, reps=20, warmup=3):
        for _ in range(warmup):
            fn()
        self.torch.cuda.synchronize()
        times = []
        for i in range(reps):
            self.buf.fill_(i)
            self.e0.record()
            fn()
            self.e1.record()
            self.e1.synchronize()
            times.append(self.e0.elapsed_time(self.e1))
        return statistics.median(times)


def random_array(shape, dtype, seed):
    """A device array of ``shape`` / ``dtype`` (float32, float16 or bfloat16)
    filled on the device with hashed pseudo-random values of size <= 1."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt == np.float32:
        a = cuda.device_array(n, np.float32)
        _hash_fill_f32[GRID, 256](a, np.int64(seed))
        return a.reshape(shape)
    bits = cuda.device_array(n, np.uint16)
    if dt == np.float16:
        _hash_fill_bits16[GRID, 256](bits, np.int64(seed), np.int64(13), np.int64(10))
    else:  # bfloat16
        _hash_fill_bits16[GRID, 256](bits, np.int64(seed), np.int64(125), np.int64(7))
    return bits.view(dt).reshape(shape)


def copy_bandwidth(timer, nbytes=4 << 30):
    """Device-to-device copy ceiling in GB/s (bytes read + bytes written)."""
    src = cuda.device_array(nbytes // 4, np.float32)
    dst = cuda.device_array(nbytes // 4, np.float32)
    _hash_fill_f32[GRID, 256](src, np.int64(1))
    ms = timer.time(lambda: dst.copy_to_device(src), reps=10)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9, ms


def fma_peak(timer, iters=1024):
    """fp32 FMA peak in TFLOP/s: 2 flops x 8 chains x 4 x iters per thread."""
    blocks, threads = 132 * 32, 256
    out = cuda.device_array(blocks * threads, np.float32)
    ms = timer.time(lambda: _fma_kernel[blocks, threads](out, np.int32(iters)), reps=10,
                    flush=False)
    flops = 2.0 * 8 * 4 * iters * blocks * threads
    return flops / (ms * 1e-3) / 1e12, ms
