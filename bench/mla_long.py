"""Long-context MLA decode: ``mla_decode`` at B 64, 128 heads, latent 512 + rope 64, L 32768.

At this shape the GEMM path's scratch for the whole batch (the scores of
every query, ``mla.attn_gemm.workspace_bytes``) is 1.02 GiB, past
``mla.pipeline.GEMM_WORKSPACE_LIMIT`` (1 GiB): "auto" used to switch to the
tiled path (11-27x slower); it now runs the GEMM path in two chunks of 32
sequences over one 0.51 GiB scratch (``mla.pipeline.plan_method``). The rows
time, per cache dtype:

* ``auto``            method "auto" (the default budget): the path it takes
* ``gemm``            method "gemm", chunked to the default budget
* ``gemm_unchunked``  method "gemm" with the budget lifted: one launch set
                      over the 1.02 GiB scratch (what chunking costs)
* ``flash``           method "flash": the tiled online-softmax path

Sizes (device memory): the cache is B x L x 576 elements, 2.42 GB in fp16 and
4.83 GB in fp32; with the queries, weights, outputs and at most 1.1 GB of
scratch, both dtypes fit a 141 GB H200 many times over, so both are run by
default.

Conventions as ``bench/run.py``'s MLA section: inputs from
``bench.gpu.random_array`` (values of size <= 1, the same seeds), all
lengths L; ``bench.gpu.Timer`` with host work included (public launcher;
the L2 flushed before each repeat); the GEMM rows reuse one ``Workspace``
across calls, as a decode loop would. Each row states its work: ``flop`` is
``bench.run.mla_flops`` (absorb 2 nope latent, scores 2 L (latent + rope),
P.V 2 L latent, decompress 2 latent v_dim, per sequence and head; the
tensor-core GEMMs' products counted once), ``TFLOPs`` = flop / time;
``bytes`` is the latent cache read once (B L (latent + rope) x the element
size: the compulsory traffic of a decode), ``GBps`` = bytes / time.

``bench_mla_long()`` returns the rows and prints nothing unless
``verbose=True``; ``python -m bench.mla_long`` prints them.
"""

from __future__ import annotations

import math

import numpy as np

LONG = dict(batch=64, heads=128, latent=512, rope=64, nope=128, v_dim=128, seq=32768)
METHODS = ("auto", "gemm", "gemm_unchunked", "flash")
DTYPES = ("float16", "float32")
BIG_LIMIT = 1 << 62  # a budget nothing passes: the GEMM path in one launch set


def long_inputs(dname, shape=None):
    """Inputs at ``shape`` (default ``LONG``), seeded as ``bench.run.mla_inputs``:
    q_nope [B, H, nope], q_pe [B, H, rope] float32, cache [B, L, latent + rope]
    in ``dname``, w_uk [H, nope, latent], w_uv [H, v_dim, latent] float32
    (device arrays) and lengths [B] int32 (host, all L)."""
    from .run import mla_inputs

    return mla_inputs(dname, shape or LONG)


def cache_bytes(dname, shape=None):
    """Bytes of the latent cache [B, L, latent + rope] in ``dname``."""
    c = shape or LONG
    return c["batch"] * c["seq"] * (c["latent"] + c["rope"]) * np.dtype(dname).itemsize


