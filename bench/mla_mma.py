"""MLA decode on 16-bit tensor cores (``mla.mma``, ``mla_decode(method="mma")``).

Rows, fp16 latent cache ``[B, L, 512 + 64]``, nope 128, v_dim 128, all lengths L:

* **compute-bound**, B 64, 128 heads, L 4096: ``mma`` (the three launches of a
  prepared call replayed: device time), ``mma_public`` (``mla_decode``, host
  work included), ``gemm`` (``mla_decode(method="gemm")``, split-tf32 GEMMs,
  one ``Workspace`` reused), and torch's all-16-bit einsum in fp16 and bf16
  (``bench.run.einsum_mla_decode``: every operand 16-bit, softmax in fp32, P
  cast back). ``TFLOPs`` = ``bench.run.mla_flops`` / time; ``frac_of_peak``
  against the bf16 GEMM peak torch measures in the same run
  (``bench.gpu.torch_matmul_peak``); ``vs_einsum`` is the fp16 einsum's time
  over the row's (above 1: faster).
* **memory-bound**, B 64 / 16 heads / L 4096 and B 1 / 16 heads / L 32768 (16
  heads: DeepSeek's 128 after 8-way tensor parallelism; at 128 heads even B 1
  does 240 flop a latent byte, past the H200's ridge):
  ``mma`` (device time). ``GBps`` = the latent cache bytes (B L 576 x 2, read
  once: the compulsory traffic) / time; ``frac_of_copy`` against the
  device-to-device copy ceiling measured in the same run
  (``bench.gpu.copy_bandwidth``: bytes read + written / time).

fp8 latent cache (``mla.fp8``; rows ``mma_fp8`` per tensor, ``mma_fp8_tok``
per token, every shape above): the same cache quantized on the device by
``fp8_append_latent``, then the prepared tensor-core call in its fp8 mode
(device time). ``GBps`` counts the bytes it reads: B L (512 + 2 x 64) per
row, plus 4 a row of per-token scales. Its ``max_err`` is against the oracle
on the fp16 cache, so it includes the format's quantization error (the
validation summary's table); ``err_vs_dequantized`` is the kernel's own error,
against the float64 oracle over the dequantized cache (``mla.fp8.dequantize``
of the first ``check_seqs`` sequences' codes and scales), beside
``numpy_fp32_err_dequantized`` (numpy float32 over those values);
``vs_einsum`` as above; ``vs_mma_fp16`` is the fp16 cache's ``mma`` row's time
over the fp8 row's (above 1: the fp8 cache is faster).

Accuracy (``max_err``): max |out - float64 oracle| over ``check_seqs``
sequences (``bench.run.mla_decode_batch``: the absorbed decode on the fp16
cache's values, q unrounded), beside ``numpy_fp32_err`` (the same in float32)
and the einsum rows' own error. The tensor-core path rounds q_lat and P to
fp16 as FlashMLA does, so its error sits with the 16-bit einsum's, not with
float32's.

``bench_mla_mma(timer, torch=None, copy_gbps=None, bf16_peak=None)`` returns
the rows; ``python -m bench.mla_mma [--out DIR] [--no-gemm]`` prints them (and
writes ``DIR/mla_mma.csv`` and ``DIR/summary.md`` with provenance).
"""

from __future__ import annotations

import argparse
import csv
import math
import os

import numpy as np

COMPUTE = dict(batch=64, heads=128, latent=512, rope=64, nope=128, v_dim=128, seq=4096)
MEMORY = (dict(COMPUTE, heads=16), dict(COMPUTE, batch=1, heads=16, seq=32768))
COLUMNS = ("kernel", "batch", "heads", "seq_len", "ms", "TFLOPs", "frac_of_peak", "vs_einsum",
           "vs_mma_fp16", "GBps", "frac_of_copy", "max_err", "numpy_fp32_err",
           "err_vs_dequantized", "numpy_fp32_err_dequantized", "note")


def _shape_note(c):
    return f"B {c['batch']} / {c['heads']} heads / L {c['seq']}"


