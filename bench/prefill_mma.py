"""Tensor-core prefill benchmark: ``attention.prefill.mma`` against torch SDPA.

    python3 -m bench.prefill_mma [--reps 30] [--warmup 5] [--no-check] [--csv FILE]
                                 [--plans 4x64,8x32]

Shapes: T 2048 and 4096, H 32, H_kv 8, D 128, causal, fp16 and bf16 (q, k, v
in the dtype; ours writes float32 out and lse, torch's output is 16-bit).

FLOP count: the two matrix products Q.K^T and P.V over the visible half of
the scores, 2 * 2 * T^2 / 2 * H * D (softmax, scale and masking not counted),
the same for both rows.

Timing: CUDA events around one enqueue, the L2 flushed and a host cover
(``bench.gpu.Timer`` / ``TorchTimer``) before each repeat, median of
``--reps`` (>= 20) after ``--warmup`` calls. Ours is timed through
``mma.launch`` with a plan made once and the inputs already viewed as words
(what a serving loop enqueues; the public ``prefill_attention_mma`` adds its
host checks). torch gets K / V unexpanded with ``enable_gqa=True`` and
``is_causal=True``; the backend that ran is named (``bench.sdpa.backend_of``).
``ratio`` is torch's time over ours (our speed as a fraction of torch's).
``--plans W x BN, ...`` also times these plans (warps a block x K / V tile
positions) on the same inputs, each a row of its own beside the default plan's
(``mma.default_warps`` / ``default_block_n``), with the largest difference of
its output from the default plan's printed (0 where only the warps differ: a
row's arithmetic does not depend on them).

Check (unless ``--no-check``): on kv group 0 (query heads 0 .. 3, every row)
the float64 oracle, the float32 baseline with the kernel's roundings (P
rounded to the dtype before P.V) and torch's output; printed: the max error
against the oracle of ours, of torch (all-16-bit, output rounded to 16 bits)
and of the baseline, the rule's bound (2 x the baseline's + 2 float32 ulps of
max|oracle|), 1 - cos(., oracle) (FlashMLA's check: < 1e-5), and whether NaN
sits where the oracle has it (it has none: NaN anywhere fails).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

SHAPES = [(2048, 32, 8, 128), (4096, 32, 8, 128)]
DTYPES = ("float16", "bfloat16")
COS_LIMIT = 1e-5
COLUMNS = ["kernel", "dtype", "seq_len", "heads", "kv_heads", "head_dim", "ms", "TFLOPs",
           "frac_of_bf16_peak", "ratio_to_torch", "max_err", "bound", "cos_diff", "nan_ok",
           "check"]
# issue targets, the default plan's speed as a fraction of torch SDPA's at T 4096
TARGET_T, TARGET_RATIO, MOONSHOT_RATIO = 4096, 0.5, 0.8


def prefill_flops(t_len, heads, head_dim):
    """Causal: 2 products x 2 flops a multiply-add x T^2 / 2 visible scores x H x D."""
    return 2.0 * 2.0 * t_len * t_len / 2.0 * heads * head_dim


def _np_dtype(name):
    if name == "float16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _inputs(t_len, heads, kv, head_dim, dt, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t_len, heads * head_dim), np.float32).astype(dt)  # [T, H*D]
    k = rng.standard_normal((t_len, kv * head_dim), np.float32).astype(dt)  # [T, H_kv*D]
    v = rng.standard_normal((t_len, kv * head_dim), np.float32).astype(dt)  # [T, H_kv*D]
    return q, k, v


def _torch_view(torch, x, t_len, heads, head_dim, name):
    """A host 16-bit [T, heads*D] array as a torch [1, heads, T, D] view on the GPU."""
    tdt = torch.float16 if name == "float16" else torch.bfloat16
    t = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(tdt)
    return t.view(t_len, heads, head_dim).transpose(0, 1)[None]


def check(q, k, v, heads, kv, dt, ours, theirs):
    """Kv group 0 against the oracle: a dict of the printed quantities."""
    from tests.test_prefill_mma import cos_diff, oracle
    from validation.baselines import prefill_rounded_p as baseline
    from validation.tolerance import floor, max_abs_error

    head_dim = q.shape[1] // heads
    group = heads // kv
    cols = slice(0, group * head_dim)
    sub = (q[:, cols], k[:, :head_dim], v[:, :head_dim])
    scale = 1.0 / math.sqrt(head_dim)
    ref_out, ref_lse = oracle(*sub, group, 1, True, scale)
    base_out, base_lse = baseline(*sub, group, 1, True, scale, dt)
    res = {}
    for name, out in (("ours", ours[0][:, cols]), ("torch", None if theirs is None
                                                     else theirs[:, cols])):
        if out is None:
            continue
        res[name] = {"max_err": max_abs_error(out, ref_out), "cos_diff": cos_diff(out, ref_out),
                     "nan_ok": not np.isnan(out).any()}
    res["ours"]["lse_err"] = max_abs_error(ours[1][:group], ref_lse)
    res["ours"]["nan_ok"] &= not np.isnan(ours[1]).any() and not np.isnan(ours[0]).any()
    res["baseline"] = {"max_err": max_abs_error(base_out, ref_out),
                       "cos_diff": cos_diff(base_out, ref_out), "nan_ok": True,
                       "lse_err": max_abs_error(base_lse, ref_lse)}
    res["bound"] = 2.0 * res["baseline"]["max_err"] + floor(ref_out)
    res["lse_bound"] = 2.0 * res["baseline"]["lse_err"] + floor(ref_lse)
    return res


def bench_prefill_mma(timer, torch, log, *, reps=30, warmup=5, check_rows=True, extra=(),
                      bf16_tflops=None):
    """The rows (dicts, ``COLUMNS``) of the tensor-core prefill against torch SDPA
    at ``SHAPES`` x ``DTYPES`` (module docstring): ours with its default plan
    (``default``: True), torch's (None without torch), and each ``extra`` plan
    (warps, block_n); ``check_rows``: the oracle check of kv group 0 on each
    default row; ``bf16_tflops``: the run's bf16 peak (adds ``frac_of_bf16_peak``).
    ``log``: where the progress lines go."""
    from numba import cuda

    from attention.prefill import mma

    from .gpu import TorchTimer

    tt = TorchTimer(torch) if torch is not None else None
    rows = []
    for name in DTYPES:
        dt = _np_dtype(name)
        for t_len, heads, kv, head_dim in SHAPES:
            flops = prefill_flops(t_len, heads, head_dim)
            q, k, v = _inputs(t_len, heads, kv, head_dim, dt, seed=t_len)
            scale = 1.0 / math.sqrt(head_dim)
            words = [cuda.to_device(np.ascontiguousarray(x).view(np.uint32).reshape(-1))
                     for x in (q, k, v)]
            d_out = cuda.device_array((t_len, heads * head_dim), np.float32)
            d_lse = cuda.device_array((heads, t_len), np.float32)
            pl = mma.plan(t_len, heads, head_dim, mma.dtype_kind(dt), True)

            def ours():
                mma.launch(pl, *words, t_len, kv, scale, d_out, d_lse)

            ms = timer.time(ours, reps=reps, warmup=warmup)
            row = {"kernel": f"prefill_mma[w{pl['warps']},n{pl['block_n']}]",
                   "dtype": name, "seq_len": t_len, "heads": heads, "kv_heads": kv,
                   "head_dim": head_dim, "ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12,
                   "default": True}
            torch_row, theirs = None, None
            if tt is not None:
                from .sdpa import backend_of, label

                tq = _torch_view(torch, q, t_len, heads, head_dim, name)
                tk = _torch_view(torch, k, t_len, kv, head_dim, name)
                tv = _torch_view(torch, v, t_len, kv, head_dim, name)
                sdpa = torch.nn.functional.scaled_dot_product_attention

                def run_sdpa():
                    return sdpa(tq, tk, tv, is_causal=True, scale=scale, enable_gqa=True)

                backend, how = backend_of(torch, run_sdpa)
                tms = tt.time(run_sdpa, reps=reps, warmup=warmup)
                torch_row = {**row, "kernel": label("torch_sdpa", backend), "ms": tms,
                             "default": False,
                             "TFLOPs": flops / (tms * 1e-3) / 1e12, "ratio_to_torch": 1.0}
                row["ratio_to_torch"] = tms / ms
                log(f"  torch backend: {backend} ({how})")
                if check_rows:
                    o = run_sdpa()[0].transpose(0, 1).reshape(t_len, heads * head_dim)
                    theirs = o.float().cpu().numpy()
            if check_rows:
                res = check(q, k, v, heads, kv, dt, (d_out.copy_to_host(), d_lse.copy_to_host()),
                            theirs)
                for r, key in ((row, "ours"), (torch_row, "torch")):
                    if r is not None and key in res:
                        r.update({"max_err": res[key]["max_err"], "cos_diff": res[key]["cos_diff"],
                                  "nan_ok": res[key]["nan_ok"]})
                row["bound"] = res["bound"]
                b = res["baseline"]
                verdict = ("PASS" if res["ours"]["max_err"] <= res["bound"]
                           and res["ours"]["lse_err"] <= res["lse_bound"]
                           and res["ours"]["cos_diff"] < COS_LIMIT and res["ours"]["nan_ok"]
                           else "FAIL")
                row["check"] = verdict
                log(f"  check {name} T={t_len} (kv group 0, all rows): max err vs oracle "
                    f"ours {res['ours']['max_err']:.3e} (bound {res['bound']:.3e}), "
                    f"baseline {b['max_err']:.3e}"
                    + (f", torch {res['torch']['max_err']:.3e}" if "torch" in res else "")
                    + f"; lse ours {res['ours']['lse_err']:.3e} (bound "
                    f"{res['lse_bound']:.3e}); 1 - cos ours {res['ours']['cos_diff']:.2e}"
                    + (f", torch {res['torch']['cos_diff']:.2e}" if "torch" in res else "")
                    + f"; NaN placement ok: {res['ours']['nan_ok']}; {verdict}")
            rows.append(row)
            if torch_row is not None:
                rows.append(torch_row)
            ratio = f"{row['ratio_to_torch']:.2f}x torch" if "ratio_to_torch" in row else ""
            log(f"  {name:<8} T={t_len:<5} ours {ms:8.3f} ms {row['TFLOPs']:7.1f} TFLOP/s"
                + (f" | {torch_row['kernel']} {torch_row['ms']:8.3f} ms "
                   f"{torch_row['TFLOPs']:7.1f} TFLOP/s | {ratio}" if torch_row else ""))
            default_out = d_out.copy_to_host()
            for warps, block_n in extra:
                pl_x = mma.plan(t_len, heads, head_dim, mma.dtype_kind(dt), True, warps=warps,
                                block_n=block_n)

                def theirs_plan():
                    mma.launch(pl_x, *words, t_len, kv, scale, d_out, d_lse)

                ms_x = timer.time(theirs_plan, reps=reps, warmup=warmup)
                diff = float(np.abs(d_out.copy_to_host() - default_out).max())
                row_x = {**row, "kernel": f"prefill_mma[w{warps},n{block_n}]", "ms": ms_x,
                         "default": False,
                         "TFLOPs": flops / (ms_x * 1e-3) / 1e12}
                for key in ("max_err", "bound", "cos_diff", "nan_ok", "check"):
                    row_x.pop(key, None)
                if torch_row is not None:
                    row_x["ratio_to_torch"] = torch_row["ms"] / ms_x
                rows.append(row_x)
                log(f"    plan w{warps} n{block_n}: {ms_x:8.3f} ms {row_x['TFLOPs']:7.1f} TFLOP/s"
                    + (f" | {row_x['ratio_to_torch']:.2f}x torch" if torch_row else "")
                    + f" | max |out - default plan's| {diff:.2e}")
    if bf16_tflops:
        for r in rows:
            r["frac_of_bf16_peak"] = r["TFLOPs"] / bf16_tflops
    return rows


def summary_lines(rows):
    """Markdown of ``bench_prefill_mma``'s rows for the bench summary: a table and
    the target lines (the default plan at ``TARGET_T``, each dtype)."""
    def num(r, key, fmt):
        x = r.get(key)
        return "-" if x is None or x == "" else format(float(x), fmt)

    lines = ["", "## Prefill on 16-bit tensor cores (bench.prefill_mma; causal, H 32, H_kv 8, "
             "D 128)", "",
             "q, K and V in the dtype, ours writes float32 out and lse. CUDA events around one "
             "enqueue (ours: `mma.launch` of a plan made once; torch: SDPA with `enable_gqa`, "
             "the backend that ran named), L2 flushed, host covered, median. FLOPs: 2 x 2 x "
             "T^2 / 2 x H x D. speed vs torch: torch's time over the row's. Check (default "
             "plan, kv group 0): max error against the float64 oracle, its bound (2 x the "
             "rounded-P float32 baseline's error + the floor), 1 - cos, NaN placement.", "",
             "| kernel | dtype | T | ms | TFLOP/s | of bf16 peak | speed vs torch | max err | "
             "bound | 1 - cos | check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['seq_len']} | {num(r, 'ms', '.3f')} | "
                     f"{num(r, 'TFLOPs', '.1f')} | {num(r, 'frac_of_bf16_peak', '.3f')} | "
                     f"{num(r, 'ratio_to_torch', '.2f')} | {num(r, 'max_err', '.2e')} | "
                     f"{num(r, 'bound', '.2e')} | {num(r, 'cos_diff', '.1e')} | "
                     f"{r.get('check') or '-'} |")
    lines += ["", "### Targets", ""]
    if not any(r.get("default") and int(r["seq_len"]) == TARGET_T for r in rows):
        lines.append(f"- no default-plan row at T {TARGET_T} in this run: the targets are not "
                     f"judged")
    for r in rows:
        if not r.get("default") or int(r["seq_len"]) != TARGET_T:
            continue
        ratio = r.get("ratio_to_torch")
        if ratio is None or ratio == "":
            lines.append(f"- prefill_mma {r['dtype']} T {TARGET_T}: no torch row in this run "
                         f"(target >= {TARGET_RATIO}x torch SDPA's speed): not measured")
            continue
        ratio = float(ratio)
        verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
        moon = "reached" if ratio >= MOONSHOT_RATIO else "not reached"
        lines.append(f"- prefill_mma {r['dtype']} T {TARGET_T}: x{ratio:.2f} torch SDPA's speed "
                     f"(target >= {TARGET_RATIO}): {verdict}; moonshot {MOONSHOT_RATIO}: {moon}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m bench.prefill_mma",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="timed repeats (>= 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-check", action="store_true", help="skip the oracle check")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    parser.add_argument("--plans", default="",
                        help="extra plans to time, comma list of WARPSxBLOCK_N (e.g. 4x64,8x32)")
    args = parser.parse_args(argv)
    reps = max(20, args.reps)
    try:
        extra = [tuple(int(x) for x in p.split("x")) for p in args.plans.split(",") if p]
    except ValueError:
        extra = None
    if extra is None or any(len(p) != 2 for p in extra):
        parser.error(f"--plans: expected a comma list of WARPSxBLOCK_N, got {args.plans!r}")

    from attention.core.device import device_name, gpu_available

    if not gpu_available():
        print("bench.prefill_mma: needs a CUDA GPU (none here)", file=sys.stderr)
        return 1
    from .gpu import Timer

    try:
        import torch
        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    print(f"device: {device_name()}; torch: {torch.__version__ if torch else 'absent'}")
    print("FLOPs: 2 * 2 * T^2/2 * H * D (causal: the visible half of Q.K^T and P.V)")
    rows = bench_prefill_mma(Timer(), torch, print, reps=reps, warmup=args.warmup,
                             check_rows=not args.no_check, extra=extra)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
