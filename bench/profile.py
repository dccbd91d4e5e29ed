"""One fast-decode launch sequence to profile under ncu:

    ncu --clock-control none -k regex:decode_fast --launch-count 2 \
        python3 -m bench.profile float16 4096 [batch]
"""

import math
import sys

import numpy as np
from numba import cuda

from attention import decode_fast as F

from .gpu import random_array
from .run import np_dtype


def main():
    dname = sys.argv[1] if len(sys.argv) > 1 else "float16"
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    b = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    h, kv, d = 32, 8, 128
    dt = np_dtype(dname)
    k, v = random_array((b, kv, seq, d), dt, 1), random_array((b, kv, seq, d), dt, 2)
    q = random_array((b, h, d), np.float32, 3)
    lens = cuda.to_device(np.full(b, seq, np.int32))
    slots = cuda.to_device(np.arange(b, dtype=np.int32))
    out, lse = cuda.device_array((b, h, d), np.float32), cuda.device_array((b, h), np.float32)
    pl = F.plan(b, h, kv, d, seq, F.dtype_kind(dt))
    pa, pm = F.scratch(b, h, d, pl["n_split"])
    for _ in range(3):
        F.launch(pl, q, k, v, lens, slots, np.float32(1 / math.sqrt(d)), out, lse, pa, pm, 0)
    cuda.synchronize()
    print("plan", {k_: v_ for k_, v_ in pl.items() if k_ != "kernel"})


if __name__ == "__main__":
    main()