class _Check:
    """float64 oracle and float32 numpy outputs of the first ``n`` sequences;
    ``rows`` (host [n, L, W]): the cache values they read instead of ``inputs``'
    cache (the fp8 rows: the dequantized cache)."""

    def __init__(self, inputs, lat, n, rows=None):
        from .run import _host, mla_decode_batch

        q_nope, q_pe, cache, _, w_uk, w_uv = inputs
        self.n = n
        rows = _host(cache)[:n] if rows is None else rows
        args = (_host(q_nope)[:n], _host(q_pe)[:n], rows, _host(w_uk), _host(w_uv), lat)
        self.ref = mla_decode_batch(*args, np.float64)
        self.base_err = float(np.abs(mla_decode_batch(*args, np.float32) - self.ref).max())

    def error(self, out):
        from .run import _host

        got = _host(out)[:self.n].astype(np.float64)
        return float(np.abs(got - self.ref).max())


def _prepared(inputs, stream):
    """A prepared tensor-core call (``mla.mma.prepare``) over ``inputs``."""
    from mla import mma as MM

    q_nope, q_pe, cache, lengths, w_uk, w_uv = inputs
    d_rope = int(q_pe.shape[2])
    scale = 1.0 / math.sqrt(int(q_nope.shape[2]) + d_rope)
    n_b = int(q_nope.shape[0])
    return MM.prepare(q_nope, q_pe, w_uk, w_uv, cache, np.arange(n_b, dtype=np.int32),
                      np.asarray(lengths, np.int32), scale, d_rope=d_rope, w_uk_layout="mla",
                      stream=stream)


def _fp8_prepared(inputs, mode, stream):
    """``_prepared`` over the fp16 cache quantized on the device (``mode``
    "tensor": scale amax / 448 of the c_kv values; "token": one a row)."""
    from attention.core.device import device_empty, to_device
    from mla import mma as MM
    from mla.fp8 import row_bytes
    from mla.fp8_append import fp8_append_latent

    from .run import _host

    q_nope, q_pe, cache, lengths, w_uk, w_uv = inputs
    n_b, seq, width = (int(x) for x in cache.shape)
    d_rope = int(q_pe.shape[2])
    rank = width - d_rope
    codes = device_empty((n_b, seq, row_bytes(rank, d_rope)), np.uint8, stream)
    rows = cache.reshape(n_b, seq, width)
    if mode == "tensor":
        from validation.fixtures import tensor_scale

        d_scale = to_device(np.array([tensor_scale(_host(cache)[..., :rank].astype(
            np.float32))], np.float32), stream)
        fp8_append_latent(rows, codes, None, np.zeros(n_b, np.int32), scale=d_scale,
                          stream=stream)
    else:
        d_scale = device_empty((n_b, seq), np.float32, stream)
        fp8_append_latent(rows, codes, None, np.zeros(n_b, np.int32), scales=d_scale,
                          stream=stream)
    scale = 1.0 / math.sqrt(int(q_nope.shape[2]) + d_rope)
    p = MM.prepare(q_nope, q_pe, w_uk, w_uv, codes, np.arange(n_b, dtype=np.int32),
                   np.asarray(lengths, np.int32), scale, d_rope=d_rope, w_uk_layout="mla",
                   stream=stream, fp8=mode, d_scale=d_scale)
    return p, codes, d_scale


def _dequantized(codes, d_scale, n, rank):
    """The first ``n`` sequences' fp8 rows as the float64 values the kernel reads
    (``mla.fp8.dequantize``: e4m3(c) s exactly, k_pe as stored)."""
    from mla.fp8 import dequantize

    from .run import _host

    sc = _host(d_scale)
    return dequantize(_host(codes)[:n], sc if sc.size == 1 else sc[:n], rank)


