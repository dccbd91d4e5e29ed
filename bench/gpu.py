"""Device-side helpers for the benchmarks: timing, L2 flush, random fill, ceilings."""

from __future__ import annotations

import statistics

import numpy as np
from numba import cuda, float32, int32, int64

# L2 flush: the H200 has 60 MB of L2. Reading 512 MB (> 8x L2) between
# repeats evicts whatever the timed kernel read last time (~235 us) and leaves
# only clean lines behind. A flush that writes leaves the L2 full of dirty
# lines, which the timed kernel then writes back to memory as it evicts them:
# 8-10 us added to every measurement (H200, notes/bench.md run 12: fp16 B 32
# L 1024 51.5 -> 41.5 us, torch SDPA 45.3 -> 36.7 us; fp16 B 32 L 4096 144.0
# -> 132.7 us, where ncu, which invalidates the L2 before a profiled launch,
# gives 129.3 us).
FLUSH_BYTES = 512 << 20
# Host cover ("hold"): the start event must be reached by the GPU only after
# the host has finished enqueuing the timed work, or the bracket measures host
# time. A numba launch costs 60-100 us of host time, and 120-230 us once torch
# is loaded in the same process (H200 machine, notes/bench.md run 11), so a
# flush alone does not cover it. Before the start event the GPU sleeps for
# ``hold_us`` (one thread, ``nanosleep``); after the work is enqueued the timer
# asks whether the start event has already completed, and if it has in any
# repeat it doubles the hold and measures again.
HOLD_US = 400
HOLD_MAX_US = 40000


@cuda.jit
def _hold_kernel(micros):
    """Keeps the stream busy for about ``micros`` microseconds (one thread)."""
    for _ in range(micros):
        cuda.nanosleep(1000)


@cuda.jit
def _fill_kernel(buf, value):
    """buf [N] int32: every element set to ``value``."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    for j in range(i, buf.shape[0], stride):
        buf[j] = value


@cuda.jit
def _flush_kernel(buf, sink):
    """buf [N] int32 read in full (evicts L2, leaves clean lines); sink [1]
    int32 is written only if the XOR of buf is 0x7FFFFFF1 (never, for the
    zeros it holds: the store keeps the loads from being dropped)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = int32(0)
    for j in range(i, buf.shape[0], stride):
        acc ^= buf[j]
    if acc == int32(0x7FFFFFF1):
        sink[0] = acc


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


class _Cover:
    """The host cover shared by both timers: ``hold_us`` and its doubling."""

    def __init__(self):
        self.hold_us = HOLD_US
        self.raised = []  # (hold before, hold after) each time the cover was short

    def _covered(self, bracket, reps):
        """Median of ``bracket() -> (ms, late)`` over ``reps``, the hold doubled
        and the repeats redone while any of them was late (up to HOLD_MAX_US)."""
        while True:
            times, late = [], False
            for _ in range(reps):
                ms, was_late = bracket()
                times.append(ms)
                late |= was_late
            if not late:
                return statistics.median(times)
            if self.hold_us >= HOLD_MAX_US:  # work that waits for the device itself
                self.raised.append((self.hold_us, "still late: host time measured"))
                return statistics.median(times)
            self.raised.append((self.hold_us, 2 * self.hold_us))
            self.hold_us *= 2


