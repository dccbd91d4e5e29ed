"""Time the 16-bit prefill (fp16, causal, H 32 / H_kv 8 / D 128) at several (warps, block_n)."""
import math, sys
import numpy as np
from numba import cuda
from attention.prefill import mma
from bench.gpu import Timer
from bench.prefill_mma import _inputs, prefill_flops
timer = Timer()
heads, kv, d = 32, 8, int(sys.argv[2]) if len(sys.argv) > 2 else 128
configs = [tuple(int(x) for x in c.split("x")) for c in sys.argv[1].split(",")]
for t_len in (4096, 2048):
    q, k, v = _inputs(t_len, heads, kv, d, np.float16, seed=t_len)
    words = [cuda.to_device(np.ascontiguousarray(x).view(np.uint32).reshape(-1)) for x in (q, k, v)]
    d_out = cuda.device_array((t_len, heads * d), np.float32)
    d_lse = cuda.device_array((heads, t_len), np.float32)
    ref = None
    for w, bn in configs:
        try:
            pl = mma.plan(t_len, heads, d, "f16", True, warps=w, block_n=bn)
            f = lambda: mma.launch(pl, *words, t_len, kv, 1 / math.sqrt(d), d_out, d_lse)
            ms = timer.time(f, reps=20, warmup=3)
            o = d_out.copy_to_host()
            if ref is None:
                ref = o
            k_ = pl["kernel"]
            regs = "?"
            try:
                regs = list(k_.overloads.values())[0].get_regs_per_thread() if hasattr(k_, "overloads") else "?"
            except Exception as e:
                regs = repr(e)[:40]
            print(f"T{t_len} w{w} bn{bn}: {ms:.4f} ms {prefill_flops(t_len, heads, d) / ms / 1e9:.1f} TFLOP/s "
                  f"regs {regs} maxdiff {float(np.abs(o - ref).max()):.2e}", flush=True)
        except Exception as e:
            print(f"T{t_len} w{w} bn{bn}: failed {e!r}"[:300], flush=True)
