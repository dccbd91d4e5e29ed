"""Where a decode kernel's LSE error comes from: one paged growth run, entry by entry.

``python -m validation.lse_probe [--dtype float16] [--seed 0] [--steps 1024] [--small]``
replays ``growth/paged_decode`` (``validation.growth``, the same inputs) and, at
every step, splits the LSE error of each entry (sequence, head) against the
float64 oracle into the parts a model can reproduce:

* ``kernel``   the kernel's LSE;
* ``base``     the same-precision baseline the verdict uses (float32 scores in
               the kernel's order, ``2 ** fl(x log2 e)`` weights with an exact
               ``exp2``, float32 pairwise sum, float32 log);
* ``exact_w``  the baseline's float32 scores and max, weights ``2 ** fl(x log2 e)``
               in float64, summed and logged in float64, the result rounded to
               float32 as the kernel stores it: the score, argument and output
               roundings alone;
* ``hw_w``     the same with every weight from the GPU's fast-math exponential
               (``ex2.approx``, a one-line kernel compiled as the decode kernels
               are): the score and argument roundings plus the hardware
               exponential's own error.

If ``kernel`` tracks ``hw_w`` (mean errors alike, entries correlated) and not
``exact_w``, the part of the kernel's LSE error the baseline lacks is the
hardware exponential's, which the output divides away (its numerator and
denominator carry the same weights) and the LSE keeps. Needs a GPU for the
``hw_w`` column (on the simulator ``math.exp`` is numpy's: ``hw_w`` equals
``exact_w``). Prints one line a failing step and a summary; ``--json`` writes
the per-step figures with the run's provenance.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from numba import cuda

from validation import baselines, growth, metrics

F32, F64 = np.float32, np.float64


def _hw_exp():
    """``exp(x)`` of a float32 array on the device, compiled with fast-math
    (``ex2.approx`` of ``fl(x log2 e)`` on a GPU), returned as float64."""
    from attention.core.device import jit, to_device, to_host

    def kernel(x, out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < x.size:
            out[i] = math.exp(x[i])

    compiled = jit(kernel, fastmath=True)

    def run(x):
        flat = np.ascontiguousarray(x, F32).ravel()
        d_out = to_device(np.zeros_like(flat))
        if flat.size:
            compiled[(flat.size + 127) // 128, 128](to_device(flat), d_out)
        return np.asarray(to_host(d_out), F64).reshape(np.shape(x))

    return run


def model_lse(q, k32, lengths, label, hw_exp):
    """(exact_w, hw_w) LSE [M, H] float64 for one query a sequence.
    q [M, H, D] float32, k32 [M, H_kv, max_seq, D] float32 (sequence-major
    rows, NaN beyond each length replaced by 0), lengths [M]."""
    how, where, _, _ = baselines.parse(label)
    qf = np.asarray(q, F32)
    scale = 1.0 / np.sqrt(qf.shape[-1])
    if where == "before":
        qf, scale = baselines._fold(qf, scale)
    m_count, n_heads, _ = qf.shape
    n_kv = k32.shape[1]
    exact = np.full((m_count, n_heads), -np.inf)
    hw = np.full((m_count, n_heads), -np.inf)
    for m in range(m_count):
        length = int(lengths[m])
        for h in range(n_heads):
            g = baselines.kv_head_of(h, n_heads, n_kv)
            s = baselines.dot(k32[m, g, :length][None], qf[m, [h]][:, None, :], how)
            s = (s * F32(scale)).astype(F32)[0]  # [L]
            mx = s.max()
            arg = ((s - mx).astype(F32) * baselines.LOG2E).astype(F32)
            exact[m, h] = F64(mx) + math.log(np.exp2(arg.astype(F64)).sum())
            hw[m, h] = F64(mx) + math.log(hw_exp((s - mx).astype(F32)).sum())
    # stored as the kernel stores its LSE: one rounding to float32
    return exact.astype(F32).astype(F64), hw.astype(F32).astype(F64)


def probe(dtype="float16", seed=0, steps=1024, small=False):
    """Run the replay; returns a list of per-step dicts (mean |err| of each
    column over the step's LSE entries, the verdict's mean bound, pass/fail)."""
    job = growth.GrowthJob("paged_decode", dtype, seed, steps, small)
    hw_exp = _hw_exp()
    rows = []

    def look(step, q, mirror_k, mirror_v, lengths, out, lse, o64, l64, o32, l32):
        label = growth.baseline_order("paged_decode", {"q": q[:, 0]},
                                      np.dtype(np.float32))
        k32 = np.nan_to_num(mirror_k).astype(F32)
        exact, hw = model_lse(q[:, 0], k32, lengths, label, hw_exp)
        ref = l64[:, 0]
        err = {"kernel": np.abs(lse[:, 0].astype(F64) - ref),
               "base": np.abs(l32[:, 0].astype(F64) - ref),
               "exact_w": np.abs(exact - ref), "hw_w": np.abs(hw - ref)}
        judged = metrics.judge(lse, l64, l32, label)
        signed_k = lse[:, 0].astype(F64) - ref
        signed_hw = hw - ref
        corr = (float(np.corrcoef(signed_k.ravel(), signed_hw.ravel())[0, 1])
                if signed_k.std() > 0 and signed_hw.std() > 0 else float("nan"))
        rows.append({"step": step, "length": int(lengths.max()),
                     **{f"mean_{k}": float(v.mean()) for k, v in err.items()},
                     **{f"max_{k}": float(v.max()) for k, v in err.items()},
                     "mean_bound": float(judged.get("mean_bound", float("nan"))),
                     "passed": bool(judged["passed"]), "corr_kernel_hw": corr})

    growth._paged_growth(job, 1, probe=look)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m validation.lse_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = probe(a.dtype, a.seed, a.steps, a.small)
    cols = ("kernel", "base", "exact_w", "hw_w")
    print(f"growth/paged_decode/{a.dtype}/s{a.seed}/{a.steps}: LSE mean |err| a step "
          f"(columns: {', '.join(cols)}; module docstring)")
    for r in rows:
        if not r["passed"]:
            print(f"  step {r['step']} (length {r['length']}) FAIL: "
                  + "  ".join(f"{c} {r['mean_' + c]:.3g}" for c in cols)
                  + f"  bound {r['mean_bound']:.3g}  corr(kernel, hw_w) "
                    f"{r['corr_kernel_hw']:.2f}")
    for c in cols:
        v = np.array([r["mean_" + c] for r in rows])
        print(f"  {c:8s} mean over steps {v.mean():.3g}  median {np.median(v):.3g}  "
              f"max {v.max():.3g}")
    ratio_hw = np.array([r["mean_kernel"] / r["mean_hw_w"] for r in rows if r["mean_hw_w"]])
    ratio_ex = np.array([r["mean_kernel"] / r["mean_exact_w"] for r in rows
                         if r["mean_exact_w"]])
    corr = np.array([r["corr_kernel_hw"] for r in rows])
    print(f"  kernel / hw_w mean ratio: median {np.median(ratio_hw):.3g}; kernel / exact_w: "
          f"median {np.median(ratio_ex):.3g}; corr(kernel, hw_w) median "
          f"{np.nanmedian(corr):.2f}; failing steps {sum(not r['passed'] for r in rows)}")
    if a.json:
        from validation.provenance import provenance

        with open(a.json, "w") as f:
            json.dump({"provenance": provenance(command=f"python -m validation.lse_probe "
                                                        f"--dtype {a.dtype} --seed {a.seed} "
                                                        f"--steps {a.steps}"),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