class Timer(_Cover):
    """CUDA-event timing with an L2 flush and a host cover before each repeat.

    ``time(fn)``: median ms of the device work ``fn()`` enqueues on the default
    stream, host cost excluded (see ``HOLD_US``). ``host=True``: no cover, the
    host cost of ``fn`` between the events is part of the time (for public
    launchers that are meant to be timed with their host work).
    """

    def __init__(self):
        self.flush_buf = cuda.device_array(FLUSH_BYTES // 4, np.int32)
        self.sink = cuda.device_array(1, np.int32)
        _fill_kernel[GRID, 256](self.flush_buf, np.int32(0))  # read by every flush
        self.e0, self.e1 = cuda.event(), cuda.event()
        super().__init__()

    def flush(self, stream=0):
        _flush_kernel[GRID, 256, stream](self.flush_buf, self.sink)

    def hold(self, stream=0):
        _hold_kernel[1, 1, stream](np.int32(self.hold_us))

    def time(self, fn, reps=20, warmup=3, flush=True, host=False):
        """Median ms of ``fn()`` (which enqueues work on the default stream)."""
        for _ in range(warmup):
            fn()
        cuda.synchronize()

        def bracket():
            if flush:
                self.flush()
            if not host:
                self.hold()
            self.e0.record()
            fn()
            late = not host and self.e0.query()  # the GPU reached e0 before fn was enqueued
            self.e1.record()
            self.e1.synchronize()
            return cuda.event_elapsed_time(self.e0, self.e1), late

        return self._covered(bracket, reps)

    def time_on_stream(self, fn, handle, reps=20, warmup=3):
        """Median ms of ``fn()``, which enqueues on the stream of int ``handle``
        (e.g. a cuda.core stream replaying a graph): the flush runs on the
        default stream, that stream waits for it, holds, then events on it
        bracket ``fn``."""
        ext = cuda.external_stream(handle)
        flushed = cuda.event(timing=False)
        for _ in range(warmup):
            fn()
        cuda.synchronize()
        ext.synchronize()

        def bracket():
            self.flush()
            flushed.record()
            flushed.wait(ext)
            self.hold(ext)
            self.e0.record(ext)
            fn()
            late = self.e0.query()
            self.e1.record(ext)
            self.e1.synchronize()
            return cuda.event_elapsed_time(self.e0, self.e1), late

        return self._covered(bracket, reps)


class TorchTimer(_Cover):
    """The same protocol for torch work (torch events; the flush reads a
    torch buffer of ``FLUSH_BYTES`` through a sum; the hold is
    ``torch.cuda._sleep`` of ``2000 * hold_us`` cycles, about ``hold_us`` at
    the H200's ~2 GHz, with the same lateness check)."""

    def __init__(self, torch):
        self.torch = torch
        self.buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self.e0 = torch.cuda.Event(enable_timing=True)
        self.e1 = torch.cuda.Event(enable_timing=True)
        super().__init__()

    def time(self, fn, reps=20, warmup=3, host=False):
        """Median ms of ``fn()`` (torch work on the current stream). ``host=True``:
        no cover, the host cost of ``fn`` between the events is part of the
        time, as in ``Timer.time(host=True)``."""
        for _ in range(warmup):
            fn()
        self.torch.cuda.synchronize()

        def bracket():
            self.buf.sum()  # reads the buffer: the L2 is left with clean lines only
            if not host:
                self.torch.cuda._sleep(2000 * self.hold_us)
            self.e0.record()
            fn()
            late = not host and self.e0.query()
            self.e1.record()
            self.e1.synchronize()
            return self.e0.elapsed_time(self.e1), late

        return self._covered(bracket, reps)


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


MATMUL_PEAK_N = 8192
MATMUL_PEAKS = ("tf32", "bf16")


def matmul_flops(n):
    """Flops of one n x n x n matrix product (a multiply and an add a term)."""
    return 2.0 * n ** 3


def torch_matmul_peak(torch, kind, n=MATMUL_PEAK_N, reps=10):
    """Tensor-core peak in TFLOP/s measured by torch matmul on n x n matrices:
    ``kind`` "tf32" (fp32 operands, ``torch.backends.cuda.matmul.allow_tf32``
    on, restored after) or "bf16". Returns (TFLOP/s, ms); ``torch`` must see
    a GPU."""
    if kind not in MATMUL_PEAKS:
        raise ValueError(f"kind: expected one of {MATMUL_PEAKS}, got {kind!r}")
    dt = torch.float32 if kind == "tf32" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.rand((n, n), device="cuda", dtype=torch.float32, generator=g).to(dt)
    b = torch.rand((n, n), device="cuda", dtype=torch.float32, generator=g).to(dt)
    c = torch.empty((n, n), device="cuda", dtype=dt)
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    try:
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):  # compute-bound: no flush, back-to-back is the peak
            e0.record()
            torch.matmul(a, b, out=c)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    ms = statistics.median(times)
    return matmul_flops(n) / (ms * 1e-3) / 1e12, ms
