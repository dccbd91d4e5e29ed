"""Error growth over decode steps: does a kernel's error stay at float32 level
as the context grows token by token?

Each run decodes ``steps`` tokens. Every step appends this token's row through
the real kernels (``DecodeState.step``: batched KV scatter then attention;
``LatentCache.append``: the MLA ``append_latent`` kernel, then
``mla_decode_step``), and compares the step's output with the float64 oracle's
full recompute over everything cached so far, and the float32 baseline (the
oracle's arithmetic in float32, the scores in the order of the run's kernel:
``validation.baselines``, named in the registry) likewise. A host mirror of the cache (what the
appends should have written) feeds the oracles; at the end the device cache is
copied back and must equal the mirror bit for bit, with NaN (the initial fill)
everywhere nothing was appended.

Runs (``GROWTH_KERNELS``):

* ``batched_decode``: ``attention.decode.step.DecodeState(kernel="warp")``, M
  sequences with different starting lengths in shuffled slots of a NaN-filled
  pool (float32: the reference kernels' only cache dtype; float16 / bfloat16
  jobs are reported unsupported);
* ``flash_decode``: the same with ``kernel="split"`` and a fixed chunk so the
  context crosses many chunks;
* ``fast_decode``: the same with ``kernel="fast"`` (``attention.decode.fast``),
  with float32, float16 and bfloat16 caches (the 16-bit runs: the rows stored
  in 16 bits, everything computed in float32; the oracle and the baseline read
  the stored values exactly, so they are judged as the float32 run, in the
  fast kernel's lane order for that dtype: ``lanes16x8`` at D 128);
* ``paged_decode`` / ``paged_decode_t4``: the same sequences in a paged cache
  (HND pages of 16, 4 on the simulator, in a shuffled order, two sequences
  sharing a prefix page where their starts allow, NaN in every unwritten
  row and huge unused table entries), each call appending T tokens a sequence
  through ``attention.cache.paged.paged_append`` and attending them with a
  ``DecodePlan(page_size=..., t_q=T)``: T = 1, and T = 4 (the run's steps
  taken 4 at a time, every query judged; a step of the series is a call);
  at the end every page must equal the mirror's rows, NaN elsewhere;
* ``fp8_decode``: the same sequences in an fp8 e4m3 cache (HND pages of 16,
  4 on the simulator, shuffled; NaN codes and NaN scales in every unwritten
  row), each step's new rows (in the job's dtype) quantized per (token, kv
  head) by ``attention.cache.fp8.fp8_append`` and attended by a
  ``DecodePlan(cache_dtype="float8_e4m3fn", fp8_scales="token_head")``; the
  mirror is the reference quantizer's (``quantize_append_ref``) codes and
  scales, the oracle and the baseline take its dequantized values, and at the
  end every page byte and every scale must equal the mirror's;
* ``mma_paged_decode_t4``: ``paged_decode_t4`` on the tensor-core decode
  (``DecodePlan(method="mma")``): float16 / bfloat16 caches with q in their
  dtype (float32 jobs are unsupported), ``FP8_GEOMETRY``'s sizes (D 64 on the
  simulator: the kernel has tiles for D 32 / 64 / 128), judged with the
  registry's ``decode_mma_t4`` baseline (``mma16_p16``:
  ``baselines.decode_rounded_p``, P rounded to the cache dtype);
* ``mma_fp8_decode``: ``fp8_decode`` on the tensor-core decode
  (``DecodePlan(method="mma", fp8_scales="token_head")``, q float16, the
  job's dtype the new rows'), judged with ``decode_mma_fp8_tok``'s baseline
  (``mma16_pv16``: the V scales into P, normalised a row, rounded to f16);
* ``mla_decode``: one sequence through a ``LatentCache`` (NaN beyond its
  length) and the absorbed MLA pipeline's tiled online-softmax path;
* ``mla_gemm_decode``: the same through its GEMM path (``mla.attn_gemm``), on a
  GPU with DeepSeek-V3's 128 heads, so that its score and P.V GEMMs run on tensor
  cores (``attention.gemm.tgemm`` takes more than 64 rows);
* ``mla_gemm_fma_decode``: the GEMM path with fp32 FMA GEMMs only (``gemm_fma``);
* ``mla_fp8_decode``: one sequence in an fp8 latent cache (``mla.fp8``: a
  contiguous ``[1, capacity, r + 2 d_rope]`` uint8 cache holding e4m3's NaN
  code and NaN scales wherever nothing was appended), each step's row
  quantized per token by ``mla.fp8_append.fp8_append_latent`` and attended by
  ``mla_decode(..., latent_scale=)`` (the tensor-core kernel's fp8 mode);
  the mirror is ``mla.fp8.quantize``'s codes and scales, the oracle takes
  their exact dequantized values and the baseline is the registry's
  ``mla_fp8_tok`` (``mla_rounded_p``); at the end every cache byte and scale
  must equal the mirror's. The widths are the tensor-core kernel's (r 64,
  d_rope 64, 2 heads on the simulator; DeepSeek's with 16 heads on a GPU);
  float16 only (the format's k_pe);
* ``mla_mma_decode``: one sequence in a float16 ``LatentCache`` (NaN beyond
  its length) attended by ``mla_decode(..., method="mma")``, the 16-bit
  tensor-core kernel, judged with the registry's ``mla_mma`` baseline
  (``mla_rounded_p``: q_lat and P rounded to fp16); the tensor-core widths
  on the simulator (r 64, d_rope 64, 2 heads), DeepSeek's with 128 heads on a
  GPU (four row groups a block: S and P.V on wgmma on a compute-capability-9.0
  GPU, ``mla.mma.wgmma_level``); float16 only (the kernel's cache).

A step passes under the sweep's rule (``validation.metrics.judge``), except
that an output with fewer than ``tolerance.MEAN_MIN_ENTRIES`` entries a step
(the LSE of the decode runs: 24) has its mean rule judged over windows of
consecutive steps pooled to that many entries (``tolerance.pooled_mean_windows``;
the tolerance module says why); the run passes when every step and window
does and the cache check holds. The series (kernel and
baseline error of every step) goes into the report and the plots. The decode
runs step the state in its default mode: a replayed CUDA graph on a GPU, eager
launches on the simulator (the record's ``geometry`` names the path).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import numpy as np

from validation import baselines, fixtures, metrics, tolerance

GROWTH_KERNELS = ("batched_decode", "flash_decode", "fast_decode", "paged_decode",
                  "paged_decode_t4", "fp8_decode", "mma_paged_decode_t4", "mma_fp8_decode",
                  "mla_decode", "mla_gemm_decode", "mla_gemm_fma_decode", "mla_fp8_decode",
                  "mla_mma_decode")
# the paged runs: queries a call (tokens appended a call) and page size (GPU, simulator)
PAGED_T_Q = {"paged_decode": 1, "paged_decode_t4": 4, "mma_paged_decode_t4": 4}
# the runs on the tensor-core decode (DecodePlan(method="mma"))
MMA_RUNS = ("mma_paged_decode_t4", "mma_fp8_decode")
PAGED_PAGE = {False: 16, True: 4}
DEFAULT_GPU = GROWTH_KERNELS
MLA_METHODS = {"mla_decode": "flash", "mla_gemm_decode": "gemm", "mla_gemm_fma_decode": "gemm_fma"}
# heads of the GPU runs (DeepSeek-V3 widths): 16 keep the float64 recompute cheap; the
# tensor-core GEMM path needs more than 64 (``attention.gemm.tgemm.usable``), so it gets 128
MLA_GPU_HEADS = {"mla_decode": 16, "mla_gemm_decode": 128, "mla_gemm_fma_decode": 16,
                 "mla_fp8_decode": 16, "mla_mma_decode": 128}
DECODE_METHODS = {"batched_decode": "warp", "flash_decode": "split", "fast_decode": "fast"}
DEFAULT_SIM = ("batched_decode", "mla_decode")
KERNEL_OF_METHOD = {m: k for k, m in DECODE_METHODS.items()}
# each run's baseline order: its kernel's in the registry (validation.baselines)
REGISTRY_KERNEL = {"batched_decode": "batched_decode", "flash_decode": "flash_decode",
                   "fast_decode": "decode_fast", "paged_decode": "decode_fast",
                   "paged_decode_t4": "decode_fast", "fp8_decode": "decode_fp8_tok",
                   "mma_paged_decode_t4": "decode_mma_t4", "mma_fp8_decode": "decode_mma_fp8_tok",
                   "mla_decode": "mla",
                   "mla_gemm_decode": "mla_gemm",
                   "mla_gemm_fma_decode": "mla_gemm_fma",
                   "mla_fp8_decode": "mla_fp8_tok",
                   "mla_mma_decode": "mla_mma"}


def baseline_order(kernel, inputs=None, storage=np.float32):
    """The baseline order label of growth run ``kernel`` (resolved for the
    fast decode's lane layout with ``inputs`` holding ``q`` and the storage dtype)."""
    from validation.registry import KERNELS_BY_NAME

    label = KERNELS_BY_NAME[REGISTRY_KERNEL[kernel]].baseline
    return baselines.resolve(label, inputs, storage) if inputs is not None else label


GPU_STEPS = 1024
SIM_STEPS = 32

# geometry: simulator (small) and GPU sizes
DECODE_GEOMETRY = {
    True: dict(m=2, h=2, h_kv=1, d=40, start=(0, 3), kv_slots=3, chunk=8),
    False: dict(m=3, h=8, h_kv=2, d=128, start=(0, 17, 100), kv_slots=5, chunk=128),
}
# the fp8 run on the simulator: D 64 and 4 heads, 512 output entries a step (with
# DECODE_GEOMETRY's 160, i.e. 4 (sequence, head) pairs, one step of 12 of a float16
# run went over the mean rule); the GPU size is DECODE_GEOMETRY's
FP8_GEOMETRY = {True: dict(m=2, h=4, h_kv=2, d=64, start=(0, 3), kv_slots=3, chunk=8),
                False: DECODE_GEOMETRY[False]}
MLA_START = {True: 3, False: 16}
MODULES = {"batched_decode": ("attention.decode.step", "attention.oracle"),
           "flash_decode": ("attention.decode.step", "attention.oracle"),
           "fast_decode": ("attention.decode.step", "attention.decode.fast", "attention.oracle"),
           "paged_decode": ("attention.decode.plan", "attention.cache.paged", "attention.oracle"),
           "paged_decode_t4": ("attention.decode.plan", "attention.cache.paged",
                               "attention.oracle"),
           "fp8_decode": ("attention.decode.plan", "attention.cache.fp8", "attention.oracle"),
           "mma_paged_decode_t4": ("attention.decode.plan", "attention.decode.mma",
                                   "attention.cache.paged", "attention.oracle"),
           "mma_fp8_decode": ("attention.decode.plan", "attention.decode.mma",
                              "attention.cache.fp8", "attention.oracle"),
           "mla_decode": ("mla.cache", "mla.pipeline", "mla.oracle", "mla.dims"),
           "mla_gemm_decode": ("mla.cache", "mla.pipeline", "mla.attn_gemm", "mla.oracle",
                               "mla.dims"),
           "mla_gemm_fma_decode": ("mla.cache", "mla.pipeline", "mla.attn_gemm", "mla.oracle",
                                   "mla.dims"),
           "mla_fp8_decode": ("mla.fp8", "mla.fp8_append", "mla.pipeline", "mla.oracle",
                              "mla.dims"),
           "mla_mma_decode": ("mla.cache", "mla.pipeline", "mla.mma", "mla.oracle",
                              "mla.dims")}


@dataclass(frozen=True)
class GrowthJob:
    kernel: str
    dtype: str
    seed: int
    steps: int
    small: bool

    @property
    def id(self):
        return f"growth/{self.kernel}/{self.dtype}/s{self.seed}/{self.steps}"


def _series():
    return {"step": [], "length": [], "out_err": [], "out_base": [], "out_bound": [],
            "out_mean": [], "out_mean_base": [], "out_floor": [], "out_n": [],
            "lse_err": [], "lse_base": [], "lse_bound": [], "lse_mean": [],
            "lse_mean_base": [], "lse_floor": [], "lse_n": [], "passed": []}


def _record_step(series, step, length, judged):
    """Record one step. Its ``passed`` holds the NaN and max rules, and the
    mean rule of outputs with at least ``tolerance.MEAN_MIN_ENTRIES`` entries;
    ``_pooled_means`` judges the others' mean rule over windows of steps."""
    series["step"].append(step)
    series["length"].append(length)
    ok = True
    for name in ("out", "lse"):
        r = judged.get(name)
        series[f"{name}_err"].append(None if r is None else r["max_abs"])
        series[f"{name}_base"].append(None if r is None else r["baseline_abs"])
        series[f"{name}_bound"].append(None if r is None else r["bound"])
        series[f"{name}_mean"].append(None if r is None else r["mean_abs"])
        series[f"{name}_mean_base"].append(None if r is None else r["baseline_mean"])
        series[f"{name}_floor"].append(None if r is None else r["floor"])
        series[f"{name}_n"].append(None if r is None else r["n"])
        if r is not None:
            failed = set(r["failed_by"])
            if r["n"] < tolerance.MEAN_MIN_ENTRIES:
                failed.discard("mean")
            ok = ok and not failed
    series["passed"].append(ok)


def _pooled_means(series):
    """The mean rule of outputs with fewer than ``tolerance.MEAN_MIN_ENTRIES``
    entries a step, over windows of steps (``tolerance.pooled_mean_windows``):
    the steps of a failing window are marked failed. Returns the failing
    windows as text."""
    bad = []
    for name in ("out", "lse"):
        ns = series[f"{name}_n"]
        if not ns or any(n is None for n in ns) or min(ns) >= tolerance.MEAN_MIN_ENTRIES:
            continue
        windows = tolerance.pooled_mean_windows(
            series[f"{name}_mean"], series[f"{name}_mean_base"], series[f"{name}_floor"], ns)
        for first, last, mean, bound, passed in windows:
            if not passed:
                for i in range(first, last + 1):
                    series["passed"][i] = False
                bad.append(f"{name} mean over steps {series['step'][first]}-"
                           f"{series['step'][last]}: {mean:.3g} > {bound:.3g}")
    return bad


def _decode_growth(job, method):
    from attention.core.device import to_host
    import attention.reference.decode_step  # noqa: F401  (registers "warp" / "split")
    from attention.decode.step import DecodeState
    from attention.oracle import decode_attention_ref

    g = DECODE_GEOMETRY[job.small]
    m, h, h_kv, d, kv_slots = g["m"], g["h"], g["h_kv"], g["d"], g["kv_slots"]
    start = np.array(g["start"], np.int32)
    max_seq = int(start.max()) + job.steps + 1  # one position is never written: stays NaN
    dt = fixtures.resolve_dtype(job.dtype)
    rng = fixtures.case_rng(job.seed, "growth", "decode", job.small)
    slot_table = rng.permutation(kv_slots)[:m].astype(np.int32)
    extra = {"split_chunk": g["chunk"]} if method == "split" else {}
    batch = DecodeState(m, h, h_kv, d, max_seq, kv_slots=kv_slots, slot_table=slot_table,
                        dtype=dt, kernel=method, fill=np.nan, **extra)
    # host mirrors of what the device caches should hold (float64 copies of the stored values)
    k_mirror = np.full((kv_slots, h_kv, max_seq, d), np.nan)
    v_mirror = np.full((kv_slots, h_kv, max_seq, d), np.nan)
    longest = int(start.max())
    k_pre = rng.standard_normal((m, h_kv, longest, d)).astype(dt)
    v_pre = rng.standard_normal((m, h_kv, longest, d)).astype(dt)
    batch.prefill(k_pre, v_pre, start)
    for i in range(m):
        k_mirror[slot_table[i], :, :start[i]] = k_pre[i, :, :start[i]]
        v_mirror[slot_table[i], :, :start[i]] = v_pre[i, :, :start[i]]
    k32, v32 = k_mirror.astype(np.float32), v_mirror.astype(np.float32)
    series = _series()
    lengths = start.copy()
    for step in range(job.steps):
        q = rng.standard_normal((m, h, d)).astype(np.float32)
        k_new = rng.standard_normal((m, h_kv, d)).astype(dt)
        v_new = rng.standard_normal((m, h_kv, d)).astype(dt)
        out, lse = batch.step(q, k_new, v_new, return_lse=True)
        for i in range(m):
            s, p = slot_table[i], lengths[i]
            k_mirror[s, :, p], v_mirror[s, :, p] = k_new[i], v_new[i]
            k32[s, :, p], v32[s, :, p] = k_new[i], v_new[i]
        lengths = lengths + 1
        o64, l64 = decode_attention_ref(q, k_mirror, v_mirror, lengths, slot_table)
        label = baseline_order(KERNEL_OF_METHOD[method], {"q": q}, dt)
        o32, l32 = baselines.decode_order(q, k32, v32, lengths, slot_table, label)
        judged = {"out": metrics.judge(out, o64, o32, label),
                  "lse": metrics.judge(lse, l64, l32, label)}
        _record_step(series, step + 1, int(lengths.max()), judged)
    # the caches after the run: appended rows bit-exact, NaN elsewhere
    cache_ok = True
    problems = []
    for name, dev, mirror in (("k_cache", batch.k_cache, k_mirror),
                              ("v_cache", batch.v_cache, v_mirror)):
        host = np.asarray(to_host(dev), dtype=np.float64)
        if not np.array_equal(host, mirror, equal_nan=True):
            cache_ok = False
            bad = np.argwhere(~((host == mirror) | (np.isnan(host) & np.isnan(mirror))))
            problems.append(f"{name} differs from the appended rows at {tuple(bad[0])} "
                            f"({len(bad)} elements)")
    got_lengths = batch.lengths
    if not np.array_equal(got_lengths, lengths):
        cache_ok = False
        problems.append(f"lengths {got_lengths.tolist()} != expected {lengths.tolist()}")
    geometry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
    geometry["path"] = batch.path
    return series, cache_ok, "; ".join(problems), geometry


def _shuffled_table(rng, m, width, page, reach):
    """``(n_pages, table [m, width] int32)``: ``m * width + 2`` pages (two spare,
    nobody's) handed out in a shuffled order that is never the identity; the
    entries past the pages sequence i can reach (``reach[i]`` positions) are
    ``fixtures.HUGE_PAGE``, which a kernel must never read."""
    n_pages = m * width + 2
    order = rng.permutation(n_pages).astype(np.int32)
    if np.array_equal(order, np.arange(n_pages)):
        order = order[::-1].copy()
    table = order[:m * width].reshape(m, width).copy()
    for i in range(m):
        table[i, -(-int(reach[i]) // page):] = fixtures.HUGE_PAGE
    return n_pages, table


def _paged_growth(job, t_q, probe=None):
    """One paged growth run; ``probe`` (optional): called after each step as
    ``probe(step, q, mirror_k, mirror_v, lengths, out, lse, o64, l64, o32, l32)``
    (``validation.lse_probe`` looks at its LSE entries). The ``MMA_RUNS``: the
    tensor-core decode, q in the cache dtype, its rounded-P baseline."""
    from attention.cache.paged import paged_append
    from attention.core.checks import DTypeError
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan
    from attention.oracle import decode_attention_multi_ref

    mma = job.kernel in MMA_RUNS
    g = (FP8_GEOMETRY if mma else DECODE_GEOMETRY)[job.small]
    m, h, h_kv, d = g["m"], g["h"], g["h_kv"], g["d"]
    page = PAGED_PAGE[job.small]
    start = np.array(g["start"], np.int32)
    calls = -(-job.steps // t_q)
    max_seq = int(start.max()) + calls * t_q + 1  # one position is never written
    width = -(-max_seq // page)
    dt = fixtures.resolve_dtype(job.dtype)
    if mma and dt == np.dtype(np.float32):
        raise DTypeError("float32: the tensor-core decode takes float16 / bfloat16 caches "
                         "(q in their dtype)")
    q_dt = dt if mma else np.dtype(np.float32)
    rng = fixtures.case_rng(job.seed, "growth", "paged", job.small)
    n_pages, table = _shuffled_table(rng, m, width, page, start + calls * t_q)
    # sequences whose starts fill a first page share the longest one's (a common prefix)
    owner = int(np.argmax(start))
    sharing = [i for i in range(m) if i != owner and start[i] >= page]
    for i in sharing:
        table[i, 0] = table[owner, 0]
    mirror_k = np.full((m, h_kv, max_seq, d), np.nan)  # sequence-major, float64
    mirror_v = np.full((m, h_kv, max_seq, d), np.nan)
    pages_k = np.full((n_pages, h_kv, page, d), np.nan, dt)
    pages_v = np.full((n_pages, h_kv, page, d), np.nan, dt)
    k_pre = rng.standard_normal((h_kv, int(start.max()), d)).astype(dt)
    v_pre = rng.standard_normal((h_kv, int(start.max()), d)).astype(dt)
    for i in range(m):
        # every sequence's prefix rows are the owner's (so a shared page holds them all)
        n = int(start[i])
        mirror_k[i, :, :n], mirror_v[i, :, :n] = k_pre[:, :n], v_pre[:, :n]
        for p in range(n):
            pg, off = table[i, p // page], p % page
            pages_k[pg, :, off], pages_v[pg, :, off] = k_pre[:, p], v_pre[:, p]
    d_k, d_v, d_table = to_device(pages_k), to_device(pages_v), to_device(table)
    plan = DecodePlan(m, h, h_kv, d, n_pages, max_seq, cache_dtype=dt, q_dtype=q_dt,
                      page_size=page, layout="HND", t_q=t_q, method="mma" if mma else "auto")
    series = _series()
    lengths = start.copy()
    label = None
    for call in range(calls):
        # q in the plan's dtype; the oracle and the baseline take those values
        q = rng.standard_normal((m, t_q, h, d)).astype(q_dt).astype(np.float32)
        k_new = rng.standard_normal((m, t_q, h_kv, d)).astype(dt)
        v_new = rng.standard_normal((m, t_q, h_kv, d)).astype(dt)
        paged_append(k_new, v_new, d_k, d_v, d_table, lengths, layout="HND")
        for i in range(m):
            p = int(lengths[i])
            mirror_k[i, :, p:p + t_q] = k_new[i].transpose(1, 0, 2)
            mirror_v[i, :, p:p + t_q] = v_new[i].transpose(1, 0, 2)
        lengths = lengths + t_q
        q_in = q if t_q > 1 else q[:, 0]
        out = plan.run(to_device(q_in.astype(q_dt)), d_k, d_v, to_device(lengths),
                       page_table=d_table, sync=True)
        out = np.asarray(to_host(out)).reshape(m, t_q, h, d)
        lse = np.asarray(to_host(plan.lse)).reshape(m, t_q, h)
        o64, l64 = decode_attention_multi_ref(q, mirror_k, mirror_v, lengths)
        k32, v32 = np.nan_to_num(mirror_k).astype(np.float32), np.nan_to_num(
            mirror_v).astype(np.float32)
        if mma:  # the rounded-P baseline (S summed as the mma sums it)
            label = baseline_order(job.kernel, {"q": q[:, 0]}, dt)
            o32, l32 = baselines.decode_rounded_p(q, k32, v32, lengths, 1.0 / np.sqrt(d), dt,
                                                  sums="mma16")
        else:
            label = baseline_order("paged_decode", {"q": q[:, 0]}, dt)
            o32 = np.empty_like(out)
            l32 = np.empty_like(lse)
            for j in range(t_q):
                seen = lengths - t_q + 1 + j
                o32[:, j], l32[:, j] = baselines.decode_order(q[:, j], k32, v32, seen,
                                                              np.arange(m), label)
        judged = {"out": metrics.judge(out, o64, o32, label),
                  "lse": metrics.judge(lse, l64, l32, label)}
        _record_step(series, call + 1, int(lengths.max()), judged)
        if probe is not None:
            probe(call + 1, q, mirror_k, mirror_v, lengths, out, lse, o64, l64, o32, l32)
    # the pages after the run: every row a sequence holds as the mirror says, NaN elsewhere
    problems = []
    for name, dev, mirror in (("k_pages", d_k, mirror_k), ("v_pages", d_v, mirror_v)):
        want = np.full((n_pages, h_kv, page, d), np.nan)
        for i in range(m):
            for p in range(int(lengths[i])):
                want[table[i, p // page], :, p % page] = mirror[i, :, p]
        got = np.asarray(to_host(dev), dtype=np.float64)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        if not same.all():
            bad = np.argwhere(~same)
            problems.append(f"{name} differs from the appended rows at {tuple(bad[0])} "
                            f"({len(bad)} elements)")
    geometry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
    geometry.update(path=f"paged HND P={page}, t_q={t_q}, {plan.method} kernel, "
                         f"{plan.launch_path}",
                    shared_prefix=len(sharing), calls=calls)
    return series, not problems, "; ".join(problems), geometry


def _fp8_growth(job):
    """The fp8 growth runs (module docstring): per-(token, kv head) scales, on
    the fast decode or (``mma_fp8_decode``) the tensor-core one, q float16."""
    from attention.cache import fp8
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan
    from attention.oracle import decode_attention_ref

    g = FP8_GEOMETRY[job.small]
    m, h, h_kv, d = g["m"], g["h"], g["h_kv"], g["d"]
    page = PAGED_PAGE[job.small]
    start = np.array(g["start"], np.int32)
    max_seq = int(start.max()) + job.steps + 1  # one position is never written
    width = -(-max_seq // page)
    dt = fixtures.resolve_dtype(job.dtype)
    rng = fixtures.case_rng(job.seed, "growth", "fp8", job.small)
    n_pages, table = _shuffled_table(rng, m, width, page, start + job.steps)
    # the reference: host pages and scales (NaN codes / NaN scales where nothing lives)
    ref = {n: np.full((n_pages, h_kv, page, d), fp8.E4M3_NAN, np.uint8) for n in "kv"}
    ref_sc = {n: np.full((n_pages, h_kv, page), np.nan, np.float32) for n in "kv"}
    zeros = np.zeros(m, np.int32)
    pre = {n: rng.standard_normal((m, int(start.max()), h_kv, d)).astype(dt) for n in "kv"}
    for i in range(m):  # the prefixes, quantized by the reference
        n_i = int(start[i])
        for n in "kv":
            if n_i:
                fp8.quantize_append_ref(pre[n][i:i + 1, :n_i], ref[n], ref_sc[n],
                                        table[i:i + 1], zeros[:1])
    dev = {n: to_device(ref[n].copy()) for n in "kv"}
    dev_sc = {n: to_device(ref_sc[n].copy()) for n in "kv"}
    d_table = to_device(table)
    mma = job.kernel in MMA_RUNS
    q_dt = np.dtype(np.float16) if mma else np.dtype(np.float32)
    plan = DecodePlan(m, h, h_kv, d, n_pages, max_seq, cache_dtype="float8_e4m3fn",
                      q_dtype=q_dt, page_size=page, layout="HND", fp8_scales="token_head",
                      method="mma" if mma else "fast")
    series = _series()
    lengths = start.copy()

    # the reference's dequantized values, pooled [M, H_kv, max_seq, D] float64, NaN past
    # lengths; and K's and V's code values and row scales (the tensor-core baseline's
    # inputs: its scores are the kernel's, the codes summed, then the scales)
    mirror = {n: np.full((m, h_kv, max_seq, d), np.nan) for n in "kv"}
    codes = {n: np.zeros((m, h_kv, max_seq, d), np.float32) for n in "kv"}
    row_scales = {n: np.zeros((m, h_kv, max_seq), np.float32) for n in "kv"}

    def dequantize(first):
        for i in range(m):
            for p in range(int(first[i]), int(lengths[i])):
                pg, off = table[i, p // page], p % page
                for n in "kv":
                    mirror[n][i, :, p] = (fp8.decode_e4m3(ref[n][pg, :, off]).astype(np.float64)
                                          * ref_sc[n][pg, :, off, None])
                    codes[n][i, :, p] = fp8.decode_e4m3(ref[n][pg, :, off])
                    row_scales[n][i, :, p] = ref_sc[n][pg, :, off]

    dequantize(zeros)

    for step in range(job.steps):
        q = rng.standard_normal((m, h, d)).astype(q_dt).astype(np.float32)
        new = {n: rng.standard_normal((m, 1, h_kv, d)).astype(dt) for n in "kv"}
        fp8.fp8_append(new["k"], new["v"], dev["k"], dev["v"], d_table, to_device(lengths),
                       k_scales=dev_sc["k"], v_scales=dev_sc["v"], layout="HND")
        for n in "kv":
            fp8.quantize_append_ref(new[n], ref[n], ref_sc[n], table, lengths)
        before = lengths
        lengths = lengths + 1
        dequantize(before)
        out = plan.run(to_device(q.astype(q_dt)), dev["k"], dev["v"], to_device(lengths),
                       page_table=d_table, k_scale=dev_sc["k"], v_scale=dev_sc["v"], sync=True)
        out, lse = np.asarray(to_host(out)), np.asarray(to_host(plan.lse))
        kd, vd = mirror["k"], mirror["v"]
        o64, l64 = decode_attention_ref(q, kd, vd, lengths)
        if mma:  # V scales into P, normalised a row, rounded to f16 (mma16_pv16)
            label = baseline_order(job.kernel, {"q": q}, q_dt)
            o32, l32 = baselines.decode_rounded_p(
                q[:, None], codes["k"], codes["v"], lengths, 1.0 / np.sqrt(d), q_dt,
                sums="mma16", v_scales=row_scales["v"], k_scales=row_scales["k"])
            o32, l32 = o32[:, 0], l32[:, 0]
        else:
            label = baseline_order("fp8_decode", {"q": q}, np.uint8)
            o32, l32 = baselines.decode_order(q, np.nan_to_num(kd).astype(np.float32),
                                              np.nan_to_num(vd).astype(np.float32), lengths,
                                              np.arange(m), label)
        judged = {"out": metrics.judge(out, o64, o32, label),
                  "lse": metrics.judge(lse, l64, l32, label)}
        _record_step(series, step + 1, int(lengths.max()), judged)
    problems = []
    for n in "kv":
        got = np.asarray(to_host(dev[n]))
        if not np.array_equal(got, ref[n]):
            bad = np.argwhere(got != ref[n])
            problems.append(f"{n}_pages differ from the reference codes at {tuple(bad[0])} "
                            f"({len(bad)} bytes)")
        got_sc = np.asarray(to_host(dev_sc[n]))
        if not np.array_equal(got_sc.view(np.uint32), ref_sc[n].view(np.uint32)):
            problems.append(f"{n}_scales differ from the reference's")
    geometry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
    geometry.update(path=f"fp8 e4m3 token_head, paged HND P={page}, {plan.method} kernel, "
                         f"{plan.launch_path}")
    return series, not problems, "; ".join(problems), geometry


def mla_growth_inputs(job):
    """The MLA run's inputs: (dims, dtype, start, w_uk [nh, d_nope, r], w_uv [nh, d_v, r],
    c_all [start + steps, r], k_all [start + steps, d_rope], queries), ``queries``
    yielding each step's (q_nope [1, nh, d_nope], q_pe [1, nh, d_rope]) from the same
    generator, drawn when asked for (``bench.tgemm_emu`` replays the run from these)."""
    from mla import dims as mla_dims

    if job.small and job.kernel in ("mla_fp8_decode", "mla_mma_decode"):  # the
        # tensor-core kernel's widths
        dims = mla_dims.MlaDims(n_head=2, d_nope=16, d_rope=64, d_v=16, kv_rank=64)
    elif job.small:
        dims = mla_dims.SMALL_SHAPES[0]
    else:  # DeepSeek-V3 widths (heads: MLA_GPU_HEADS)
        dims = mla_dims.MlaDims(n_head=MLA_GPU_HEADS[job.kernel], d_nope=128, d_rope=64,
                                d_v=128, kv_rank=512)
    nh, d_nope, d_rope, d_v, r = dims.n_head, dims.d_nope, dims.d_rope, dims.d_v, dims.kv_rank
    dt = fixtures.resolve_dtype(job.dtype)
    rng = fixtures.case_rng(job.seed, "growth", "mla", job.small)
    start = MLA_START[job.small]
    w_uk = (rng.standard_normal((nh, d_nope, r)) / np.sqrt(r)).astype(np.float32)
    w_uv = (rng.standard_normal((nh, d_v, r)) / np.sqrt(r)).astype(np.float32)
    c_all = rng.standard_normal((start + job.steps, r)).astype(dt)
    k_all = rng.standard_normal((start + job.steps, d_rope)).astype(dt)

    def queries():
        for _ in range(job.steps):
            yield (rng.standard_normal((1, nh, d_nope)).astype(np.float32),
                   rng.standard_normal((1, nh, d_rope)).astype(np.float32))

    return dims, dt, start, w_uk, w_uv, c_all, k_all, queries()


def _mla_growth(job):
    from mla.cache import LatentCache
    from mla.oracle import mla_attend_absorbed
    from mla.pipeline import mla_decode_step

    dims, dt, start, w_uk, w_uv, c_all, k_all, queries = mla_growth_inputs(job)
    nh, d_nope, d_rope, d_v, r = dims.n_head, dims.d_nope, dims.d_rope, dims.d_v, dims.kv_rank
    cache = LatentCache(1, start + job.steps + 1, dims, dtype=dt)
    cache.append(0, c_all[:start], k_all[:start])
    series = _series()
    for step, (q_nope, q_pe) in enumerate(queries):
        length = start + step + 1
        cache.append(0, c_all[length - 1:length], k_all[length - 1:length])
        out = mla_decode_step(q_nope, q_pe, cache, 0, w_uk, w_uv,
                              method=MLA_METHODS[job.kernel])
        args = (q_nope, q_pe, c_all[:length].astype(np.float64), k_all[:length].astype(
            np.float64), w_uk, w_uv)
        ref = mla_attend_absorbed(*args)
        label = baseline_order(job.kernel, {"q_nope": q_nope})
        base = baselines.mla_order(*args, label)
        _record_step(series, step + 1, length, {"out": metrics.judge(out, ref, base, label)})
    problems = []
    rows = np.asarray(cache.rows(0), dtype=np.float64)
    want = np.concatenate([c_all, k_all], axis=1).astype(np.float64)
    if not np.array_equal(rows, want):
        problems.append("latent rows differ from the appended [c_kv | k_pe] rows")
    if not cache.in_step():
        problems.append("device lengths out of step with the host bookkeeping")
    plane = np.asarray(cache.plane(0).copy_to_host(), dtype=np.float64)
    if not np.isnan(plane[start + job.steps:]).all():
        problems.append("rows beyond the length were written")
    geometry = {"nh": nh, "d_nope": d_nope, "d_rope": d_rope, "d_v": d_v, "r": r,
                "start": start}
    return series, not problems, "; ".join(problems), geometry


def _mla_fp8_growth(job):
    """The fp8 latent cache's growth run (module docstring)."""
    from attention.core.device import to_device, to_host
    from mla import fp8
    from mla.fp8_append import fp8_append_latent
    from mla.oracle import mla_attend_absorbed
    from mla.pipeline import mla_decode

    if job.dtype != "float16":
        from attention.core.checks import DTypeError

        raise DTypeError(f"{job.dtype}: the fp8 latent row holds k_pe as float16 (mla.fp8)")
    dims, dt, start, w_uk, w_uv, c_all, k_all, queries = mla_growth_inputs(job)
    nh, d_nope, d_rope, d_v, r = dims.n_head, dims.d_nope, dims.d_rope, dims.d_v, dims.kv_rank
    cap = start + job.steps + 1  # one row past the last step: never written
    rb = fp8.row_bytes(r, d_rope)
    rows_all = np.concatenate([c_all, k_all], axis=1).astype(np.float32)  # [start + steps, W]
    codes = np.full((1, cap, rb), 0x7F, np.uint8)  # e4m3's NaN wherever nothing is appended
    scales = np.full((1, cap), np.nan, np.float32)
    d_codes, d_scales = to_device(codes), to_device(scales)
    mirror_c, mirror_s = codes.copy(), scales.copy()
    want_c, want_s = fp8.quantize(rows_all, r)  # the reference quantizer's rows

    def append(first, count):
        fp8_append_latent(rows_all[None, first:first + count].astype(dt), d_codes, None,
                          np.array([first]), scales=d_scales)
        mirror_c[0, first:first + count] = want_c[first:first + count]
        mirror_s[0, first:first + count] = want_s[first:first + count]

    append(0, start)
    label = baseline_order(job.kernel, {"k_pe": k_all}, np.float16)
    scale = 1.0 / np.sqrt(d_nope + d_rope)
    series = _series()
    for step, (q_nope, q_pe) in enumerate(queries):
        length = start + step + 1
        append(length - 1, 1)
        out = mla_decode(q_nope, q_pe, d_codes, np.array([length]), w_uk, w_uv,
                         latent_scale=d_scales)
        exact = fp8.dequantize(mirror_c[0, :length], mirror_s[0, :length], r)
        args = (q_nope, q_pe, exact[:, :r], exact[:, r:], w_uk, w_uv)
        ref = mla_attend_absorbed(*args)
        base = baselines.mla_rounded_p(*args, scale, np.float16)
        _record_step(series, step + 1, length,
                     {"out": metrics.judge(np.asarray(out), ref, base, label)})
    problems = []
    if not np.array_equal(to_host(d_codes), mirror_c):
        problems.append("cache bytes differ from the reference quantizer's rows (or a row "
                        "past the length was written)")
    if not np.array_equal(to_host(d_scales), mirror_s, equal_nan=True):
        problems.append("scales differ from the reference quantizer's")
    geometry = {"nh": nh, "d_nope": d_nope, "d_rope": d_rope, "d_v": d_v, "r": r,
                "start": start, "row_bytes": rb, "scales": "token"}
    return series, not problems, "; ".join(problems), geometry


def _mla_mma_growth(job):
    """The 16-bit tensor-core MLA's growth run (module docstring)."""
    from mla.cache import LatentCache
    from mla.oracle import mla_attend_absorbed
    from mla.pipeline import mla_decode

    if job.dtype != "float16":
        from attention.core.checks import DTypeError

        raise DTypeError(f"{job.dtype}: mla_decode(method='mma') takes a float16 latent cache")
    dims, dt, start, w_uk, w_uv, c_all, k_all, queries = mla_growth_inputs(job)
    nh, d_nope, d_rope, d_v, r = dims.n_head, dims.d_nope, dims.d_rope, dims.d_v, dims.kv_rank
    cap = start + job.steps + 1  # one row past the last step: never written
    cache = LatentCache(1, cap, dims, dtype=dt)
    cache.append(0, c_all[:start], k_all[:start])
    plane = cache.plane(0)
    d_latent = plane.reshape((1,) + tuple(plane.shape))
    label = baseline_order(job.kernel, {"k_pe": k_all}, np.float16)
    scale = 1.0 / np.sqrt(d_nope + d_rope)
    series = _series()
    for step, (q_nope, q_pe) in enumerate(queries):
        length = start + step + 1
        cache.append(0, c_all[length - 1:length], k_all[length - 1:length])
        out = mla_decode(q_nope, q_pe, d_latent, np.array([length], np.int32), w_uk, w_uv,
                         method="mma")
        args = (q_nope, q_pe, c_all[:length].astype(np.float64),
                k_all[:length].astype(np.float64), w_uk, w_uv)
        ref = mla_attend_absorbed(*args)
        base = baselines.mla_rounded_p(*args, scale, np.float16)
        _record_step(series, step + 1, length,
                     {"out": metrics.judge(np.asarray(out), ref, base, label)})
    problems = []
    rows = np.asarray(cache.rows(0), dtype=np.float64)
    want = np.concatenate([c_all, k_all], axis=1).astype(np.float64)
    if not np.array_equal(rows, want):
        problems.append("latent rows differ from the appended [c_kv | k_pe] rows")
    host_plane = np.asarray(plane.copy_to_host(), dtype=np.float64)
    if not np.isnan(host_plane[start + job.steps:]).all():
        problems.append("rows beyond the length were written")
    geometry = {"nh": nh, "d_nope": d_nope, "d_rope": d_rope, "d_v": d_v, "r": r,
                "start": start, "path": "mla_decode(method='mma')"}
    return series, not problems, "; ".join(problems), geometry


def _available(kernel):
    from validation.registry import _import

    for module in MODULES[kernel]:
        status, why = _import(module)
        if status != "ok":
            return status, why
    return "ok", None


def run_growth(job):
    """Run one growth job; returns a JSON-ready record (module docstring)."""
    rec = {"id": job.id, "kernel": job.kernel, "dtype": job.dtype, "seed": job.seed,
           "steps": job.steps, "passed": False, "detail": ""}
    status, why = _available(job.kernel)
    if status != "ok":
        rec.update(status=status, detail=str(why)[-2000:])
        return rec
    from attention.core.checks import DTypeError
    from attention.core.device import SIMULATOR

    if job.dtype == "bfloat16" and SIMULATOR:
        rec.update(status="unsupported", detail="the CUDA simulator has no bfloat16")
        return rec
    start = time.perf_counter()
    try:
        if job.kernel == "mla_fp8_decode":
            series, cache_ok, problems, geometry = _mla_fp8_growth(job)
        elif job.kernel == "mla_mma_decode":
            series, cache_ok, problems, geometry = _mla_mma_growth(job)
        elif job.kernel in MLA_METHODS:
            series, cache_ok, problems, geometry = _mla_growth(job)
        elif job.kernel in PAGED_T_Q:
            series, cache_ok, problems, geometry = _paged_growth(job, PAGED_T_Q[job.kernel])
        elif job.kernel in ("fp8_decode", "mma_fp8_decode"):
            series, cache_ok, problems, geometry = _fp8_growth(job)
        else:
            method = DECODE_METHODS[job.kernel]
            series, cache_ok, problems, geometry = _decode_growth(job, method)
    except DTypeError as exc:
        rec.update(status="unsupported", detail=f"DTypeError: {exc}")
        return rec
    except Exception:  # noqa: BLE001 - a run that raises fails
        rec.update(status="error", detail=traceback.format_exc(limit=6)[-3000:],
                   seconds=time.perf_counter() - start)
        return rec
    pooled_bad = _pooled_means(series)
    bad_steps = [s for s, ok in zip(series["step"], series["passed"]) if not ok]
    passed = cache_ok and not bad_steps
    ratios = [metrics.error_ratio(e, b) for e, b in zip(series["out_err"], series["out_base"])]
    margins = [e / bnd for e, bnd in zip(series["out_err"], series["out_bound"])]
    detail = problems
    if bad_steps:
        detail = (detail + "; " if detail else "") + (
            f"{len(bad_steps)} of {job.steps} steps over the bound (first: step {bad_steps[0]})"
            + (f"; pooled mean rule: {'; '.join(pooled_bad[:3])}" if pooled_bad else ""))
    rec.update(status="pass" if passed else "fail", passed=passed, series=series,
               geometry=geometry, cache_ok=cache_ok, detail=detail,
               seconds=time.perf_counter() - start,
               worst_ratio=max(ratios, default=0.0), worst_margin=max(margins, default=0.0),
               final_err=series["out_err"][-1] if series["out_err"] else None,
               final_base=series["out_base"][-1] if series["out_base"] else None)
    return rec