def bench_mla_mma(timer, torch=None, copy_gbps=None, bf16_peak=None, check_seqs=4,
                  verbose=False, gemm=True, ceilings=None, fp8=True):
    """The rows (module docstring); ``copy_gbps`` / ``bf16_peak``: the ceilings
    measured earlier in the run (measured here when None; the bf16 peak needs
    torch); ``gemm=False`` leaves out the GEMM path's row (its kernels' compile
    time); ``ceilings``: a dict that receives the two ceilings; ``fp8=False``
    leaves out the fp8 cache's rows."""
    from numba import cuda

    from mla import mma as MM
    from mla.pipeline import mla_decode

    from .gpu import copy_bandwidth, torch_matmul_peak
    from .run import einsum_mla_decode, mla_flops, mla_inputs

    def log(msg):
        if verbose:
            print(msg, flush=True)

    if copy_gbps is None:
        copy_gbps = copy_bandwidth(timer)[0]
    if bf16_peak is None and torch is not None:
        bf16_peak = torch_matmul_peak(torch, "bf16")[0]
    if ceilings is not None:
        ceilings.update(copy_GBps=copy_gbps, bf16_TFLOPs=bf16_peak)
    log(f"  ceilings: copy {copy_gbps:.0f} GB/s, bf16 GEMM peak "
        f"{'n/a' if bf16_peak is None else f'{bf16_peak:.0f} TFLOP/s'}")
    rows = []
    st = cuda.default_stream()

    def record(kernel, c, ms, check, out=None, err=None, note="", nbytes=None):
        flops = mla_flops(c["batch"], c["heads"], c["latent"], c["rope"], c["nope"],
                          c["v_dim"], c["seq"])
        if nbytes is None:  # the fp16 cache, read once
            nbytes = c["batch"] * c["seq"] * (c["latent"] + c["rope"]) * 2
        tf = flops / (ms * 1e-3) / 1e12
        gbps = nbytes / (ms * 1e-3) / 1e9
        if err is None and out is not None:
            err = check.error(out)
        row = {"kernel": kernel, "batch": c["batch"], "heads": c["heads"],
               "seq_len": c["seq"], "ms": round(ms, 4), "TFLOPs": round(tf, 1),
               "frac_of_peak": round(tf / bf16_peak, 3) if bf16_peak else None,
               "vs_einsum": None, "vs_mma_fp16": None, "GBps": round(gbps, 1),
               "frac_of_copy": round(gbps / copy_gbps, 3),
               "max_err": None if err is None else float(f"{err:.3g}"),
               "numpy_fp32_err": float(f"{check.base_err:.3g}"), "note": note}
        rows.append(row)
        log(f"  {kernel:<16} {_shape_note(c):<28} {ms:8.4f} ms {tf:7.1f} TFLOP/s "
            f"{gbps:7.0f} GB/s ({row['frac_of_copy']:.3f} of copy) err {row['max_err']} "
            f"{note}")
        return row

    for c in (COMPUTE,) + MEMORY:
        inputs = mla_inputs("float16", c)
        q_nope, q_pe, cache, lengths, w_uk, w_uv = inputs
        check = _Check(inputs, c["latent"], check_seqs)
        p = _prepared(inputs, st)
        MM.launch_prepared(p, st)
        st.synchronize()
        ms = timer.time(lambda: MM.launch_prepared(p, st), reps=10, warmup=2)
        pl = p["plan"]
        ms16 = ms
        record("mma", c, ms, check, out=p["out"],
               note=f"(prepared launches: device time; RG {pl['row_groups']}, KT "
                    f"{pl['tile']}, {pl['n_split']} splits)")
        for mode in ("tensor", "token") if fp8 else ():
            p8, codes, d_scale = _fp8_prepared(inputs, mode, st)
            MM.launch_prepared(p8, st)
            st.synchronize()
            ms = timer.time(lambda: MM.launch_prepared(p8, st), reps=10, warmup=2)
            rows8 = c["batch"] * c["seq"]
            row8 = record("mma_fp8" + ("_tok" if mode == "token" else ""), c, ms, check,
                   out=p8["out"], nbytes=rows8 * (c["latent"] + 2 * c["rope"]
                                                  + (4 if mode == "token" else 0)),
                   note=f"(fp8 latent cache, scale per {mode}: prepared launches; max err "
                        f"includes the quantization's, err vs dequantized does not)")
            row8["vs_mma_fp16"] = round(ms16 / ms, 3)
            # the kernel's own error: against the oracle over the values it reads
            deq = _Check(inputs, c["latent"], check_seqs,
                         rows=_dequantized(codes, d_scale, check_seqs, c["latent"]))
            row8["err_vs_dequantized"] = float(f"{deq.error(p8['out']):.3g}")
            row8["numpy_fp32_err_dequantized"] = float(f"{deq.base_err:.3g}")
            log(f"    {row8['kernel']}: err vs the oracle over the dequantized cache "
                f"{row8['err_vs_dequantized']} (numpy fp32 {deq.base_err:.3g})")
            codes = d_scale = p8 = None  # free the fp8 cache before the next shape
        if c is not COMPUTE:
            continue

        def run_public():
            return mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                              method="mma")

        record("mma_public", c, timer.time(run_public, reps=5, warmup=1, host=True), check,
               out=run_public(), note="(mla_decode method mma: host work included)")
        if gemm:
            from mla.attn_gemm import Workspace

            ws = Workspace()

            def run_gemm():
                return mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=st,
                                  method="gemm", workspace=ws)

            record("gemm", c, timer.time(run_gemm, reps=5, warmup=1, host=True), check,
                   out=run_gemm(), note="(mla_decode method gemm: split-tf32 GEMMs, host "
                                        "work included)")
        if torch is None:
            continue
        from .gpu import TorchTimer

        tt = TorchTimer(torch)
        for tdt, name in ((torch.float16, "einsum_fp16"), (torch.bfloat16, "einsum_bf16")):
            tc = torch.as_tensor(cache, device="cuda").to(tdt)
            ops = [torch.as_tensor(x, device="cuda").to(tdt) for x in (q_nope, q_pe, w_uk, w_uv)]

            def run_einsum():
                return einsum_mla_decode(torch, ops[0], ops[1], tc, ops[2], ops[3], c["latent"])

            ms = tt.time(run_einsum, reps=10)
            out = run_einsum().float().cpu().numpy()
            record(name, c, ms, check, out=out,
                   note=f"(torch {torch.__version__} einsum, every operand {name[-4:]}, "
                        f"cuBLAS)")
        einsum = next(r for r in rows if r["kernel"] == "einsum_fp16")
        for r in rows:
            if r["seq_len"] == c["seq"] and r["batch"] == c["batch"] and \
                    r["heads"] == c["heads"]:
                r["vs_einsum"] = round(einsum["ms"] / r["ms"], 3)
    return rows


