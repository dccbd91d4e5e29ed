"""The MLA attention kernel on wgmma (level 1: S = Q K^T; 2: S and P.V) against its
mma.sync form, one GPU run (printed, no report): bits and time of the attention
launch alone.

    python3 -m bench.mla_wgmma [--batch 64] [--heads 128] [--len 4096] [--reps 30]

For each 16-bit cache type: random q rows ``[B, heads, r + d_rope]`` (DeepSeek's r
512, d_rope 64), a contiguous latent cache ``[B, L, 576]`` and every length L; one
plan each way (``mla.mma.plan(..., wgmma=0 / 1 / 2)``, the same split). Printed, for
each wgmma level against mma.sync: whether o_lat and the LSE are the same bits (the
kernels sum S and P.V one k step of 16 at a time in the same order; the warp-group
instruction rounds a k step as mma.sync does, so they are: notes/bench.md run 45),
the largest difference and its size relative to max |o_lat|, and
the median time of each launch (``bench.gpu.Timer``: L2 flushed, device time), with
TFLOP/s counted as the MLA rows of ``bench.mla_mma`` count the attention
(2 B heads L (r + d_rope) for S plus 2 B heads L r for P.V).
"""

from __future__ import annotations

import argparse

import numpy as np


def run(batch=64, heads=128, length=4096, reps=30, kinds=("f16", "bf16"), seed=0):
    from attention.core.device import device_empty, to_device
    from mla import mma as MM

    from .gpu import Timer

    rank, d_rope = 512, 64
    width = rank + d_rope
    rng = np.random.default_rng(seed)
    timer = Timer()
    flops = 2.0 * batch * heads * length * (width + rank)
    rows = []
    for kind in kinds:
        dt = np.float16
        if kind == "bf16":
            from attention.core.device import BFLOAT16
            dt = BFLOAT16
        qc = rng.standard_normal((batch, heads, width)).astype(np.float32)
        lat = rng.standard_normal((batch, length, width)).astype(np.float32).astype(dt)
        lens = np.full(batch, length, np.int32)
        table = np.arange(batch, dtype=np.int32)[:, None]
        d_q, d_lat, d_lens, d_tab = to_device(qc), to_device(lat), to_device(lens), \
            to_device(table)
        out = {}
        for wg in (0, 1, 2):
            pl = MM.plan(batch, heads, rank, d_rope, length, kind, wgmma=wg)
            o = device_empty((batch, heads, rank), np.float32)
            lse = device_empty((batch, heads), np.float32)
            pa, pm = MM.scratch(pl, batch, heads)
            scale = float(1.0 / np.sqrt(192.0))

            def go(pl=pl, o=o, lse=lse, pa=pa, pm=pm):
                MM.launch(pl, d_q, d_lat, d_lens, d_tab, heads, scale, o, lse, pa, pm, 0)

            go()
            ms = timer.time(go, reps=reps)
            out[wg] = (o.copy_to_host(), lse.copy_to_host(), ms, pl["n_split"])
        o0, l0, ms0, ns = out[0]
        for wg in (1, 2):
            o1, l1, ms1, _ = out[wg]
            same = np.array_equal(o0, o1) and np.array_equal(l0, l1)
            diff = float(np.abs(o0 - o1).max())
            rows.append(dict(kind=kind, wgmma=wg, same_bits=same, max_diff=diff,
                             rel_diff=diff / float(np.abs(o0).max()),
                             lse_diff=float(np.abs(l0 - l1).max()), n_split=ns,
                             ms_mma=round(ms0, 4), ms_wgmma=round(ms1, 4),
                             speedup=round(ms0 / ms1, 3),
                             tflops_mma=round(flops / ms0 / 1e9, 1),
                             tflops_wgmma=round(flops / ms1 / 1e9, 1)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    from numba import cuda

    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"device {name}; B {args.batch} / {args.heads} heads / L {args.len}; "
          "attention launch alone")
    for r in run(args.batch, args.heads, args.len, args.reps):
        print(r)


if __name__ == "__main__":
    main()
