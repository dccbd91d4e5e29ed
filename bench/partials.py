"""The tensor-core GEMM's partial length, measured (notes/bench.md, runs 19-20).

    python -m bench.partials [--steps N] [PART_STEPS ...]      (GPU only)

``attention.gemm.tgemm`` adds each warp's partial sums to its register totals every
``PART_STEPS`` k8 steps (a divisor of a slice's 4: inside the k8 loop, or a
multiple: at slice ends). For each length given (default: 2, the kernel's,
and 4), this rebuilds the GEMMs with it and prints

* the MLA decode graph's time (``MLADecodeGraph``, tensor cores) at the
  benchmark's shape (``bench.run.MLA``: B 64, 128 heads, latent 512 + 64,
  L 4096), fp32 and fp16 cache, L2 flushed before each repeat, with its max
  error against the float64 oracle (``bench.run.MLACheck``);
* the 128-head growth run ``mla_gemm_decode`` in fp32 over ``N`` decode steps
  (default 1024, seed 0; ``validation.growth``): steps over the sweep's bound,
  worst and median ratio to the float32 baseline, worst err/bound. ``--steps 0``
  times the graph only.

The lengths are tried in one process so their times share the GPU's state;
``PART_STEPS`` is restored at the end. Run it on an idle GPU.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def measure(part_steps, steps, timer, data):
    """One line of results for ``tgemm.PART_STEPS = part_steps``."""
    from attention.gemm import tgemm
    from mla.decode_graph import MLADecodeGraph
    from validation.growth import GrowthJob, run_growth

    tgemm.PART_STEPS = part_steps
    tgemm.tgemm_kernel.cache_clear()
    cols = []
    for dname, (arrays, check) in data.items():
        g = MLADecodeGraph(*arrays, tensor=True)
        if g.graph is None:
            raise RuntimeError(f"no graph ({g.fallback_reason})")
        g.run(sync=True)
        ms = timer.time_on_stream(g.run, g.stream_handle, reps=10, warmup=2)
        g.run(sync=True)
        cols.append(f"{dname} {ms:.3f} ms err {check.error(g.out):.2g} "
                    f"(numpy float32 {check.base_err:.2g})")
        del g
    head = f"PART_STEPS {part_steps} ({8 * part_steps} k): {' | '.join(cols)}"
    if steps == 0:
        return head
    rec = run_growth(GrowthJob("mla_gemm_decode", "float32", 0, steps, False))
    if rec.get("status") not in ("pass", "fail"):
        return f"{head} | growth: {rec.get('status')}"
    s = rec["series"]
    ratio = np.array(s["out_err"]) / np.array(s["out_base"])
    over = int(np.sum(~np.array(s["passed"])))
    return (f"{head} | growth {steps} steps: {over} over the bound, worst ratio "
            f"{rec['worst_ratio']:.2f}, median {np.median(ratio):.2f}, "
            f"worst err/bound {rec['worst_margin']:.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.partials", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("part_steps", nargs="*", type=int, default=[2, 4],
                    help="k8 steps a partial (divisors or multiples of 4); default 2 4")
    ap.add_argument("--steps", type=int, default=1024,
                    help="growth steps (default 1024; 0: time only)")
    args = ap.parse_args(argv)
    if args.steps < 0:
        raise SystemExit(f"--steps: expected 0 or more growth steps, got {args.steps}")
    from attention.gemm import tgemm
    from attention.core.device import SIMULATOR

    ks = tgemm.PLAN[4] // 8  # k8 steps a slice
    bad = [p for p in args.part_steps if p <= 0 or (p % ks and ks % p)]
    if bad:
        raise SystemExit(f"part_steps: expected positive divisors or multiples of {ks}, "
                         f"got {bad}")
    from numba import cuda

    if SIMULATOR or not cuda.is_available():
        raise SystemExit("bench.partials: needs a GPU (the simulator runs another plan)")

    from validation.provenance import provenance

    from .gpu import Timer
    from .run import MLA, MLACheck, mla_inputs

    print(json.dumps(provenance(), indent=1))
    data = {}
    for dname in ("float32", "float16"):
        q_nope, q_pe, cache, lengths, w_uk, w_uv = inputs = mla_inputs(dname)
        data[dname] = (inputs, MLACheck(q_nope, q_pe, cache, w_uk, w_uv, MLA["latent"]))
    timer = Timer()
    saved = tgemm.PART_STEPS
    try:
        for p in args.part_steps:
            print(measure(p, args.steps, timer, data), flush=True)
    finally:
        tgemm.PART_STEPS = saved
        tgemm.tgemm_kernel.cache_clear()


if __name__ == "__main__":
    main()
