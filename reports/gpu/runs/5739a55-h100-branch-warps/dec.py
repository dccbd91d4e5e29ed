"""Time the mma decode (fp8 per tensor / token_head and fp16 pooled, T_q 1) of this tree."""
import sys
import numpy as np
from bench.gpu import Timer, copy_bandwidth, random_array
from bench import mma_decode as M
shape = (32, 32, 8, 128, 4096)
b, h, kv, d, seq = shape
timer = Timer()
copy_gbps, _ = copy_bandwidth(timer, 1 << 30)
tag = sys.argv[1]
rng = np.random.default_rng(7)
cache = M.fp8_cache(shape, rng)
for rep in range(2):
    for mode in ("tensor", "token_head"):
        sc = M.fp8_scales(shape, mode, np.random.default_rng(11))
        q = random_array((b, 1, h, d), np.float16, 41)
        nbytes = M.fp8_bytes(shape, 1, *sc)
        ms, out, pl = M.time_fp8_mma(timer, shape, cache, q, mode, sc, 100)
        o = out.copy_to_host()
        print(f"{tag} fp8 {mode:<10} {ms * 1e3:7.1f} us {nbytes / (ms * 1e-3) / 1e9 / copy_gbps:6.3f} of copy "
              f"regs {M.registers(pl['kernel'])} stages {pl['stages']} checksum {float(np.abs(o).sum()):.6e}", flush=True)
    for layout in ("pooled", "paged_hnd_p16"):
        case = M.Case(shape, "float16", layout, np.random.default_rng(5))
        q = case.queries(1)
        ms, out, pl = M.time_mma(timer, case, q, 1, 100)
        nbytes = M.moved_bytes(b, h, kv, d, seq, 1, 2)
        print(f"{tag} f16 {layout:<14} {ms * 1e3:7.1f} us {nbytes / (ms * 1e-3) / 1e9 / copy_gbps:6.3f} of copy "
              f"regs {M.registers(pl['kernel'])} checksum {float(np.abs(out).sum()):.6e}", flush=True)
        del case
print(f"copy {copy_gbps:.0f} GB/s")
