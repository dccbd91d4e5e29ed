"""The benchmark run behind ``scripts/bench`` (one GPU run, ~minutes).

Sections (each optional part is wrapped: a failure is printed and recorded,
never fatal):
  1. ceilings: device-to-device copy bandwidth; fp32 FMA peak (numba kernel);
     tensor-core peaks (torch matmul, tf32 and bf16; when torch imports)
  2. decode kernels at B 32, H 32, H_kv 8, D 128, L in {1024, 4096, 16384} and
     B 1, L 32768, fp32 / fp16 / bf16: warp-per-head (fp32), split-KV
     (attention.reference.split_decode, when present), the fast kernels
     (attention.decode.fast), torch SDPA (when torch imports) on unexpanded
     K/V with ``enable_gqa``, labelled with the backend that ran
     (``torch_sdpa[math]``, bench/sdpa.py), and in fp32 also the
     memory-efficient backend on K/V expanded to all query heads
     (``torch_sdpa_expanded[efficient]``)
  3. MLA decode: B 64, 128 heads, latent 512 + rope 64, L 4096, fp32 / fp16
     cache: mla.pipeline.mla_decode (when present) by its GEMM path (row
     ``mla_decode``, scratch reused across calls: host work included), the
     same launches prepared once and replayed as a CUDA graph
     (``mla_decode_graph``, mla.decode_graph; the score and P.V GEMMs on
     tensor cores, fp32 operands split in two tf32 halves), the same with
     fp32 FMA GEMMs only (``mla_decode_graph_fma``), the tiled online-softmax
     path (``mla_decode_flash``), and a torch einsum absorbed decode (TF32
     off; as context, in fp32 also with TF32 on, and with the fp16 cache
     cast to fp32 in each call and fp32 math): TFLOP/s of the fp32 work
     (the tensor-core rows count each product once) against a peak measured
     in the same run: the fp32 FMA peak for FMA rows, the tf32 tensor-core
     peak for the tensor-core rows (ours and einsum with TF32), the bf16 one
     for the fp16 einsum; and each row's max error against a float64 decode
     of every sequence of the batch (vectorised numpy) beside numpy float32's
  4. decode step host cost: plain numba launches vs the replayed CUDA graph
  5. prefill: the fused attention.prefill path, the float32 tensor-core one (method "tf32"),
     the two reference paths and torch SDPA at T 512 / 2048 / 4096, H 32, H_kv 8, D 128, causal (bench/prefill.py; every row timed with
     its host work, GQA as in decode)
  6. decode host time a call (run first): ``DecodePlan.run`` with numba device
     arrays and with torch tensors, torch SDPA's call (backend named), and the
     one-call functions, each with its device time, fp16 B 32 / H 32 / H_kv 8
     / D 128 / L 4096 (``bench_host``)
  7. paged caches and batch invariance (bench/paged.py): ``DecodePlan.run``
     on contiguous and paged (HND / NHD, pages of 1, 16, 64) fp16 / bf16
     caches, batch-invariant plans, fixed split lengths, torch SDPA
  8. prefill on 16-bit tensor cores (bench/prefill_mma.py, section ``prefill_mma``,
     run last): ``attention.prefill.mma`` against torch SDPA in fp16 and
     bf16 at T 2048 / 4096, H 32, H_kv 8, D 128, causal, with the oracle check of
     kv group 0 and the issue's ratio target at T 4096
Outputs: reports/bench/{decode.csv, decode.png, mla.csv, step.csv, host.csv, prefill.csv,
prefill_mma.csv, paged.csv, summary.md, tables.json}.

One report in two runs (the whole bench outgrew one 10-minute GPU call on the
H200): ``--skip A,B`` leaves sections out (the summary lists them as skipped and
``--check-fresh`` reads it as partial); ``--resume`` then reads ``tables.json`` back,
runs only the sections the report lacks (skipped, cut by an interrupt, not
reached, or failed) and writes the whole report again, each section judged
against the ceilings of its own run (the summary names each run's sections and
ceilings). It refuses a report of other kernel sources or another GPU model.

Timing (bench.gpu.Timer / TorchTimer): CUDA events around the timed work,
median of the repeats after warm-up; before each repeat the L2 is flushed
(512 MB read) and the GPU sleeps (``HOLD_US``, doubled whenever the start
event had completed before the work was enqueued), so a launch's host cost is
not measured as device time. Rows marked "host work included" (public
launchers) are timed without the sleep.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .paged import COLUMNS as PAGED_COLUMNS
from .paged import bench_paged
from .mla_multi import COLUMNS as MLA_MULTI_COLUMNS
from .mla_multi import bench_mla_multi
from .mla_multi import summary_lines as mla_multi_summary_lines
from .mla_mma import COLUMNS as MLA_MMA_COLUMNS
from .mla_mma import bench_mla_mma
from .mla_mma import summary_lines as mla_mma_summary_lines
from .paged import summary_lines as paged_summary_lines
from .prefill import COLUMNS as PREFILL_COLUMNS
from .prefill import bench_prefill
from .prefill import summary_lines as prefill_summary_lines
from .prefill_mma import COLUMNS as PREFILL_MMA_COLUMNS
from .prefill_mma import bench_prefill_mma
from .prefill_mma import summary_lines as prefill_mma_summary_lines
from .sdpa import backend_of as sdpa_backend_of
from .sdpa import base_name
from .sdpa import label as sdpa_label
from .sdpa import run_with as sdpa_run_with

ROOT = Path(__file__).resolve().parent.parent

DECODE_SHAPES = [(32, 32, 8, 128, 1024), (32, 32, 8, 128, 4096), (32, 32, 8, 128, 16384),
                 (1, 32, 8, 128, 32768)]
DTYPES = ["float32", "float16", "bfloat16"]
COLUMNS = ["kernel", "dtype", "batch", "heads", "kv_heads", "head_dim", "seq_len", "ms",
           "GBps", "frac_of_copy"]


def log(*a):
    print(*a, flush=True)


def cover_note(timer, seen):
    """Text for a log line when ``timer``'s host cover was raised since ``seen``
    entries of ``timer.raised`` (bench.gpu.HOLD_US); '' otherwise."""
    new = timer.raised[seen:]
    return f" [host cover raised: {new}]" if new else ""


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def decode_bytes(b, h, kv, d, seq, itemsize, q_itemsize=4):
    """Fewest bytes a decode must move: K and V read once per kv group
    (2 * B * H_kv * L * D * itemsize; the group's query heads share the read),
    plus q read (B * H * D) and out written (B * H * D float32) and lse (B * H)."""
    return (2 * b * kv * seq * d * itemsize + b * h * d * q_itemsize + b * h * d * 4
            + b * h * 4)


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------

def oracle_check(out_dev, q_dev, k_dev, v_dev, seq, n_check=1):
    """Max |err| of sequences 0..n_check-1 against the float64 oracle (values as stored)."""
    from attention.oracle import decode_attention_ref

    out = out_dev.copy_to_host()[:n_check]
    q = q_dev.copy_to_host()[:n_check]
    k = np.ascontiguousarray(k_dev[:n_check].copy_to_host()).astype(np.float64)
    v = np.ascontiguousarray(v_dev[:n_check].copy_to_host()).astype(np.float64)
    ref, _ = decode_attention_ref(q.astype(np.float64), k, v, [seq] * n_check)
    return float(np.abs(out - ref).max())


def bench_decode(timer, copy_gbps, torch, variants, rows, checks_log, quick):
    """Decode rows (``DECODE_SHAPES`` x ``DTYPES``) into ``rows``; spot checks into ``checks_log``."""
    seen = [len(timer.raised)]  # host-cover raises already logged
    from numba import cuda

    from attention.decode import fast as F
    from attention.reference.warp_decode import batched_decode_kernel, n_chunks

    try:
        from attention.reference.split_decode import flash_decode_attention
    except Exception as exc:  # another module; optional here
        flash_decode_attention = None
        log(f"  split-KV flash_decode: skipped ({type(exc).__name__}: {exc})")
    ttimer = None
    if torch is not None:
        from .gpu import TorchTimer

        ttimer = TorchTimer(torch)

    from .gpu import random_array

    shapes = DECODE_SHAPES[:2] if quick else DECODE_SHAPES
    for (b, h, kv, d, seq) in shapes:
        for dname in DTYPES:
            dt = np_dtype(dname)
            try:
                k = random_array((b, kv, seq, d), dt, 11)
                v = random_array((b, kv, seq, d), dt, 12)
                q = random_array((b, h, d), np.float32, 13)
            except Exception as exc:
                log(f"  {dname} L={seq}: allocation failed: {exc}")
                continue
            lens = cuda.to_device(np.full(b, seq, np.int32))
            slots = cuda.to_device(np.arange(b, dtype=np.int32))
            out = cuda.device_array((b, h, d), np.float32)
            lse = cuda.device_array((b, h), np.float32)
            scale = np.float32(1.0 / math.sqrt(d))
            nbytes = decode_bytes(b, h, kv, d, seq, dt.itemsize)

            def record(name, ms, note=""):
                note += cover_note(timer, seen[0])
                seen[0] = len(timer.raised)
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append({"kernel": name, "dtype": dname, "batch": b, "heads": h,
                             "kv_heads": kv, "head_dim": d, "seq_len": seq,
                             "ms": round(ms, 5), "GBps": round(gbps, 1),
                             "frac_of_copy": round(gbps / copy_gbps, 3)})
                log(f"  {name:<22} {dname:<9} B={b:<3} L={seq:<6} {ms:8.4f} ms "
                    f"{gbps:8.1f} GB/s  {gbps / copy_gbps:5.3f} of copy {note}")

            # -- warp per head (fp32 caches only) --
            if dname == "float32" and not (seq >= 16384 and quick):
                try:
                    kern = batched_decode_kernel(n_chunks(d))

                    def run_wph():
                        kern[(h, b), 32, 0](q, k, v, lens, slots, scale, out, lse)

                    ms = timer.time(run_wph, reps=5, warmup=1)
                    checks_log.append(("warp_per_head", dname, b, seq,
                                       oracle_check(out, q, k, v, seq)))
                    record("warp_per_head", ms)
                except Exception as exc:
                    log(f"  warp_per_head failed: {type(exc).__name__}: {exc}")

            # -- split-KV (another module; its own launcher, device arrays) --
            if flash_decode_attention is not None:
                try:
                    st = cuda.default_stream()
                    lens_h, slots_h = np.full(b, seq, np.int32), np.arange(b, dtype=np.int32)

                    def run_fd():
                        flash_decode_attention(q, k, v, lens_h, slots_h, out=out, lse=lse,
                                               stream=st)

                    ms = timer.time(run_fd, reps=10, host=True)
                    checks_log.append(("flash_decode", dname, b, seq,
                                       oracle_check(out, q, k, v, seq)))
                    record("flash_decode", ms, "(public launcher: host work included)")
                except Exception as exc:
                    log(f"  flash_decode {dname}: skipped ({type(exc).__name__}: "
                        f"{str(exc)[:120]})")

            # -- fast kernels (planned once; raw launches on stream 0) --
            kind = F.dtype_kind(dt)
            for vname, kw in variants:
                try:
                    pl = F.plan(b, h, kv, d, seq, kind, **kw)
                    pa, pm = F.scratch(b, h, d, pl["n_split"])

                    def run_fast():
                        F.launch(pl, q, k, v, lens, slots, scale, out, lse, pa, pm, 0)

                    ms = timer.time(run_fast, reps=20)
                    err = oracle_check(out, q, k, v, seq)
                    checks_log.append((vname, dname, b, seq, err))
                    dep = ", dependent combine" if pl["n_split"] > 1 and pl["pdl"] else ""
                    record(vname, ms, f"(splits {pl['n_split']}{dep}, err {err:.1e})")
                except Exception as exc:
                    log(f"  {vname} {dname} failed: {type(exc).__name__}: {exc}")
                    traceback.print_exc()

            # -- torch SDPA (optional): unexpanded K/V with enable_gqa, the backend
            #    torch picks named in the label; fp32 also the memory-efficient
            #    backend on K/V expanded to every query head --
            if torch is not None:
                try:
                    tdt = {"float32": torch.float32, "float16": torch.float16,
                           "bfloat16": torch.bfloat16}[dname]

                    def as_torch(a):
                        if dname == "bfloat16":
                            return torch.as_tensor(a.view(np.int16), device="cuda").view(
                                torch.bfloat16)
                        return torch.as_tensor(a, device="cuda")

                    tk, tv = as_torch(k), as_torch(v)  # [B, H_kv, L, D], zero copy
                    tq = torch.as_tensor(q, device="cuda").to(tdt).reshape(b, h, 1, d)
                    sdpa = torch.nn.functional.scaled_dot_product_attention

                    def run_sdpa():
                        sdpa(tq, tk, tv, enable_gqa=True)

                    backend, how = sdpa_backend_of(torch, run_sdpa)
                    ms = ttimer.time(run_sdpa, reps=20)
                    record(sdpa_label("torch_sdpa", backend), ms,
                           f"(enable_gqa, K/V [B, H_kv, L, D]; backend from {how})")
                    if dname == "float32":
                        try:
                            ek = tk.repeat_interleave(h // kv, dim=1)  # [B, H, L, D]
                            ev = tv.repeat_interleave(h // kv, dim=1)

                            def run_expanded():
                                sdpa_run_with(torch, "efficient",
                                              lambda: sdpa(tq, ek, ev))

                            ms = ttimer.time(run_expanded, reps=20)
                            record(sdpa_label("torch_sdpa_expanded", "efficient"), ms,
                                   "(K/V repeat_interleave'd to all H heads before timing; "
                                   "bytes counted as for the others)")
                            del ek, ev
                        except Exception as exc:
                            log(f"  torch_sdpa_expanded {dname}: skipped "
                                f"({type(exc).__name__}: {str(exc)[:160]})")
                    del tk, tv, tq
                except Exception as exc:
                    log(f"  torch_sdpa {dname}: skipped ({type(exc).__name__}: "
                        f"{str(exc)[:160]})")
            del k, v, q
            cuda.current_context().deallocations.clear()


# ---------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------

MLA = dict(batch=64, heads=128, latent=512, rope=64, nope=128, v_dim=128, seq=4096)


def mla_inputs(dname, shape=None):
    """The MLA benchmark's inputs at ``shape`` (default ``MLA``'s), the same in every run:
    q_nope [B, H, nope], q_pe [B, H, rope], cache [B, L, latent + rope] in
    ``dname`` (float32 / float16), w_uk [H, nope, latent], w_uv [H, v_dim, latent]
    (device arrays, values of size <= 1) and lengths [B] int32, all L (host)."""
    from .gpu import random_array

    c = shape or MLA
    b, h, lat, rope, nope, vd, seq = (c["batch"], c["heads"], c["latent"], c["rope"],
                                      c["nope"], c["v_dim"], c["seq"])
    cache = random_array((b, seq, lat + rope), np.dtype(dname), 21)
    q_nope = random_array((b, h, nope), np.float32, 22)
    q_pe = random_array((b, h, rope), np.float32, 23)
    w_uk = random_array((h, nope, lat), np.float32, 24)
    w_uv = random_array((h, vd, lat), np.float32, 25)
    return q_nope, q_pe, cache, np.full(b, seq, np.int32), w_uk, w_uv


def mla_flops(batch, heads, latent, rope, nope, v_dim, seq):
    """Absorbed MLA decode flops: q absorption (2*nope*latent), scores over
    latent+rope (2*L*(latent+rope)), P.latent (2*L*latent), output projection
    (2*latent*v_dim), per (sequence, head)."""
    per = 2 * nope * latent + 2 * seq * (latent + rope) + 2 * seq * latent + 2 * latent * v_dim
    return batch * heads * per


def mla_decode_batch(q_nope, q_pe, cache, w_uk, w_uv, lat, dtype=np.float64, chunk=8):
    """Absorbed MLA decode of a whole batch in numpy, vectorised, at ``dtype``
    (float64: the oracle; float32: the same-precision baseline): sequence b's
    one query attends all L rows of ``cache[b]``.

    q_nope [B, nh, d_nope], q_pe [B, nh, d_rope], cache [B, L, lat + d_rope]
    ([c_kv | k_pe]), w_uk [nh, d_nope, lat], w_uv [nh, d_v, lat] (host arrays);
    scale 1/sqrt(d_nope + d_rope). Sequences go ``chunk`` at a time (bounded
    scratch). Returns out [B, nh, d_v] in ``dtype``.
    """
    f = np.dtype(dtype).type
    n_b, nh, d_nope = q_nope.shape
    scale = f(1.0 / math.sqrt(d_nope + q_pe.shape[2]))
    uk = np.asarray(w_uk, dtype=f)  # [nh, d_nope, lat]
    uv_t = np.ascontiguousarray(np.asarray(w_uv, dtype=f).transpose(0, 2, 1))  # [nh, lat, d_v]
    out = np.empty((n_b, nh, uv_t.shape[2]), f)
    for b0 in range(0, n_b, chunk):
        b1 = min(b0 + chunk, n_b)
        qn = np.asarray(q_nope[b0:b1], dtype=f).transpose(1, 0, 2)  # [nh, b, d_nope]
        q_lat = np.matmul(qn, uk).transpose(1, 0, 2)  # [b, nh, lat]
        c = np.asarray(cache[b0:b1], dtype=f)
        ckv, kpe = c[:, :, :lat], c[:, :, lat:]  # [b, L, lat], [b, L, d_rope]
        qp = np.asarray(q_pe[b0:b1], dtype=f)
        scores = (np.matmul(q_lat, ckv.transpose(0, 2, 1))
                  + np.matmul(qp, kpe.transpose(0, 2, 1))) * scale  # [b, nh, L]
        scores -= scores.max(axis=2, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=2, keepdims=True)
        o_lat = np.matmul(p, ckv)  # [b, nh, lat]
        out[b0:b1] = np.matmul(o_lat.transpose(1, 0, 2), uv_t).transpose(1, 0, 2)
    return out


class MLACheck:
    """The bench's accuracy column: outputs of every sequence of the batch
    against the float64 absorbed decode (``mla_decode_batch``, vectorised
    numpy), beside the same-precision numpy float32 baseline's error.

    q_nope [B, nh, d_nope], q_pe [B, nh, d_rope], cache [B, L, lat + d_rope],
    w_uk [nh, d_nope, lat], w_uv [nh, d_v, lat] (device or host arrays)."""

    def __init__(self, q_nope, q_pe, cache, w_uk, w_uv, lat):
        qn, qp, c = _host(q_nope), _host(q_pe), _host(cache)
        uk, uv = _host(w_uk), _host(w_uv)
        self.n = int(qn.shape[0])
        # fp16 cache values are exact in float64 and float32
        self.ref = mla_decode_batch(qn, qp, c, uk, uv, lat, np.float64)
        base = mla_decode_batch(qn, qp, c, uk, uv, lat, np.float32)
        self.base_err = float(np.abs(base - self.ref).max())

    def error(self, out):
        """max |out - oracle| over all sequences; ``out`` [B, nh, d_v] device or host."""
        return float(np.abs(_host(out).astype(np.float64) - self.ref).max())


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


# the peaks a row's TFLOP/s is set against (bench.gpu): the fp32 FMA peak for
# FMA work, torch matmul peaks for tensor-core work
PEAK_NAMES = {"fp32_fma": "fp32 FMA peak", "tf32_tc": "tf32 tensor-core peak",
              "bf16_tc": "bf16 tensor-core peak"}


def frac_of_peak(tflops, peaks, peak):
    """``tflops / peaks[peak]`` rounded to 3 places, None when that peak was
    not measured (e.g. the tensor-core peaks without torch)."""
    value = peaks.get(peak)
    return round(tflops / value, 3) if value else None


def fmt_frac(frac):
    return "n/a" if frac is None else f"{frac:.3f}"


def bench_mla(timer, peaks, torch, mla_rows, shape=None):
    """MLA rows into ``mla_rows``; ``peaks``: {"fp32_fma", "tf32_tc", "bf16_tc"}
    TFLOP/s (a tensor-core peak None when it was not measured); ``shape``: a
    dict as ``MLA`` (default)."""
    seen = [len(timer.raised)]  # host-cover raises already logged
    from numba import cuda

    c = shape or MLA
    b, h, lat, rope, nope, vd, seq = (c["batch"], c["heads"], c["latent"], c["rope"],
                                      c["nope"], c["v_dim"], c["seq"])
    flops = mla_flops(b, h, lat, rope, nope, vd, seq)
    try:
        from mla.pipeline import mla_decode
    except Exception as exc:
        mla_decode = None
        log(f"  mla.pipeline.mla_decode: skipped ({type(exc).__name__}: {exc})")
    for dname in ("float32", "float16"):

        def record(name, ms, note="", out=None, peak="fp32_fma"):
            note += cover_note(timer, seen[0])
            seen[0] = len(timer.raised)
            tf = flops / (ms * 1e-3) / 1e12
            err = check.error(out) if out is not None else float("nan")
            frac = frac_of_peak(tf, peaks, peak)
            mla_rows.append({"kernel": name, "dtype": dname, "batch": b, "heads": h,
                             "latent": lat, "rope": rope, "seq_len": seq, "ms": round(ms, 4),
                             "TFLOPs": round(tf, 2), "peak": peak, "frac_of_peak": frac,
                             "max_err": float(f"{err:.3g}"),
                             "numpy_fp32_err": float(f"{check.base_err:.3g}")})
            log(f"  {name:<20} {dname:<8} {ms:8.3f} ms {tf:7.2f} TFLOP/s "
                f"{fmt_frac(frac)} of {PEAK_NAMES[peak]}, err {err:.2g} {note}")

        q_nope, q_pe, cache, lengths, w_uk, w_uv = mla_inputs(dname)
        check = MLACheck(q_nope, q_pe, cache, w_uk, w_uv, lat)
        log(f"  (err: max |out - float64 oracle| over all {check.n} sequences; "
            f"numpy float32 gives {check.base_err:.2g})")
        if mla_decode is not None:
            try:
                st = cuda.default_stream()

                from mla.attn_gemm import Workspace

                ws = Workspace()  # scratch reused across steps, as a decode loop would

                def run_gemm():
                    return mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                                      method="gemm", workspace=ws)

                def run_flash():
                    return mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                                      method="flash")

                record("mla_decode", timer.time(run_gemm, reps=5, warmup=1, host=True),
                       "(method gemm: scores and P.V on tensor cores, split tf32; public "
                       "launcher, host work included)", out=run_gemm(), peak="tf32_tc")
                if dname == "float16":
                    def run_mma():
                        return mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                                          method="mma")

                    record("mla_decode_mma", timer.time(run_mma, reps=5, warmup=1, host=True),
                           "(method mma: 16-bit tensor cores, q and P rounded to fp16; public "
                           "launcher, host work included)", out=run_mma(), peak="bf16_tc")
                del ws
                # the same launches prepared once and replayed as a CUDA graph, with
                # the tensor-core GEMMs and with fp32 FMA GEMMs only (method gemm_fma)
                for name, tensor, what, peak in (
                        ("mla_decode_graph", True, "tensor-core score and P.V GEMMs",
                         "tf32_tc"),
                        ("mla_decode_graph_fma", False, "fp32 FMA GEMMs only", "fp32_fma")):
                    try:
                        from mla.decode_graph import MLADecodeGraph

                        g = MLADecodeGraph(q_nope, q_pe, cache, lengths, w_uk, w_uv,
                                           tensor=tensor)
                        if g.graph is None:
                            raise RuntimeError(f"no graph ({g.fallback_reason})")
                        g.run(sync=True)
                        ms = timer.time_on_stream(g.run, g.stream_handle, reps=5, warmup=1)
                        g.run(sync=True)
                        record(name, ms,
                               f"(MLADecodeGraph: the GEMM path's launches replayed; {what})",
                               out=g.out, peak=peak)
                        del g
                    except Exception as exc:
                        log(f"  {name} {dname}: skipped ({type(exc).__name__}: "
                            f"{str(exc)[:200]})")
                record("mla_decode_flash", timer.time(run_flash, reps=3, warmup=1, host=True),
                       "(method flash: tiled online softmax; public launcher, host work included)",
                       out=run_flash())
            except Exception as exc:
                log(f"  mla_decode {dname}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
        if torch is not None:
            try:
                from .gpu import TorchTimer

                torch.backends.cuda.matmul.allow_tf32 = False
                tt = TorchTimer(torch)
                tdt = torch.float32 if dname == "float32" else torch.float16
                tc = torch.as_tensor(cache, device="cuda")
                tqn = torch.as_tensor(q_nope, device="cuda").to(tdt)
                tqp = torch.as_tensor(q_pe, device="cuda").to(tdt)
                tuk = torch.as_tensor(w_uk, device="cuda").to(tdt)
                tuv = torch.as_tensor(w_uv, device="cuda").to(tdt)

                def einsum_decode(qn, qp, c, uk, uv):
                    return einsum_mla_decode(torch, qn, qp, c, uk, uv, lat)

                def run_einsum():
                    return einsum_decode(tqn, tqp, tc, tuk, tuv)

                def einsum_out(fn=run_einsum):
                    return fn().float().cpu().numpy()

                ms = tt.time(run_einsum, reps=10)
                record("torch_einsum", ms, "(fp16: tensor cores)" if dname == "float16" else
                       "(fp32, TF32 off: the yardstick)", out=einsum_out(),
                       peak="bf16_tc" if dname == "float16" else "fp32_fma")
                if dname == "float32":
                    # context only: TF32 products keep 10 mantissa bits, so its error
                    # is orders above float32's (see the err column)
                    torch.backends.cuda.matmul.allow_tf32 = True
                    try:
                        ms = tt.time(run_einsum, reps=10)
                        record("torch_einsum_tf32", ms, "(fp32 operands, TF32 on: context, "
                               "not the yardstick)", out=einsum_out(), peak="tf32_tc")
                    finally:
                        torch.backends.cuda.matmul.allow_tf32 = False
                else:
                    # context only: the fp16 cache cast to fp32 in every call (the cast
                    # is timed), fp32 q and weights, TF32 off: the precision of ours
                    f32 = [torch.as_tensor(x, device="cuda") for x in (q_nope, q_pe, w_uk, w_uv)]

                    def run_upcast():
                        return einsum_decode(f32[0], f32[1], tc.float(), f32[2], f32[3])

                    ms = tt.time(run_upcast, reps=10)
                    record("torch_einsum_upcast", ms, "(fp16 cache cast to fp32 in each call, "
                           "fp32 math, TF32 off: context)", out=einsum_out(run_upcast))
            except Exception as exc:
                log(f"  torch einsum {dname}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
        del cache


def einsum_mla_decode(torch, qn, qp, c, uk, uv, lat):
    """torch einsum absorbed MLA decode, the benchmark's comparison (also profiled).

    qn [B, H, nope], qp [B, H, rope], c [B, L, lat + rope], uk [H, nope, lat],
    uv [H, v_dim, lat], every operand in c's dtype; the softmax runs in fp32 and P is
    cast back to c's dtype. Returns [B, H, v_dim] in c's dtype.
    """
    scale = 1.0 / math.sqrt(qn.shape[-1] + qp.shape[-1])
    qa = torch.einsum("bhd,hdc->bhc", qn, uk)  # [B, H, latent]
    s = (torch.einsum("bhc,blc->bhl", qa, c[..., :lat])
         + torch.einsum("bhr,blr->bhl", qp, c[..., lat:])) * scale
    p = torch.softmax(s.float(), dim=-1).to(c.dtype)  # [B, H, L]
    ol = torch.einsum("bhl,blc->bhc", p, c[..., :lat])  # [B, H, latent]
    return torch.einsum("bhc,hdc->bhd", ol, uv)  # [B, H, v_dim]


# ---------------------------------------------------------------------------
# decode step host cost
# ---------------------------------------------------------------------------

HOST_SHAPE = (32, 32, 8, 128, 4096)  # B, H, H_kv, D, L; fp16 cache and q
HOST_TARGET_US = 25.0  # DecodePlan.run's host time per call


def host_times(fn, sync, n=300):
    """Host microseconds of one ``fn()``: (median with an idle queue, minimum,
    mean per call over ``n`` calls back to back). ``sync`` waits for the GPU."""
    for _ in range(3):
        fn()
    sync()
    idle = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        idle.append((time.perf_counter() - t0) * 1e6)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    back = (time.perf_counter() - t0) * 1e6 / n
    sync()
    return statistics.median(idle), min(idle), back


def bench_host(timer, torch, host_rows, checks_log):
    """Host time per decode call at ``HOST_SHAPE`` (fp16): ``DecodePlan.run`` with
    numba device arrays and with torch tensors (the same memory), torch SDPA's
    call (backend named), and as context the one-call functions; each with the
    device time of its launches (CUDA events, ``Timer`` / ``TorchTimer``)."""
    from numba import cuda

    from attention.decode.api import decode
    from attention.decode.fast import batched_decode_attention_fast
    from attention.decode.plan import DecodePlan

    from .gpu import random_array

    b, h, kv, d, seq = HOST_SHAPE
    k = random_array((b, kv, seq, d), np.float16, 21)
    v = random_array((b, kv, seq, d), np.float16, 22)
    q = random_array((b, h, d), np.float16, 23)
    lens = cuda.to_device(np.full(b, seq, np.int32))
    slots = cuda.to_device(np.arange(b, dtype=np.int32))
    pl = DecodePlan(b, h, kv, d, b, seq, cache_dtype="float16", q_dtype="float16")
    log(f"  DecodePlan: {pl.launch_path} ({pl.launch_reason}); splits {pl.n_split}, "
        f"pdl {pl.fast_plan['pdl']}")

    def record(call, fn, kernel_ms, note="", shape=(b, h, kv, d, seq)):
        med, low, back = host_times(fn, cuda.synchronize)
        host_rows.append({"call": call, "dtype": "float16", "batch": shape[0],
                          "heads": shape[1], "kv_heads": shape[2], "head_dim": shape[3],
                          "seq_len": shape[4],
                          "host_us_median": round(med, 2), "host_us_min": round(low, 2),
                          "host_us_back_to_back": round(back, 2),
                          "kernel_ms": None if kernel_ms is None else round(kernel_ms, 5),
                          "note": note})
        log(f"  {call:<44} host {med:8.2f} us (median, idle queue; min {low:.2f}, "
            f"back to back {back:.2f})  device "
            + ("-" if kernel_ms is None else f"{kernel_ms * 1e3:.1f} us") + f" {note}")

    def run_numba():
        pl.run(q, k, v, lens, slots)

    kernel_ms = timer.time(run_numba, reps=20)
    pl.check()
    checks_log.append(("DecodePlan.run", "float16", b, seq, oracle_check(pl.out, q, k, v, seq)))
    record("DecodePlan.run (numba device arrays)", run_numba, kernel_ms)
    if torch is not None:
        from .gpu import TorchTimer

        tq, tk, tv = (torch.as_tensor(a, device="cuda") for a in (q, k, v))
        tl, ts = torch.as_tensor(lens, device="cuda"), torch.as_tensor(slots, device="cuda")
        tout = torch.empty((b, h, d), dtype=torch.float32, device="cuda")

        def run_torch():
            pl.run(tq, tk, tv, tl, ts, out=tout)

        def run_torch_stream():
            pl.run(tq, tk, tv, tl, ts, out=tout, stream=torch.cuda.current_stream())

        record("DecodePlan.run (torch tensors)", run_torch, timer.time(run_torch, reps=20))
        record("DecodePlan.run (torch tensors, torch stream)", run_torch_stream, None)
        pl.check()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sq = tq.reshape(b, h, 1, d)

        def run_sdpa():
            sdpa(sq, tk, tv, enable_gqa=True)

        try:
            backend, how = sdpa_backend_of(torch, run_sdpa)
            ttimer = TorchTimer(torch)
            record(sdpa_label("torch SDPA", backend), run_sdpa, ttimer.time(run_sdpa, reps=20),
                   f"(enable_gqa; backend from {how})")
        except Exception as exc:
            log(f"  torch SDPA: skipped ({type(exc).__name__}: {str(exc)[:160]})")
    st = cuda.default_stream()
    record("decode(...) one call (numba arrays, stream)",
           lambda: decode(q, k, v, lens, slots, stream=st), None, "(plan cache look-up)")
    record("batched_decode_attention_fast (old one call)",
           lambda: batched_decode_attention_fast(q, k, v, lens, slots, stream=st), None,
           "(lengths to the host, re-plan, allocation each call)")
    del k, v, q
    cuda.current_context().deallocations.clear()
    # the captured MLA decode (mla.decode_graph): one replay's host time, GEMM path and
    # tensor-core attention; head_dim is the latent row (r + d_rope), kv_heads its one head
    from mla.decode_graph import MLADecodeGraph

    from .mla_multi import SHAPE as MLA_SHAPE

    c = dict(MLA_SHAPE, seq=1024)
    m_in = mla_inputs("float16", c)
    for method in (None, "mma"):
        g = MLADecodeGraph(*m_in, method=method)
        if g.graph is None:
            log(f"  MLADecodeGraph(method={method}): no graph ({g.fallback_reason})")
            continue
        g.run(sync=True)
        record(f"MLADecodeGraph.run (method={method or 'gemm'}, graph replay)", g.run,
               timer.time_on_stream(g.run, g.stream_handle, reps=5, warmup=1),
               "(MLA: B 64, 128 heads, latent 512 + 64)",
               shape=(c["batch"], c["heads"], 1, c["latent"] + c["rope"], c["seq"]))
        g.run(sync=True)
        g = None
    m_in = None
    cuda.current_context().deallocations.clear()


def bench_step(timer, step_rows):
    """One decode step (prepare + scatter + attention) of ``DecodeState`` in
    eager and graph mode, fp16 and fp32 (``bench.step``)."""
    from .step import bench_decode_step

    bench_decode_step(step_rows, log, timer=timer)


def bench_long_mla(timer, long_rows):
    """``mla_decode`` at B 64, 128 heads, L 32768: auto, the chunked GEMM path,
    the GEMM path unchunked and the tiled path (``bench.mla_long``)."""
    from .mla_long import bench_mla_long

    for r in bench_mla_long(timer):
        long_rows.append(r)
        log(f"  mla long {r['dtype']} {r['method']:<14} path {r['path']} chunks "
            f"{r['chunks']}: {r['ms']:.3f} ms {r.get('TFLOPs', float('nan')):.1f} TFLOP/s "
            f"{r.get('note', '')}")


# ---------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------

def write_csv(path, rows, columns=None):
    """Write ``rows`` (dicts) to ``path``; with no rows, remove ``path``: a CSV of an
    earlier run must not sit beside this run's summary."""
    if not rows:
        Path(path).unlink(missing_ok=True)
        return
    columns = columns or list(rows[0].keys())
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def plot(path, rows, copy_gbps):
    """One panel a cache dtype: GB/s against L. A kernel keeps one colour in
    every panel (colours assigned over all rows, by name); B 32 rows are lines
    with circles, the B 1 row a cross of the same colour; one shared legend
    names the kernels, the two markers and the copy ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    kernels = sorted({r["kernel"] for r in rows})
    cmap = plt.get_cmap("tab10" if len(kernels) <= 10 else "tab20")
    colour = {kern: cmap(i % cmap.N) for i, kern in enumerate(kernels)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), sharey=True)
    for ax, dname in zip(axes, DTYPES):
        sel = [r for r in rows if r["dtype"] == dname and r["batch"] == 32]
        for kern in sorted({r["kernel"] for r in sel}):
            pts = sorted((r["seq_len"], r["GBps"]) for r in sel if r["kernel"] == kern)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour[kern])
        for r in (r for r in rows if r["dtype"] == dname and r["batch"] == 1):
            ax.plot([r["seq_len"]], [r["GBps"]], "x", color=colour[r["kernel"]], ms=9, mew=2)
        ax.axhline(copy_gbps, color="gray", ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dname} KV cache (H 32, H_kv 8, D 128)")
        ax.set_xlabel("sequence length L")
    axes[0].set_ylabel("GB/s (K,V once per kv group + q + out)")
    handles = [Line2D([], [], color=colour[k], lw=3, label=k) for k in kernels]
    handles += [Line2D([], [], color="k", marker="o", ls="-", label="B 32"),
                Line2D([], [], color="k", marker="x", ls="", ms=9, mew=2, label="B 1"),
                Line2D([], [], color="gray", ls="--", label="copy ceiling")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * (len(handles) // 6), 1, 1))
    fig.savefig(path, dpi=110)


def best(rows, kernel_prefix, dname, b, seq, exact=False):
    """The fastest row whose kernel starts with ``kernel_prefix`` (``exact``:
    whose kernel name, ``[backend]`` suffix removed, is ``kernel_prefix``)."""
    sel = [r for r in rows
           if (base_name(r["kernel"]) == kernel_prefix if exact
               else r["kernel"].startswith(kernel_prefix))
           and r["dtype"] == dname and r["batch"] == b and r["seq_len"] == seq]
    return max(sel, key=lambda r: r["GBps"]) if sel else None


def parts_lines(parts):
    """The summary's line for a report measured in more than one run (``--resume``):
    each part's sections and ceilings; none for a report of one run."""
    if len(parts) < 2:
        return []

    def one(i, p):
        c = p.get("ceilings") or {}
        return (f"part {i} ({str(p.get('git_commit') or '?')[:7]}, {p.get('timestamp')}): "
                f"{', '.join(p.get('sections') or ['no section'])}; copy "
                f"{c.get('copy_GBps') or 0:.0f} GB/s, fp32 FMA {c.get('fma_TFLOPs') or 0:.1f} "
                "TFLOP/s")
    return [f"- measured in {len(parts)} runs on this GPU (`--resume`), each section against "
            "the ceilings of its own run (the ceilings above are the first run's): "
            + "; ".join(one(i + 1, p) for i, p in enumerate(parts))]


