"""Multi-token and paged MLA decode: ``mla_decode`` / ``MLADecodeGraph`` at B 64, 128
heads, latent 512 + rope 64, L 4096, with s_q = 1, 2 and 4 new queries a sequence
(multi-token prediction) and over a paged latent cache (page 64).

Rows, per cache dtype (fp16, fp32) and path:

* ``<path>_sq<s>``: ``s`` queries a sequence (q ``[B, s, nh, .]``), all lengths
  L (query i attends L - s + 1 + i positions). ``vs_sq1`` is its time over the
  s_q = 1 row's: the cost of the s - 1 more queries, the latent rows being read
  once a sequence whatever s (``mla.attn_gemm.prepare``'s ``s_q``);
* ``<path>_paged64``: s_q = 1 over the same rows in pages of 64, shuffled
  (``[num_pages, 64, r + d_rope]``, a page table ``[B, L / 64]``);
  ``vs_contiguous`` is its time over the contiguous s_q = 1 row's.

Paths: ``mla_decode`` (method "gemm", the public launcher with one
``Workspace`` reused across calls: host work included, as ``bench/run.py``'s
``mla_decode`` row) and ``mla_decode_graph`` (``MLADecodeGraph``, tensor-core
GEMMs, the launches replayed as a CUDA graph: device time only, as
``mla_decode_graph``) and ``mma_graph`` (``MLADecodeGraph(method="mma")``: the
attention on 16-bit tensor cores, ``mla.mma``, fp16 caches only, replayed as a
graph: device time). ``"flash"`` may be asked for too (tiled kernel, slow).

Each multi-token row's last query is the s_q = 1 row's query (same values),
and sees every position: ``max_abs_diff`` is max |its output - the s_q = 1
output| (0.0: bit-identical; at 128 heads both run the same GEMM kernels).
The paged row's ``max_abs_diff`` is against the contiguous s_q = 1 output
(0.0 expected: the same kernels and sums). ``max_err``: max |out - float64
oracle| over the first ``check_seqs`` sequences (``mla.oracle.mla_decode_ref``,
all queries), beside ``numpy_fp32_err``, the float32 numpy baseline's
(``mla.oracle.mla_attend_float32``).

Work counted: ``flop`` = s_q x ``bench.run.mla_flops`` (each query's absorb,
scores over L, P.V over L and decompress; the earlier queries' s_q - 1 - i
fewer positions, under 0.1 %, are not subtracted); ``bytes`` = the latent
cache read once (B L (latent + rope) x the element size: the same for every
s_q); ``GBps`` = bytes / time.

``bench_mla_multi()`` returns the rows (``COLUMNS``) and prints nothing unless
``verbose=True``; ``summary_lines(rows)`` gives a summary section;
``python -m bench.mla_multi [--out DIR]`` prints the rows (and writes
``DIR/mla_multi.csv``).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

SHAPE = dict(batch=64, heads=128, latent=512, rope=64, nope=128, v_dim=128, seq=4096)
S_QS = (1, 2, 4)
PAGE = 64
PATHS = ("mla_decode", "mla_decode_graph", "mma_graph")
GRAPH_PATHS = {"mla_decode_graph": None, "mma_graph": "mma"}  # path -> MLADecodeGraph method
DTYPES = ("float16", "float32")
COLUMNS = ["kernel", "path", "s_q", "page_size", "dtype", "batch", "heads", "latent", "rope",
           "seq_len", "ms", "vs_sq1", "vs_contiguous", "flop", "TFLOPs", "bytes", "GBps",
           "max_abs_diff", "max_err", "numpy_fp32_err", "note"]


def multi_queries(q_nope, q_pe, s_q, seed=41):
    """[B, s_q, nh, .] host queries whose last query is ``q_nope`` / ``q_pe``
    ([B, nh, .], device or host) and the others random in [-1, 1)."""
    qn = q_nope.copy_to_host() if hasattr(q_nope, "copy_to_host") else np.asarray(q_nope)
    qp = q_pe.copy_to_host() if hasattr(q_pe, "copy_to_host") else np.asarray(q_pe)
    rng = np.random.default_rng(seed + s_q)
    out = []
    for q in (qn, qp):
        m = rng.uniform(-1, 1, (q.shape[0], s_q) + q.shape[1:]).astype(np.float32)
        m[:, -1] = q
        out.append(m)
    return out


def paged_copy(cache, page, seed=43):
    """A contiguous cache [B, L, W] (host) as shuffled pages: (pages [B L / page,
    page, W], table [B, L / page] int32); never the identity order."""
    b, seq, width = cache.shape
    per = seq // page
    logical = cache.reshape(b * per, page, width)
    perm = np.random.default_rng(seed).permutation(b * per).astype(np.int32)
    if b * per > 1 and np.array_equal(perm, np.arange(b * per)):
        perm = perm[::-1].copy()
    pages = np.empty_like(logical)
    pages[perm] = logical
    return pages, perm.reshape(b, per)


def oracle_errors(out, q_nope, q_pe, cache, w_uk, w_uv, n):
    """(max |out - float64 oracle|, numpy float32 baseline's) over sequences
    0..n-1; out [B, s_q, nh, d_v], q [B, s_q, nh, .], cache [B, L, W] (host)."""
    from mla.oracle import mla_attend_float32, mla_decode_ref

    lat = w_uk.shape[2]
    lens = np.full(n, cache.shape[1])
    ref = mla_decode_ref(q_nope[:n], q_pe[:n], cache[:n], lens, w_uk, w_uv)
    err = float(np.abs(out[:n].astype(np.float64) - ref).max())
    base = 0.0
    for b in range(n):
        rows = cache[b].astype(np.float32)
        f32 = mla_attend_float32(q_nope[b], q_pe[b], rows[:, :lat], rows[:, lat:], w_uk, w_uv)
        base = max(base, float(np.abs(f32 - ref[b]).max()))
    return err, base


def bench_mla_multi(timer=None, *, dtypes=DTYPES, paths=PATHS, s_qs=S_QS, page=PAGE, reps=5,
                    warmup=1, shape=None, check_seqs=2, verbose=False):
    """Time the rows of the module docstring at ``shape`` (default ``SHAPE``);
    returns a list of row dicts (``COLUMNS``). ``paths``: among ``PATHS`` and
    "flash"; ``s_qs`` must hold 1 (the reference of ``vs_sq1``); ``page``: the
    paged rows' page size (None: no paged rows); ``check_seqs``: sequences
    checked against the float64 oracle (0: none, max_err NaN)."""
    from numba import cuda

    from mla.attn_gemm import Workspace
    from mla.decode_graph import MLADecodeGraph
    from mla.pipeline import mla_decode

    from .run import mla_flops, mla_inputs

    c = shape or SHAPE
    b, h, lat, rope, nope, vd, seq = (c["batch"], c["heads"], c["latent"], c["rope"],
                                      c["nope"], c["v_dim"], c["seq"])
    if 1 not in s_qs:
        raise ValueError(f"s_qs: expected 1 among them (the reference row), got {s_qs}")
    for p in paths:
        if p not in PATHS + ("flash",):
            raise ValueError(f"paths: expected names among {PATHS + ('flash',)}, got {p!r}")
    if timer is None:
        from .gpu import Timer

        timer = Timer()
    log = print if verbose else (lambda *a, **k: None)
    rows = []
    st = cuda.default_stream()
    for dname in dtypes:
        q_nope, q_pe, cache, lengths, w_uk, w_uv = mla_inputs(dname, c)
        host_cache = cache.copy_to_host()
        w_uk_h, w_uv_h = w_uk.copy_to_host(), w_uv.copy_to_host()
        nbytes = b * seq * (lat + rope) * np.dtype(dname).itemsize
        pages = table = None
        if page:
            pages_h, table_h = paged_copy(host_cache, page)
            pages, table = cuda.to_device(pages_h), cuda.to_device(table_h)
            del pages_h
        for path in paths:
            if path == "mma_graph" and dname != "float16":
                continue  # the tensor-core attention takes an fp16 cache only
            ref = {}  # s_q = 1 results: (ms, out [B, nh, d_v])

            def record(kernel, s_q, ms, out, paged=False, qs=None, path=path):
                flop = s_q * mla_flops(b, h, lat, rope, nope, vd, seq)
                diff = None
                if s_q > 1 or paged:
                    diff = float(np.abs(out[:, -1] - ref["out"]).max()) if not paged else \
                        float(np.abs(out - ref["out"]).max())
                err = base = math.nan
                if check_seqs and qs is not None:
                    err, base = oracle_errors(out if out.ndim == 4 else out[:, None], qs[0],
                                              qs[1], host_cache, w_uk_h, w_uv_h,
                                              min(int(check_seqs), b))
                row = {"kernel": kernel, "path": path, "s_q": s_q,
                       "page_size": page if paged else 0, "dtype": dname, "batch": b,
                       "heads": h, "latent": lat, "rope": rope, "seq_len": seq,
                       "ms": round(ms, 4),
                       "vs_sq1": round(ms / ref["ms"], 3) if "ms" in ref and not paged else None,
                       "vs_contiguous": round(ms / ref["ms"], 3) if paged else None,
                       "flop": flop, "TFLOPs": round(flop / (ms * 1e-3) / 1e12, 2),
                       "bytes": nbytes, "GBps": round(nbytes / (ms * 1e-3) / 1e9, 1),
                       "max_abs_diff": diff, "max_err": float(f"{err:.3g}"),
                       "numpy_fp32_err": float(f"{base:.3g}"),
                       "note": ("public launcher, host work included"
                                if path not in GRAPH_PATHS else
                                "CUDA graph replay, device time" + (
                                    "; the tensor-core attention (mla.mma)"
                                    if path == "mma_graph" else ""))}
                rows.append(row)
                ratio = (f" x{row['vs_contiguous']:.3f} of contiguous" if paged else
                         (f" x{row['vs_sq1']:.3f} of s_q 1" if row["vs_sq1"] else ""))
                log(f"  {kernel:<28} {dname:<8} {ms:8.3f} ms {row['TFLOPs']:7.2f} TFLOP/s "
                    f"{row['GBps']:7.1f} GB/s{ratio}"
                    + ("" if diff is None else f" diff {diff:.1e}")
                    + ("" if math.isnan(err) else f" err {err:.2g} (numpy fp32 {base:.2g})"))
                return row

            for s_q in sorted(s_qs):
                if s_q == 1:
                    qs = (q_nope, q_pe)
                    host_q = [q.copy_to_host()[:, None] for q in (q_nope, q_pe)]
                else:
                    host_q = multi_queries(q_nope, q_pe, s_q)
                    qs = tuple(cuda.to_device(q) for q in host_q)
                ms, out = _time(path, timer, st, qs, cache, lengths, w_uk, w_uv,
                                mla_decode, MLADecodeGraph, Workspace)
                if s_q == 1:
                    ref.update(ms=ms, out=out)
                record(f"{path}_sq{s_q}", s_q, ms, out if s_q > 1 else out[:, None],
                       qs=host_q)
            if page:
                ms, out = _time(path, timer, st, (q_nope, q_pe), pages, lengths, w_uk, w_uv,
                                mla_decode, MLADecodeGraph, Workspace, table=table)
                record(f"{path}_paged{page}", 1, ms, out, paged=True)
        q_nope = q_pe = cache = pages = table = None  # free the inputs
        dealloc = getattr(cuda.current_context(), "deallocations", None)
        if dealloc is not None:
            dealloc.clear()
    return rows


def _time(path, timer, st, qs, cache, lengths, w_uk, w_uv, mla_decode, graph_cls, workspace,
          table=None):
    """(ms, host output) of one row's path."""
    from numba import cuda

    if path in GRAPH_PATHS:
        g = graph_cls(qs[0], qs[1], cache, lengths, w_uk, w_uv, page_table=table,
                      method=GRAPH_PATHS[path])
        if g.graph is None:
            raise RuntimeError(f"no graph ({g.fallback_reason})")
        g.run(sync=True)
        ms = timer.time_on_stream(g.run, g.stream_handle, reps=5, warmup=1)
        g.run(sync=True)
        return ms, g.out.copy_to_host()
    method = "gemm" if path == "mla_decode" else "flash"
    ws = workspace() if method == "gemm" else None

    def run():
        return mla_decode(qs[0], qs[1], cache, lengths, w_uk, w_uv, stream=st, method=method,
                          workspace=ws, page_table=table)

    ms = timer.time(run, reps=5 if method == "gemm" else 3, warmup=1, host=True)
    out = run()
    cuda.synchronize()
    return ms, out.copy_to_host()


def summary_lines(rows):
    """The summary's section: each row's time, its ratio to the s_q = 1 row (or
    the paged row's to the contiguous one), its difference and error."""
    if not rows:
        return []
    r0 = rows[0]
    out = ["", f"## Multi-token and paged MLA decode (B {r0['batch']}, {r0['heads']} heads, "
               f"latent {r0['latent']} + {r0['rope']}, L {r0['seq_len']}; `bench/mla_multi.py`)",
           "", "vs s_q 1: time over the s_q = 1 row of the same path and cache; vs contiguous: "
           "the paged row's time over the contiguous s_q = 1 row's. diff: max |last query - "
           "the s_q = 1 output| (paged: - the contiguous output); 0 is bit-identical.", "",
           "| kernel | cache | s_q | page | ms | vs s_q 1 | vs contiguous | GB/s (cache once) "
           "| diff | max err | numpy fp32 err |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(v, spec):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    for r in rows:
        out.append(f"| {r['kernel']} | {r['dtype']} | {r['s_q']} | {r['page_size'] or '-'} | "
                   f"{r['ms']:.3f} | {fmt(r['vs_sq1'], '.3f')} | {fmt(r['vs_contiguous'], '.3f')}"
                   f" | {r['GBps']:.0f} | {fmt(r['max_abs_diff'], '.1e')} | "
                   f"{fmt(r['max_err'], '.2g')} | {fmt(r['numpy_fp32_err'], '.2g')} |")
    return out


def write_csv(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for mla_multi.csv and mla_multi.md")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--check-seqs", type=int, default=2)
    args = ap.parse_args(argv)
    rows = bench_mla_multi(dtypes=tuple(args.dtypes.split(",")),
                           paths=tuple(args.paths.split(",")), check_seqs=args.check_seqs,
                           verbose=True)
    print("\n".join(summary_lines(rows)))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "mla_multi.csv", rows)
        (out / "mla_multi.md").write_text("\n".join(summary_lines(rows)) + "\n")


if __name__ == "__main__":
    main()