def bench_mla_long(timer=None, *, dtypes=DTYPES, methods=METHODS, reps=3, warmup=1,
                   shape=None, check_seqs=0, verbose=False, free_bytes=None):
    """Time ``mla.pipeline.mla_decode`` at ``shape`` (default ``LONG``) for each
    cache dtype and method; returns a list of row dicts.

    timer:      a ``bench.gpu.Timer`` (default: a new one; needs a GPU)
    dtypes:     cache dtypes among "float16", "float32"; a dtype whose cache
                (plus 2 GiB of headroom) exceeds ``free_bytes`` (default: the
                device's free memory) is skipped with a row saying so
    methods:    among ``METHODS`` (module docstring)
    check_seqs: when > 0, each row's ``max_err`` is max |out - float64| over
                the first ``check_seqs`` sequences (``bench.run.mla_decode_batch``,
                on the host: slow at L 32768, ~1 s a sequence); else NaN
    Row keys: method (asked), path (what ran: "gemm" / "flash"), chunks,
    chunk (sequences a launch set), scratch_bytes, reason (the plan's),
    dtype, batch, heads, latent, rope, seq_len, ms, flop, TFLOPs, bytes, GBps,
    max_err, note; a skipped row has ms NaN and the reason in ``note``.
    """
    from numba import cuda

    from mla.attn_gemm import Workspace
    from mla.pipeline import mla_decode

    from .run import mla_decode_batch, mla_flops

    c = shape or LONG
    b, h, lat, rope, nope, vd, seq = (c["batch"], c["heads"], c["latent"], c["rope"],
                                      c["nope"], c["v_dim"], c["seq"])
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"methods: expected names among {METHODS}, got {m!r}")
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtypes: expected names among {DTYPES}, got {d!r}")
    if timer is None:
        from .gpu import Timer

        timer = Timer()
    flop = mla_flops(b, h, lat, rope, nope, vd, seq)
    log = print if verbose else (lambda *a, **k: None)
    rows = []
    base = {"batch": b, "heads": h, "latent": lat, "rope": rope, "seq_len": seq}
    for dname in dtypes:
        nbytes = cache_bytes(dname, c)
        free = free_bytes if free_bytes is not None else cuda.current_context().get_memory_info()[0]
        if nbytes + (2 << 30) > free:
            note = (f"skipped: the {dname} cache takes {nbytes / 1e9:.2f} GB, "
                    f"{free / 1e9:.2f} GB free")
            rows.append(dict(base, method="-", path="-", chunks=0, chunk=0, scratch_bytes=0,
                             reason="", dtype=dname, ms=math.nan, flop=flop, TFLOPs=math.nan,
                             bytes=nbytes, GBps=math.nan, max_err=math.nan, note=note))
            log(f"  mla_long {dname}: {note}")
            continue
        q_nope, q_pe, cache, lengths, w_uk, w_uv = long_inputs(dname, c)
        ref = None
        if check_seqs:
            n = min(int(check_seqs), b)
            host = [a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)
                    for a in (q_nope, q_pe, w_uk, w_uv)]
            ref = mla_decode_batch(host[0][:n], host[1][:n], cache[:n].copy_to_host(),
                                   host[2], host[3], lat, np.float64)
        st = cuda.default_stream()
        for m in methods:
            method = "gemm" if m == "gemm_unchunked" else m
            limit = BIG_LIMIT if m == "gemm_unchunked" else None
            ws = Workspace() if method != "flash" else None

            def run(method=method, limit=limit, ws=ws):
                return mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                                  method=method, workspace=ws, workspace_limit=limit)

            _, plan = mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                                 method=method, workspace=ws, workspace_limit=limit,
                                 return_plan=True)
            cuda.synchronize()
            ms = timer.time(run, reps=reps, warmup=warmup, host=True)
            err = math.nan
            if ref is not None:
                out = run()
                cuda.synchronize()
                got = out.copy_to_host()[:len(ref)].astype(np.float64)
                err = float(np.abs(got - ref).max())
            row = dict(base, method=m, path=plan.method, chunks=plan.n_chunks,
                       chunk=plan.chunk, scratch_bytes=plan.scratch_bytes, reason=plan.reason,
                       dtype=dname, ms=round(ms, 4), flop=flop,
                       TFLOPs=round(flop / (ms * 1e-3) / 1e12, 2), bytes=nbytes,
                       GBps=round(nbytes / (ms * 1e-3) / 1e9, 1),
                       max_err=float(f"{err:.3g}"),
                       note="public launcher, host work included")
            rows.append(row)
            log(f"  mla_long {m:<15} {dname:<8} path {plan.method:<5} chunks {plan.n_chunks} "
                f"{ms:9.3f} ms {row['TFLOPs']:7.2f} TFLOP/s {row['GBps']:8.1f} GB/s "
                f"(scratch {plan.scratch_bytes / 2**30:.2f} GiB) err {err:.2g}")
            del ws
        q_nope = q_pe = cache = w_uk = w_uv = ref = None  # free the inputs
        dealloc = getattr(cuda.current_context(), "deallocations", None)
        if dealloc is not None:  # free the cache now (the simulator has no such queue)
            dealloc.clear()
    return rows


if __name__ == "__main__":
    bench_mla_long(verbose=True)