def summary(path, prov, ceilings, rows, mla_rows, step_rows, checks_log, errors,
            host_rows=()):
    copy_gbps, fma_tf = ceilings["copy_GBps"], ceilings["fma_TFLOPs"]
    tc = {k: ceilings.get(k) for k in ("tf32_TFLOPs", "bf16_TFLOPs")}
    lines = ["# Benchmarks: decode attention, MLA decode, decode step", "",
             "Produced by `scripts/bench`. Provenance:", "", "```",
             json.dumps(prov, indent=1), "```", "",
             f"- copy ceiling (device-to-device, read + write): **{copy_gbps:.0f} GB/s**",
             f"- fp32 FMA peak (numba, 8 chains per thread): **{fma_tf:.1f} TFLOP/s**",
             "- tensor-core peaks (torch matmul, 8192 x 8192 x 8192, same run): "
             + ", ".join(f"{name} **{v:.1f} TFLOP/s**" if v else f"{name} not measured"
                         for name, v in (("tf32 (fp32 operands, allow_tf32)",
                                          tc["tf32_TFLOPs"]),
                                         ("bf16", tc["bf16_TFLOPs"])))
             + "; tensor-core rows are given as a fraction of these, FMA rows of the "
             "fp32 FMA peak",
             *parts_lines(prov.get("parts") or []),
             "- torch SDPA rows name the backend that ran (`torch_sdpa[math]` etc.: "
             "bench/sdpa.py); `torch_sdpa` gets K/V unexpanded with `enable_gqa`, "
             "`torch_sdpa_expanded[efficient]` (fp32) gets K/V repeat_interleave'd to all "
             "query heads before timing and runs the memory-efficient backend; bytes are "
             "counted the same way for every row",
             "- timing: CUDA events, median of the repeats (3 to 20) after warm-up; "
             "before each repeat the L2 is flushed by reading 512 MB (clean lines only, "
             "nothing for the timed kernel to write back) and the GPU sleeps so that no "
             "launch's host work is timed, except in rows that say they include it",
             "- `fast` rows with more than one split launch the combine as a programmatic "
             "dependent of the main kernel where the GPU has it (sm_90 and later: "
             "`attention.core.pdl`)", "",
             "## Decode (GB/s counts K and V once per kv group, plus q, out, lse)", "",
             "| kernel | dtype | B | L | ms | GB/s | of copy |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['batch']} | {r['seq_len']} | "
                     f"{r['ms']:.4f} | {r['GBps']:.0f} | {r['frac_of_copy']:.3f} |")
    lines += ["", "## Targets", ""]
    for seq in (4096, 16384):
        r = best(rows, "fast", "float32", 32, seq)
        if r:
            lines.append(f"- fp32 decode L={seq}: {r['frac_of_copy']:.3f} of copy "
                         f"({'met' if r['frac_of_copy'] >= 0.8 else 'MISSED'}, target 0.80)")
    for dname in ("float16", "bfloat16"):
        for (b, _, _, _, seq) in DECODE_SHAPES:
            r = best(rows, "fast", dname, b, seq)
            t = best(rows, "torch_sdpa", dname, b, seq, exact=True)
            if r and t:
                ratio = r["GBps"] / t["GBps"]
                lines.append(f"- {dname} B={b} L={seq}: {ratio:.3f} of {t['kernel']} "
                             f"({'met' if ratio >= 0.9 else 'MISSED'}, target 0.90)")
    for dname in DTYPES:
        r = best(rows, "fast", dname, 1, 32768)
        if r:
            lines.append(f"- B 1, L 32768, {dname}: {r['frac_of_copy']:.3f} of copy "
                         f"({'met' if r['frac_of_copy'] >= 0.6 else 'MISSED'}, target 0.60)")
    for r in host_rows:
        if r["call"].startswith("DecodePlan.run") and "torch stream" not in r["call"]:
            ok = r["host_us_median"] <= HOST_TARGET_US
            lines.append(f"- {r['call']} host time: {r['host_us_median']:.2f} us a call "
                         f"({'met' if ok else 'MISSED'}, target {HOST_TARGET_US:g} us)")
    for s in step_rows:
        if s["path"] == "graph":
            lines.append(f"- decode step host cost ({s['dtype']}, graph): "
                         f"{s['host_us_per_step']:.2f} us "
                         f"({'met' if s['host_us_per_step'] <= 10 else 'MISSED'}"
                         ", target 10 us)")
    for dname in ("float32", "float16"):
        # the yardstick is einsum at full fp32 (TF32 off); torch_einsum_tf32 is context
        t = [r for r in mla_rows if r["kernel"] == "torch_einsum" and r["dtype"] == dname]
        u = [r for r in mla_rows if r["kernel"] == "torch_einsum_upcast" and r["dtype"] == dname]
        for kern in ("mla_decode", "mla_decode_graph", "mla_decode_graph_fma"):
            m = [r for r in mla_rows if r["kernel"] == kern and r["dtype"] == dname]
            if not m:
                continue
            frac, peak = m[0]["frac_of_peak"], m[0]["peak"]
            if frac is None:
                verdict = f"not judged: the {PEAK_NAMES[peak]} was not measured"
            else:
                ok = frac >= 0.5 and (not t or m[0]["ms"] < t[0]["ms"])
                verdict = f"{'met' if ok else 'MISSED'}, target 0.5 of its peak and faster " \
                          "than einsum"
            ceiling = ""
            if peak == "tf32_tc":  # tgemm: 3 mma a product, 2 with an fp16 operand
                ceiling = (" (split tf32 takes " + ("2" if dname == "float16" else "3") +
                           " tf32 MMAs a product: at most " +
                           ("0.5" if dname == "float16" else "0.333") + " of it)")
            lines.append(f"- MLA decode ({kern}) {dname} cache: {fmt_frac(frac)} "
                         f"of the {PEAK_NAMES[peak]}{ceiling}" +
                         (f", {t[0]['ms'] / m[0]['ms']:.2f}x torch einsum speed" if t else "") +
                         f" ({verdict})" +
                         (f"; context: {u[0]['ms'] / m[0]['ms']:.2f}x the speed of torch einsum "
                          "with our roundings (fp16 cache, fp32 math)" if u else ""))
    if mla_rows:
        n_seq = mla_rows[0]["batch"]
        lines += ["", "## MLA decode (B 64, 128 heads, latent 512 + 64, L 4096)", "",
                  f"Max error: max |out - float64 oracle| over all {n_seq} sequences of the "
                  "batch (vectorised float64 numpy); numpy float32 err: the same-precision "
                  "numpy baseline's. \"of peak\": TFLOP/s over the peak named in the next "
                  "column (tensor-core rows: a tensor-core peak; FMA rows: the fp32 FMA peak).",
                  "", "| kernel | cache | ms | TFLOP/s | of peak | peak | max err "
                  "| numpy float32 err |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in mla_rows:
            lines.append(f"| {r['kernel']} | {r['dtype']} | {r['ms']:.3f} | {r['TFLOPs']:.2f} | "
                         f"{fmt_frac(r['frac_of_peak'])} | {PEAK_NAMES[r['peak']]} | "
                         f"{r['max_err']:.2g} | {r['numpy_fp32_err']:.2g} |")
    if host_rows:
        b, h, kv, d, seq = HOST_SHAPE
        lines += ["", f"## Decode host time a call (fp16, B {b}, H {h}, H_kv {kv}, D {d}, "
                  f"L {seq})", "",
                  "Host: median of 300 calls, each with an idle queue (the GPU waited for "
                  "before it); back to back: mean of 300 calls in a row. Device: CUDA events "
                  "around the call's launches (the same timer as the decode table).", "",
                  "| call | host us (median) | host us (min) | host us back to back "
                  "| device us |", "|---|---|---|---|---|"]
        for r in host_rows:
            dev = "-" if r["kernel_ms"] is None else f"{r['kernel_ms'] * 1e3:.1f}"
            lines.append(f"| {r['call']} {r['note']} | {r['host_us_median']:.2f} | "
                         f"{r['host_us_min']:.2f} | {r['host_us_back_to_back']:.2f} | {dev} |")
    if step_rows:
        from .step import summary_lines as step_lines

        lines += step_lines(step_rows)
    lines += ["", "## Correctness spot checks (sequence 0 vs the float64 oracle)", "",
              "| kernel | dtype | B | L | max abs err |", "|---|---|---|---|---|"]
    for name, dname, b, seq, err in checks_log:
        lines.append(f"| {name} | {dname} | {b} | {seq} | {err:.2e} |")
    if errors:
        lines += ["", "## Parts that did not run", ""] + [f"- {e}" for e in errors]
    Path(path).write_text("\n".join(lines) + "\n")


class Tables:
    """The rows each bench section appends to (its CSV file in brackets)."""

    def __init__(self):
        self.decode, self.mla, self.step, self.host = [], [], [], []  # decode/mla/step/host
        self.long, self.prefill, self.paged = [], [], []  # mla_long / prefill / paged
        self.mla_multi, self.mla_mma, self.checks = [], [], []  # mla_multi / mla_mma / -
        self.prefill_mma = []  # prefill_mma
        self.host_checks = []  # the host section's spot checks (summary: before decode's)


# the sections in the order main runs them, and the Tables lists each one fills (a
# section run again by --resume starts its lists empty)
SECTIONS = ("host", "decode", "mla", "mla_mma", "step", "mla_long", "prefill", "paged",
            "mla_multi", "prefill_mma")
SECTION_TABLES = {"host": ("host", "host_checks"), "decode": ("decode", "checks"),
                  "mla": ("mla",), "mla_mma": ("mla_mma",), "step": ("step",),
                  "mla_long": ("long",), "prefill": ("prefill",), "paged": ("paged",),
                  "mla_multi": ("mla_multi",), "prefill_mma": ("prefill_mma",)}
STATE_FILE = "tables.json"  # what --resume reads back: rows, sections done, parts


def _plain(x):
    # numpy scalars (and anything else json cannot write) as Python numbers or text
    return x.item() if hasattr(x, "item") else str(x)


def save_state(out_dir, prov, ceilings, t, done, errors):
    """``out_dir/tables.json``: the provenance, header ceilings, every table's rows,
    the sections finished without error (``done``) and the error lines, for a later
    ``--resume`` of the same report."""
    doc = {"provenance": prov, "ceilings": ceilings, "sections_done": list(done),
           "errors": list(errors),
           "tables": {a: getattr(t, a) for s in SECTIONS for a in SECTION_TABLES[s]}}
    (Path(out_dir) / STATE_FILE).write_text(json.dumps(doc, default=_plain) + "\n")


def load_state(out_dir, code_hash, device):
    """What ``--resume`` continues: (Tables holding the finished sections' rows, those
    sections, the earlier parts' records, their error lines but those of sections
    still to run, the header ceilings). ValueError, naming the file, when there is
    no state or it measured other kernel sources (``code_hash``) or another GPU
    (``device``): ratios from two kernels or two cards do not go in one report."""
    path = Path(out_dir) / STATE_FILE
    if not path.exists():
        raise ValueError(f"{path} not found: nothing to resume (run the bench without "
                         "--resume first)")
    doc = json.loads(path.read_text())
    prov = doc.get("provenance") or {}
    if prov.get("kernel_source_hash") != code_hash:
        raise ValueError(f"{path} measured kernel sources {prov.get('kernel_source_hash')}, "
                         f"the code hashes to {code_hash}: run the whole bench again")
    if prov.get("device") != device:
        raise ValueError(f"{path} was measured on {prov.get('device')!r}, this GPU is "
                         f"{device!r}: run the whole bench here")
    done = [s for s in SECTIONS if s in doc.get("sections_done", ())]
    t = Tables()
    for s in done:
        for a in SECTION_TABLES[s]:
            rows = doc["tables"].get(a, [])
            setattr(t, a, [tuple(r) for r in rows] if a.endswith("checks") else rows)
    errors = [e for e in doc.get("errors", ())
              if e.split(":", 1)[0] not in SECTIONS or e.split(":", 1)[0] in done]
    return t, done, list(prov.get("parts") or []), errors, doc.get("ceilings")


def write_reports(out_dir, prov, ceilings, t, errors):
    """Write every CSV, decode.png and summary.md of ``out_dir`` from the tables ``t``
    (``Tables``) as they stand; ``errors``: the "Parts that did not run" lines."""
    out_dir = Path(out_dir)
    write_csv(out_dir / "decode.csv", t.decode, COLUMNS)
    write_csv(out_dir / "mla.csv", t.mla)
    write_csv(out_dir / "step.csv", t.step)
    write_csv(out_dir / "host.csv", t.host)
    write_csv(out_dir / "mla_long.csv", t.long)
    write_csv(out_dir / "prefill.csv", t.prefill, PREFILL_COLUMNS)
    write_csv(out_dir / "paged.csv", t.paged, PAGED_COLUMNS)
    write_csv(out_dir / "mla_multi.csv", t.mla_multi, MLA_MULTI_COLUMNS)
    write_csv(out_dir / "mla_mma.csv", t.mla_mma, MLA_MMA_COLUMNS)
    write_csv(out_dir / "prefill_mma.csv", t.prefill_mma, PREFILL_MMA_COLUMNS)
    errors = list(errors)
    try:
        # the copy ceiling of the run that measured the decode rows (a resumed report)
        copy = next((q["ceilings"]["copy_GBps"] for q in prov.get("parts") or ()
                     if "decode" in q.get("sections", ())), ceilings["copy_GBps"])
        plot(out_dir / "decode.png", t.decode, copy)
    except Exception as exc:
        errors.append(f"plot: {type(exc).__name__}: {exc}")
    summary(out_dir / "summary.md", prov, ceilings, t.decode, t.mla, t.step,
            t.host_checks + t.checks, errors, t.host)
    parts = []
    if t.long:
        parts.append("\n".join(long_mla_lines(t.long)))
    if t.prefill:
        parts.append("\n".join(prefill_summary_lines(t.prefill)))
    if t.paged:
        parts.append("\n".join(paged_summary_lines(t.paged)))
    if t.mla_multi:
        parts.append("\n".join(mla_multi_summary_lines(t.mla_multi)))
    if t.mla_mma:
        parts.append("\n## MLA decode on 16-bit tensor cores (bench.mla_mma)\n\n"
                     + "\n".join(mla_mma_summary_lines(t.mla_mma)))
    if t.prefill_mma:
        parts.append("\n".join(prefill_mma_summary_lines(t.prefill_mma)))
    if parts:
        with open(out_dir / "summary.md", "a") as fh:
            fh.write("".join(p + "\n" for p in parts))


def long_mla_lines(rows):
    """Markdown table of ``bench.mla_long``'s rows (flop and byte counts are the
    rows' own: ``bench.mla_long`` states how they are counted)."""
    r0 = rows[0]
    lines = ["", f"## Long-context MLA decode (B {r0['batch']}, {r0['heads']} heads, latent "
                 f"{r0['latent']} + {r0['rope']}, L {r0['seq_len']}): what method=\"auto\" "
                 "picks", "",
             "| cache | method asked | path | chunks | ms | TFLOP/s | GB/s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['method']} | {r['path']} | {r['chunks']} | "
                     f"{r['ms']:.3f} | {r['TFLOPs']:.1f} | {r['GBps']:.0f} | {r['note']} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench"))
    ap.add_argument("--quick", action="store_true", help="two decode shapes only")
    ap.add_argument("--variants", action="store_true",
                    help="also time tuning variants of the fast kernel")
    ap.add_argument("--skip", default="",
                    help="comma list of: " + ",".join(SECTIONS) + " (the report then "
                         "lists them as skipped, and --check-fresh reads it as partial)")
    ap.add_argument("--resume", action="store_true",
                    help="finish the report in --out: read its tables.json, run only the "
                         "sections it lacks (skipped, cut, not reached or failed) and write "
                         "the whole report again; its earlier runs must have measured "
                         "these kernel sources on this GPU model")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(SECTIONS):
        ap.error(f"--skip: unknown section(s) {','.join(sorted(skip - set(SECTIONS)))}; "
                 f"expected some of {','.join(SECTIONS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    from numba import cuda

    if not cuda.is_available():
        log("no CUDA GPU: the benchmarks need one (scripts/bench runs on the GPU machine)")
        sys.exit(2)
    from attention.core.device import device_name
    from validation.provenance import kernel_source_hash, provenance

    from .gpu import Timer, copy_bandwidth, fma_peak, torch_matmul_peak

    tables, done, parts, kept_errors, first_ceilings = Tables(), [], [], [], None
    if args.resume:
        try:
            tables, done, parts, kept_errors, first_ceilings = load_state(
                out_dir, kernel_source_hash(), device_name())
        except ValueError as exc:
            log(f"--resume: {exc}")
            sys.exit(2)
        log(f"--resume: sections done in {len(parts)} earlier run(s): {', '.join(done)}")

    try:
        import torch

        if not torch.cuda.is_available():
            torch = None
    except Exception:
        torch = None
    errors = []
    if torch is None:
        errors.append("torch not importable: SDPA and einsum baselines skipped")
    timer = Timer()
    copy_gbps, copy_ms = copy_bandwidth(timer)
    log(f"copy ceiling {copy_gbps:.1f} GB/s ({copy_ms:.3f} ms for 2 x 4 GiB)"
        + cover_note(timer, 0))
    seen = len(timer.raised)
    fma_tf, _ = fma_peak(timer)
    log(f"fp32 FMA peak {fma_tf:.2f} TFLOP/s" + cover_note(timer, seen))
    peaks = {"fp32_fma": fma_tf, "tf32_tc": None, "bf16_tc": None}
    if torch is not None:
        for kind in ("tf32", "bf16"):
            try:
                peaks[f"{kind}_tc"], _ = torch_matmul_peak(torch, kind)
                log(f"{kind} tensor-core peak (torch matmul) {peaks[kind + '_tc']:.1f} TFLOP/s")
            except Exception as exc:
                errors.append(f"{kind} tensor-core peak: {type(exc).__name__}: {exc}")
    else:
        log("tensor-core peaks: not measured (torch not importable); tensor-core rows "
            "get no fraction of peak")

    variants = [("fast", {})]
    if args.variants:
        variants += [("fast_u4", {"unroll": 4}), ("fast_u8", {"unroll": 8}),
                     ("fast_nosplit", {"n_split": 1})]
    sections = (("host", lambda: bench_host(timer, torch, tables.host, tables.host_checks)),
                ("decode", lambda: bench_decode(timer, copy_gbps, torch, variants,
                                                tables.decode, tables.checks, args.quick)),
                ("mla", lambda: bench_mla(timer, peaks, torch, tables.mla)),
                ("mla_mma", lambda: tables.mla_mma.extend(bench_mla_mma(
                    timer, torch, copy_gbps, peaks["bf16_tc"], verbose=True))),
                ("step", lambda: bench_step(timer, tables.step)),
                ("mla_long", lambda: bench_long_mla(timer, tables.long)),
                ("prefill", lambda: bench_prefill(timer, fma_tf, torch, tables.prefill, log,
                                                  peaks["bf16_tc"])),
                ("paged", lambda: bench_paged(timer, copy_gbps, torch, tables.paged, log)),
                ("mla_multi", lambda: tables.mla_multi.extend(
                    bench_mla_multi(timer, verbose=True))),
                # last: new, and its oracle checks take about a minute of CPU time at
                # T 4096; a run cut by its limit keeps the sections before it
                ("prefill_mma", lambda: tables.prefill_mma.extend(bench_prefill_mma(
                    timer, torch, log, reps=20, bf16_tflops=peaks["bf16_tc"]))))
    assert tuple(name for name, _ in sections) == SECTIONS
    ceilings = {"copy_GBps": copy_gbps, "fma_TFLOPs": fma_tf,
                "tf32_TFLOPs": peaks["tf32_tc"], "bf16_TFLOPs": peaks["bf16_tc"]}
    header_ceilings = first_ceilings or ceilings  # the first run's, on a resumed report
    todo = [name for name, _ in sections if name not in skip and name not in done]
    skipped = [name for name in SECTIONS if name in skip and name not in done]
    ran = []  # this run's sections that finished without an error

    def write(interrupted, cut_in=None):
        # the host cover the timers ended with (bench.gpu.HOLD_US): raised where a
        # launch's host cost outlasted it
        cover = {"hold_us": timer.hold_us, "raised": timer.raised}
        cut = {"section_cut": cut_in} if cut_in else {}  # the section an interrupt cut
        seconds = round(time.time() - t_start, 1)
        prov = provenance(bench_seconds=seconds, ceilings=header_ceilings,
                          timer_cover=cover, interrupted=interrupted,
                          sections_not_reached=list(todo), sections_skipped=list(skipped),
                          **cut)
        # each run of a resumed report is a part: its sections and its own ceilings
        prov["parts"] = parts + [{"git_commit": prov["git_commit"],
                                  "timestamp": prov["timestamp"], "bench_seconds": seconds,
                                  "ceilings": ceilings, "sections": list(ran)}]
        errs = list(dict.fromkeys(kept_errors + errors))  # a run-wide line once
        write_reports(out_dir, prov, header_ceilings, tables,
                      errs + [f"{n}: not reached (the run was cut before it)" for n in todo]
                      + [f"{n}: skipped (--skip; `--resume` runs it into this report)"
                         for n in skipped])
        save_state(out_dir, prov, header_ceilings, tables, done + ran, errs)
        return cover

    # the reports are written again after every section, so a run cut by a time limit
    # (an interrupt: scripts/gpu_all's stages; or a kill) leaves what it measured, its
    # provenance saying "interrupted" and which sections it did not reach
    cover = write(interrupted=bool(todo))
    for name, fn in sections:
        if name not in todo:
            continue
        for attr in SECTION_TABLES[name]:  # a resumed section's rows start again
            setattr(tables, attr, [])
        log(f"== {name} ({time.time() - t_start:.0f} s)")
        try:
            fn()
        except KeyboardInterrupt:
            errors.append(f"{name}: cut by an interrupt during this section "
                          f"(at {time.time() - t_start:.0f} s)")
            todo.remove(name)
            write(interrupted=True, cut_in=name)
            log(f"interrupted in {name}: wrote {out_dir} with the sections before it")
            sys.exit(130)
        except Exception as exc:
            traceback.print_exc()
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            ran.append(name)
        todo.remove(name)
        cover = write(interrupted=bool(todo))
    log(f"host cover: {cover}")
    log(f"wrote {out_dir} in {time.time() - t_start:.0f} s")
    log((out_dir / "summary.md").read_text().split("## Targets")[-1][:3000])
