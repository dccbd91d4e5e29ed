"""Positive controls of the sanitizer stages: one planted defect that each tool must flag.

    compute-sanitizer --tool memcheck  python -m validation.sanitizer_control memcheck
    compute-sanitizer --tool racecheck python -m validation.sanitizer_control racecheck

A sanitizer run that reports 0 errors over the test suite says something only if
the same tool, on the same machine and toolchain, reports the defects it is
there to find in numba kernels. ``validation.gpu_suite --sanitizer`` runs the
matching control first and records in its report whether the tool caught it; a
control that is not caught fails the stage (the tool did not see the kernels,
or the machine's runtime does not support it).

* ``memcheck``: ``oob_write`` is launched with 64 threads over a 32-element
  float32 array and writes ``a[t]`` for every thread: threads 32..63 write the
  128 bytes just past the allocation (numba does not check bounds in device
  code; the simulator does, and raises ``IndexError``, which the test uses to
  show the write is out of bounds).
* ``racecheck``: ``shared_race`` is launched with two warps over 64 shared
  words: thread t writes word t and then, with no barrier between, reads word
  63 - t, which a thread of the other warp writes: read-after-write (or
  write-after-read) hazards between the warps on every word. The read is of
  another address, so the compiler cannot replace it by the value just stored
  (the first form of this control, every thread writing and reading back one
  word, compiled to a store only, and racecheck on an H100 reported 0 hazards:
  ``tests/test_sanitizer_control.py`` now checks the PTX keeps the shared load).

The process exits 0 after the launch; the verdict is the tool's.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import cuda, float32, int32

N = 32  # elements of the memcheck control's array; 2 * N threads write it


@cuda.jit
def oob_write(a):
    """a: [N] float32; launched with 2 * N threads: threads N..2N-1 write past its end."""
    t = cuda.threadIdx.x
    a[t] = float32(t)


RACE_THREADS = 64  # two warps: the racecheck control's block and shared words


@cuda.jit
def shared_race(out):
    """out: [RACE_THREADS] int32; launched with RACE_THREADS threads (two warps)."""
    sm = cuda.shared.array(RACE_THREADS, int32)
    t = cuda.threadIdx.x
    sm[t] = t  # no barrier between this write and the read of another warp's word
    out[t] = sm[RACE_THREADS - 1 - t]


def run(tool):
    """Launch the control of ``tool`` ("memcheck" | "racecheck") and wait for it."""
    if tool == "memcheck":
        a = cuda.to_device(np.zeros(N, np.float32))
        oob_write[1, 2 * N](a)
    elif tool == "racecheck":
        out = cuda.to_device(np.zeros(RACE_THREADS, np.int32))
        shared_race[1, RACE_THREADS](out)
    else:
        raise ValueError(f"tool: expected 'memcheck' or 'racecheck', got {tool!r}")
    cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m validation.sanitizer_control memcheck|racecheck")
    run(sys.argv[1])
    print(f"sanitizer_control: launched the {sys.argv[1]} control")
