"""Tensor-core decode (``attention.decode.mma``) against the product decode plan.

    python3 -m bench.mma_decode [--reps 50] [--shape 32,32,8,128,4096] [--tune]
                                [--dtypes float16,bfloat16] [--fp8]
    python3 -m bench.mma_decode --shape 1,32,8,128,32768 --splits 0,16,64,128

A GPU is needed. For each cache dtype (fp16, bf16; q in the cache's dtype),
cache (``pooled`` [B, H_kv, L, D] with slot m = sequence m; ``paged_hnd_p16``:
the same rows in pages of 16 positions, ``[B * L / 16, H_kv, 16, D]``, in a
shuffled order, page table [B, L / 16], ``bench.paged.page_layout``) and T_q
(1 and 4, every sequence holding L positions), it times:

* ``mma``: ``mma.launch`` of an ``mma.plan`` (device arrays, one launch, or
  two with the split-KV combine);
* ``fast``: ``attention.decode.plan.DecodePlan.run`` with ``method="fast"``
  (the CUDA-core kernel, ``t_q`` blocks a kv group for T_q > 1);
* ``plan``: ``DecodePlan.run`` with the default ``method="auto"`` (the product
  path: the tensor-core kernel at T_q > 1, after its one-warp-a-sequence range
  check launch; the CUDA-core one at T_q 1),

with CUDA events, the median of ``--reps`` (>= 50) launches after 5 warm-up
launches, the L2 flushed and the GPU held before each repeat so no host time
is measured (``bench.gpu.Timer``). It prints microseconds, GB/s, the fraction
of the device-to-device copy ceiling measured in the same run
(``bench.gpu.copy_bandwidth``), the ratio fast / mma (above 1: mma is
faster), the largest |mma - fast| over the outputs (the two differ by P's
16-bit rounding: ~1e-3 fp16, ~1e-2 bf16) and the split counts, then the
T_q 4 / T_q 1 time ratio of each kernel and of the default plan (the
target: <= 1.2).

Bytes counted a call: K and V of the attended positions read once
(``2 * B * H_kv * L * D * 2``: the T_q queries and the GQA group's heads
share the rows), q read (``B * T * H * D * 2``) and out written
(``B * T * H * D * 4``); lse (``B * T * H * 4``) and the page table (4
bytes a page, 1/1024 of a page's K and V at D 128) are left out.

``--fp8``: an fp8 e4m3 pooled cache (random codes, no NaN code; q float16),
T_q 1 and 4, with per-tensor scales and with per-(token, kv head) scales
(float32 [B, H_kv, L], random in [0.005, 0.02]): ``mma`` (the tensor-core
kernel, the codes converted to f16 in registers) against ``fast``
(``DecodePlan`` with ``method="fast"``, the product's fp8 path today); bytes
as above with one byte an element of K and V, plus the scales (two 4-byte
values; per token and head, ``2 * B * H_kv * L * 4``). Its issue target: 0.90
of copy at T_q 1.

``--splits``: only the split probe (``probe_splits``): per split count, the
main kernel with and without its combine, the combine alone, the main kernel
over empty sequences and a kernel that does nothing on the same grid (without
and with the plan's shared memory), fp8 and fp16.

``--tune``: the mma kernel alone over warps {2, 4, 8} x stages {2, 3, 4}
(fp16, pooled, T_q 1 and 4): the defaults ``mma.WARPS`` / ``mma.STAGES`` are
a guess until this has run on the H200. With ``--fp8`` also the fp8 kernel
(per-tensor scales, T_q 1 and 4) over warps {4, 8} x stages {2, 3, 4, 6}, in
GB/s and the fraction of copy on the fp8 bytes.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

DTYPES = ("float16", "bfloat16")
CACHES = ("pooled", "paged_hnd_p16")
T_QS = (1, 4)
PAGE = 16


def moved_bytes(b, h, kv, d, seq, t_q, itemsize):
    """K + V of the attended positions, q and out (module docstring)."""
    return 2 * b * kv * seq * d * itemsize + b * t_q * h * d * itemsize + b * t_q * h * d * 4


def registers(kernel):
    """Registers a thread of the compiled mma kernel (None where numba does not say)."""
    try:
        regs = kernel.get_regs_per_thread()
        return max(regs.values()) if isinstance(regs, dict) else int(regs)
    except Exception:  # older numba-cuda
        return None


class Case:
    """One shape, dtype and cache on the device: K/V, lengths, tables."""

    def __init__(self, shape, dname, cache, rng):
        from numba import cuda

        from bench.gpu import random_array
        from bench.paged import page_layout
        from bench.run import np_dtype

        b, h, kv, d, seq = shape
        self.shape, self.dname, self.cache = shape, dname, cache
        self.dt = np_dtype(dname)
        self.kind = "f16" if dname == "float16" else "bf16"
        self.k = random_array((b, kv, seq, d), self.dt, 31)
        self.v = random_array((b, kv, seq, d), self.dt, 32)
        self.lens = cuda.to_device(np.full(b, seq, np.int32))
        self.table = cuda.to_device(np.arange(b, dtype=np.int32))  # the slot table
        self.paging = None
        if cache == "paged_hnd_p16":
            seed = int(rng.integers(1 << 30))
            hosts = [x.view(np.uint16).copy_to_host().view(self.dt) for x in (self.k, self.v)]
            kp, table = page_layout(hosts[0], PAGE, "HND", np.random.default_rng(seed))
            vp, _ = page_layout(hosts[1], PAGE, "HND", np.random.default_rng(seed))
            self.k, self.v = (cuda.to_device(x.view(np.uint16)).view(self.dt) for x in (kp, vp))
            self.table = cuda.to_device(table)
            self.paging = "HND"

    def queries(self, t_q):
        from bench.gpu import random_array

        b, h, _, d, _ = self.shape
        return random_array((b, t_q, h, d), self.dt, 33 + t_q)


def time_plan(timer, shape, kind, q, k, v, lens, table, reps, warps=None, stages=None,
              paging=None, scales="tensor", d_k_scale=None, d_v_scale=None):
    """(ms, out device array, plan) of the mma kernel of ``kind`` on device
    arrays (fp8: ``scales`` mode and the scale arrays)."""
    from numba import cuda

    from attention.decode import fast, mma

    b, h, kv, d, seq = shape
    t_q = int(q.shape[1])
    pl = mma.plan(b, h, kv, d, seq, kind, t_q=t_q, paging=paging, scales=scales,
                  warps=mma.WARPS if warps is None else warps,
                  stages=stages)  # None: mma.default_stages
    out = cuda.device_array((b, t_q, h, d), np.float32)
    lse = cuda.device_array((b, t_q, h), np.float32)
    pa, pm = fast.scratch(b, t_q * h, d, pl["n_split"])
    scale = 1.0 / math.sqrt(d)

    def run():
        mma.launch(pl, q, k, v, lens, table, scale, out, lse, pa, pm, 0,
                   d_k_scale=d_k_scale, d_v_scale=d_v_scale)

    return timer.time(run, reps=reps, warmup=5), out, pl


def time_mma(timer, case, q, t_q, reps, warps=None, stages=None):
    """(ms, out host copy, plan) of the mma kernel on ``case``."""
    ms, out, pl = time_plan(timer, case.shape, case.kind, q, case.k, case.v, case.lens,
                            case.table, reps, warps, stages, paging=case.paging)
    return ms, out.copy_to_host(), pl


def time_fast(timer, case, q, t_q, reps, method="fast"):
    """(ms, out host copy [B, T, H, D], plan) of ``DecodePlan(method=method).run``
    on ``case``."""
    from attention.decode.plan import DecodePlan

    b, h, kv, d, seq = case.shape
    kw = dict(cache_dtype=case.dt, q_dtype=case.dt, t_q=t_q, method=method)
    if case.paging is None:
        plan = DecodePlan(b, h, kv, d, b, seq, **kw)
        table = {}
    else:
        plan = DecodePlan(b, h, kv, d, case.k.shape[0], seq, page_size=PAGE,
                          layout=case.paging, **kw)
        table = {"page_table": case.table}
    qq = q if t_q > 1 else q.reshape(b, h, d)

    def run():
        plan.run(qq, case.k, case.v, case.lens, **table)

    ms = timer.time(run, reps=reps, warmup=5)
    plan.check()
    return ms, plan.out.copy_to_host().reshape(b, t_q, h, d), plan


def compare(timer, shape, reps, copy_gbps, log, dtypes=DTYPES):
    rng = np.random.default_rng(5)
    times = {}
    b, h, kv, d, seq = shape
    for dname in dtypes:
        for cache in CACHES:
            case = Case(shape, dname, cache, rng)
            for t_q in T_QS:
                q = case.queries(t_q)
                nbytes = moved_bytes(b, h, kv, d, seq, t_q, case.dt.itemsize)
                ms_m, out_m, pl = time_mma(timer, case, q, t_q, reps)
                ms_f, out_f, fp = time_fast(timer, case, q, t_q, reps)
                ms_p, out_p, pp = time_fast(timer, case, q, t_q, reps, method="auto")
                same = out_p.tobytes() == (out_m if pp.method == "mma" else out_f).tobytes()
                times[(dname, cache, t_q)] = (ms_m, ms_f, ms_p)
                gb_m, gb_f = (nbytes / (ms * 1e-3) / 1e9 for ms in (ms_m, ms_f))
                diff = float(np.abs(out_m - out_f).max())
                log(f"{cache:<14} {dname:<9} T_q={t_q}  mma {ms_m * 1e3:7.1f} us "
                    f"{gb_m:7.1f} GB/s ({gb_m / copy_gbps:5.3f} of copy)  fast "
                    f"{ms_f * 1e3:7.1f} us {gb_f:7.1f} GB/s  fast/mma x{ms_f / ms_m:5.2f}  "
                    f"diff {diff:.1e}  splits mma {pl['n_split']} fast {fp.n_split}  "
                    f"regs mma {registers(pl['kernel'])} fast {fp.registers}")
                log(f"{'':<14} {'':<9}        plan (auto: {pp.method}) {ms_p * 1e3:7.1f} us "
                    f"({nbytes / (ms_p * 1e-3) / 1e9 / copy_gbps:5.3f} of copy), the "
                    f"{pp.method} kernel's bits: {same}")
            del case
    log("")
    log("T_q 4 / T_q 1 time (target <= 1.2):")
    for dname in dtypes:
        for cache in CACHES:
            m1, f1, p1 = times[(dname, cache, 1)]
            m4, f4, p4 = times[(dname, cache, 4)]
            log(f"  {cache:<14} {dname:<9} mma {m4 / m1:5.2f}   fast {f4 / f1:5.2f}   "
                f"plan (auto) {p4 / p1:5.2f}")


def fp8_cache(shape, rng):
    """(k, v, lens, slots) on the device: random e4m3 codes (no NaN code) of a
    pooled cache [B, H_kv, L, D], every sequence L long, slot m = sequence m."""
    from numba import cuda

    b, h, kv, d, seq = shape
    codes = []
    for _ in range(2):
        c = rng.integers(0, 256, (b, kv, seq, d), dtype=np.uint8)
        c[(c & 0x7F) == 0x7F] = 0  # no NaN code
        codes.append(cuda.to_device(c))
    return (codes[0], codes[1], cuda.to_device(np.full(b, seq, np.int32)),
            cuda.to_device(np.arange(b, dtype=np.int32)))


def fp8_scales(shape, mode, rng):
    """(k_scale, v_scale) device arrays: [1] each (``"tensor"``) or random in
    [0.005, 0.02] a row, [B, H_kv, L] (``"token_head"``)."""
    from numba import cuda

    b, h, kv, d, seq = shape
    if mode == "tensor":
        return (cuda.to_device(np.array([0.01], np.float32)),
                cuda.to_device(np.array([0.02], np.float32)))
    return tuple(cuda.to_device(rng.uniform(0.005, 0.02, (b, kv, seq)).astype(np.float32))
                 for _ in range(2))


def fp8_bytes(shape, t_q, k_scale, v_scale):
    """Bytes an fp8 call moves: K and V codes, q (2 bytes), out, the scales."""
    b, h, kv, d, seq = shape
    return (moved_bytes(b, h, kv, d, seq, t_q, 1) + b * t_q * h * d
            + 4 * (k_scale.size + v_scale.size))


def time_fp8_mma(timer, shape, cache, q, mode, scales, reps, warps=None, stages=None):
    """(ms, out device array, plan) of the fp8 mma kernel."""
    from attention.decode import mma

    k, v, lens, slots = cache
    return time_plan(timer, shape, mma.FP8_KIND, q, k, v, lens, slots, reps, warps, stages,
                     scales=mode, d_k_scale=scales[0], d_v_scale=scales[1])


def tune_fp8(timer, shape, reps, copy_gbps, log, t_qs=T_QS):
    """The fp8 mma kernel (per-tensor scales) over warps x stages, at each T_q
    of ``t_qs``."""
    from attention.decode import mma
    from bench.gpu import random_array

    b, h, kv, d, seq = shape
    rng = np.random.default_rng(8)
    cache = fp8_cache(shape, rng)
    scales = fp8_scales(shape, "tensor", rng)
    for t_q in t_qs:
        q = random_array((b, t_q, h, d), np.float16, 40 + t_q)
        nbytes = fp8_bytes(shape, t_q, *scales)
        for warps in (4, 8):
            for stages in (2, 3, 4, 6):
                smem = 4 * mma.smem_words(d, warps, stages, fp8=True)
                if smem > mma.SMEM_PER_SM:
                    log(f"  fp8 T_q={t_q} warps {warps} stages {stages}: {smem // 1024} KB: "
                        f"skipped")
                    continue
                ms, _, pl = time_fp8_mma(timer, shape, cache, q, "tensor", scales, reps,
                                         warps, stages)
                gb = nbytes / (ms * 1e-3) / 1e9
                log(f"  fp8 T_q={t_q} warps {warps} stages {stages}: {ms * 1e3:7.1f} us "
                    f"{gb:7.1f} GB/s ({gb / copy_gbps:5.3f} of copy)  splits {pl['n_split']}  "
                    f"smem {pl['dyn_smem'] // 1024} KB  regs {registers(pl['kernel'])}")


def compare_fp8(timer, shape, reps, copy_gbps, log):
    """The fp8 rows (``--fp8``, module docstring)."""
    from attention.decode import mma
    from attention.decode.plan import DecodePlan
    from bench.gpu import random_array

    b, h, kv, d, seq = shape
    rng = np.random.default_rng(7)
    k, v, lens, slots = fp8_cache(shape, rng)
    for mode, t_q in ((m, t) for m in mma.FP8_SCALES for t in T_QS):
        k_scale, v_scale = fp8_scales(shape, mode, rng)
        q = random_array((b, t_q, h, d), np.float16, 40 + t_q)
        nbytes = fp8_bytes(shape, t_q, k_scale, v_scale)
        ms_m, out, pl = time_fp8_mma(timer, shape, (k, v, lens, slots), q, mode,
                                     (k_scale, v_scale), reps)
        plan = DecodePlan(b, h, kv, d, b, seq, cache_dtype=np.uint8, q_dtype=np.float16,
                          t_q=t_q, method="fast", fp8_scales=mode)
        qq = q if t_q > 1 else q.reshape(b, h, d)

        def run_fast():
            plan.run(qq, k, v, lens, slots, k_scale=k_scale, v_scale=v_scale)

        ms_f = timer.time(run_fast, reps=reps, warmup=5)
        plan.check()
        diff = float(np.abs(out.copy_to_host()
                            - plan.out.copy_to_host().reshape(b, t_q, h, d)).max())
        gb_m, gb_f = (nbytes / (ms * 1e-3) / 1e9 for ms in (ms_m, ms_f))
        log(f"pooled_fp8 {mode:<10} T_q={t_q}  mma {ms_m * 1e3:7.1f} us {gb_m:7.1f} GB/s "
            f"({gb_m / copy_gbps:5.3f} of copy)  fast {ms_f * 1e3:7.1f} us {gb_f:7.1f} GB/s "
            f"({gb_f / copy_gbps:5.3f} of copy)  fast/mma x{ms_f / ms_m:5.2f}  diff {diff:.1e}  "
            f"splits mma {pl['n_split']} fast {plan.n_split}  stages mma {pl['stages']}  regs mma "
            f"{registers(pl['kernel'])}  bytes {nbytes}")


def _null():
    """A kernel that writes one word when its argument says so (never, here)."""
    from numba import cuda

    @cuda.jit
    def null_kernel(sink):
        if sink.size == 0:
            sink[0] = 0.0

    return null_kernel


def probe_splits(timer, shape, reps, copy_gbps, log, splits):
    """``--splits``: where a split plan's time goes, fp8 (per-tensor scales)
    and fp16 at T_q 1. For each split count (``0``: the plan's default) and
    warps 4 / 8: the main kernel and its combine (``mma.launch``), the main
    kernel alone (the plan with its combine left out: the partials are
    written and not merged), the combine alone, and the main kernel over
    empty sequences (lengths 0: the launch, the blocks' set-up and their
    writes, no K/V read; also timed with the L2 not flushed, so that the
    kernel's code and its first reads come from L2), and a kernel that does
    nothing on the same grid and block, without and with the plan's dynamic
    shared memory. Bytes as ``--fp8`` / the fp16 rows."""
    from numba import cuda

    from attention.core.device import ensure_dynamic_shared
    from attention.decode import fast, mma
    from bench.gpu import random_array

    _null_kernel = _null()
    b, h, kv, d, seq = shape
    rng = np.random.default_rng(9)
    fp8 = fp8_cache(shape, rng)
    lens, slots = fp8[2], fp8[3]  # every sequence L long, slot m = sequence m (both caches)
    f8_scales = fp8_scales(shape, "tensor", rng)
    k16 = random_array((b, kv, seq, d), np.float16, 31)
    v16 = random_array((b, kv, seq, d), np.float16, 32)
    q = random_array((b, 1, h, d), np.float16, 41)
    zeros = cuda.to_device(np.zeros(b, np.int32))
    out = cuda.device_array((b, 1, h, d), np.float32)
    lse = cuda.device_array((b, 1, h), np.float32)
    scale = 1.0 / math.sqrt(d)
    rows = [("fp8", mma.FP8_KIND, fp8[0], fp8[1], f8_scales,
             fp8_bytes(shape, 1, *f8_scales)),
            ("fp16", "f16", k16, v16, (None, None), moved_bytes(b, h, kv, d, seq, 1, 2))]
    for name, kind, k, v, (ks, vs), nbytes in rows:
        for warps in (4, 8):
            for n_split in splits:
                try:
                    pl = mma.plan(b, h, kv, d, seq, kind, warps=warps,
                                  n_split=n_split or None)
                except Exception as exc:
                    log(f"  {name} warps {warps} splits {n_split}: {type(exc).__name__}: "
                        f"{str(exc)[:80]}")
                    continue
                if pl["dyn_smem"] > mma.SMEM_PER_SM:
                    log(f"  {name} warps {warps}: {pl['dyn_smem'] // 1024} KB: skipped")
                    continue
                pa, pm = fast.scratch(b, h, d, pl["n_split"])
                alone = dict(pl, n_split=1)  # launch() then leaves the combine out

                def call(p, lengths):
                    mma.launch(p, q, k, v, lengths, slots, scale, out, lse, pa, pm, 0,
                               d_k_scale=ks, d_v_scale=vs)

                both = timer.time(lambda: call(pl, lens), reps=reps, warmup=5)
                main = timer.time(lambda: call(alone, lens), reps=reps, warmup=5)
                empty = timer.time(lambda: call(alone, zeros), reps=reps, warmup=5)
                # the same with the L2 not flushed: the kernel's code and its first
                # reads (length, slot, Q) then come from L2, not DRAM
                warm = timer.time(lambda: call(alone, zeros), reps=reps, warmup=5, flush=False)
                comb = 0.0
                if pl["n_split"] > 1:
                    ck = fast.combine_kernel(-(-d // mma.WARP))
                    grid, block = (h, b), fast.combine_warps(pl["n_split"]) * mma.WARP

                    def combine():
                        ck[grid, block, 0](pa, pm, out.reshape(b, h, d), lse.reshape(b, h))

                    comb = timer.time(combine, reps=reps, warmup=5)
                # a kernel that does nothing, on the plan's grid and block, with no
                # shared memory and with the plan's: the launch and the blocks' turnover
                sink = out.reshape(b * h * d)
                null0 = timer.time(lambda: _null_kernel[pl["grid"], pl["block"], 0, 0](sink),
                                   reps=reps, warmup=5)
                # the opt-in a size (a tag each: a later plan may need more than an earlier)
                ensure_dynamic_shared(_null_kernel, (sink,), pl["dyn_smem"], 0,
                                      f"null{pl['dyn_smem']}")
                null1 = timer.time(
                    lambda: _null_kernel[pl["grid"], pl["block"], 0, pl["dyn_smem"]](sink),
                    reps=reps, warmup=5)
                gb = nbytes / (both * 1e-3) / 1e9
                gb_main = nbytes / (main * 1e-3) / 1e9
                log(f"  {name:<4} warps {warps} splits {pl['n_split']:4d} (chunk "
                    f"{pl['chunk']:6d}, {pl['stages']} stages)  both {both * 1e3:6.1f} us "
                    f"({gb / copy_gbps:5.3f} of copy)  main {main * 1e3:6.1f} us "
                    f"({gb_main / copy_gbps:5.3f})  combine {comb * 1e3:5.1f} us  "
                    f"empty main {empty * 1e3:5.1f} us (L2 not flushed {warm * 1e3:5.1f} us)  "
                    f"null kernel {null0 * 1e3:5.1f} us, "
                    f"with the plan's shared memory {null1 * 1e3:5.1f} us  bytes {nbytes}")


def tune(timer, shape, reps, log):
    from attention.decode import mma

    rng = np.random.default_rng(6)
    case = Case(shape, "float16", "pooled", rng)
    for t_q in T_QS:
        q = case.queries(t_q)
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                smem = 4 * mma.smem_words(shape[3], warps, stages)
                if smem > mma.SMEM_PER_SM:
                    log(f"  T_q={t_q} warps {warps} stages {stages}: {smem // 1024} KB of shared "
                        f"memory a block, more than an SM has: skipped")
                    continue
                try:
                    ms, _, pl = time_mma(timer, case, q, t_q, reps, warps, stages)
                except Exception as exc:  # too much shared memory for a block, say
                    log(f"  T_q={t_q} warps {warps} stages {stages}: {type(exc).__name__}: "
                        f"{str(exc)[:80]}")
                    continue
                log(f"  T_q={t_q} warps {warps} stages {stages}: {ms * 1e3:7.1f} us  "
                    f"splits {pl['n_split']}  smem {pl['dyn_smem'] // 1024} KB  "
                    f"regs {registers(pl['kernel'])}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="timed launches (median; >= 50)")
    parser.add_argument("--shape", default="32,32,8,128,4096", help="B,H,H_kv,D,L")
    parser.add_argument("--tune", action="store_true", help="also sweep warps x stages")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="cache dtypes, comma list (default: float16,bfloat16)")
    parser.add_argument("--fp8", action="store_true",
                        help="also the fp8 e4m3 cache (per-tensor scales): mma against fast")
    parser.add_argument("--splits", default=None, metavar="LIST",
                        help="only the split probe (probe_splits): split counts, comma list "
                             "(0: the plan's default), fp8 and fp16 at T_q 1")
    args = parser.parse_args(argv)
    from attention.core.device import device_name, gpu_available

    if not gpu_available():
        print("bench.mma_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.gpu import Timer, copy_bandwidth

    shape = tuple(int(x) for x in args.shape.split(","))
    reps = max(50, args.reps)
    timer = Timer()
    copy_gbps, _ = copy_bandwidth(timer, 1 << 30)
    b, h, kv, d, seq = shape
    print(f"device {device_name()}; B {b} H {h} H_kv {kv} D {d} L {seq}; median of {reps} "
          f"launches; copy ceiling {copy_gbps:.0f} GB/s")
    dtypes = tuple(x for x in args.dtypes.split(",") if x)
    bad = [x for x in dtypes if x not in DTYPES]
    if bad:
        print(f"bench.mma_decode: --dtypes: expected some of {DTYPES}, got {bad}",
              file=sys.stderr)
        return 2
    if args.splits is not None:
        print("split probe (T_q 1; pooled cache):")
        probe_splits(timer, shape, reps, copy_gbps, print,
                     [int(x) for x in args.splits.split(",") if x])
        return 0
    compare(timer, shape, reps, copy_gbps, print, dtypes)
    if args.fp8:
        print("")
        print("fp8 e4m3 cache, per-tensor and per-(token, kv head) scales (q float16):")
        compare_fp8(timer, shape, reps, copy_gbps, print)
    if args.tune:
        print("")
        print("mma warps x stages (fp16, pooled):")
        tune(timer, shape, reps, print)
        if args.fp8:
            print("mma warps x stages (fp8, pooled, per-tensor scales):")
            tune_fp8(timer, shape, reps, copy_gbps, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