def summary_lines(rows):
    """Markdown lines for the bench summary."""
    out = ["| kernel | shape | ms | TFLOP/s | of bf16 peak | vs fp16 einsum | vs fp16 cache "
           "mma | GB/s | of copy | max err | fp32 numpy err | fp8: err vs dequantized "
           "(fp32 numpy) |", "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['kernel']} | B {r['batch']} / {r['heads']} heads / L {r['seq_len']} "
                   f"| {r['ms']} | {r['TFLOPs']} | {r['frac_of_peak']} | {r['vs_einsum']} | "
                   f"{r.get('vs_mma_fp16')} | "
                   f"{r['GBps']} | {r['frac_of_copy']} | {r['max_err']} | "
                   f"{r['numpy_fp32_err']} | "
                   + ("-" if r.get("err_vs_dequantized") is None else
                      f"{r['err_vs_dequantized']} ({r['numpy_fp32_err_dequantized']})")
                   + " |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="write DIR/mla_mma.csv and DIR/summary.md (with provenance)")
    ap.add_argument("--no-gemm", action="store_true", help="leave out the GEMM path's row")
    ap.add_argument("--no-fp8", action="store_true", help="leave out the fp8 cache's rows")
    ap.add_argument("--check-seqs", type=int, default=4,
                    help="sequences checked against the float64 oracle (default 4)")
    args = ap.parse_args(argv)
    import json
    import time

    from validation.provenance import provenance

    from .gpu import Timer

    try:
        import torch
        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    t0 = time.time()
    ceilings = {}
    rows = bench_mla_mma(Timer(), torch, verbose=True, gemm=not args.no_gemm,
                         check_seqs=args.check_seqs, ceilings=ceilings, fp8=not args.no_fp8)
    lines = summary_lines(rows)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mla_mma.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        prov = provenance(bench_seconds=round(time.time() - t0, 1), ceilings=ceilings,
                          torch=None if torch is None else torch.__version__)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write("# MLA decode on 16-bit tensor cores (`python -m bench.mla_mma`)\n\n"
                    "```\n" + json.dumps(prov, indent=1) + "\n```\n\n"
                    + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
