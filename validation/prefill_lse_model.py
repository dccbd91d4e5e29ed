"""Host model of the LSE arithmetic of the tensor-core prefill (``attention.prefill.mma``).

Run: ``python -m validation.prefill_lse_model [--dtypes float16,bfloat16] [--heads 3]
[--rows 8]`` (about 20 s a head and dtype).

Inputs: the full-shape GPU test's (``tests/test_prefill_mma.py``,
``test_full_shape_matches_the_oracle``): ``default_rng(4096)``, standard-normal
q [4096, 32*128], k and v [4096, 8*128] rounded to the dtype, causal, scale
``1 / sqrt(128)``, the GPU plan (``attention.prefill.mma.default_warps(128)``, 8
warps: 128 query rows a block, 16 a warp; K / V tiles of 64 positions; a warp
computes the tiles up to its own diagonal, so the warps a block do not change
any row's arithmetic: the findings below, made with 4, hold). Per query head h
(kv head ``h // 4``) it builds:

* the scores S [4096, 4096] float32 as the mma sums them
  (``validation.baselines.mma16_scores``, the kernel's raw scores);
* the float64 oracle's LSE [4096] (``attention.oracle.prefill_attention_ref``)
  and the same-precision baseline's (``validation.baselines.prefill_rounded_p``);
* the kernel's LSE [4096] replayed in numpy float32 from S, lane by lane, in the
  kernel's order: per warp the K / V tiles it computes (tiles above its diagonal
  skipped, masked positions -inf), per row the quad of lanes ``tq = 0..3``
  holding positions ``k0 + 8 nt + 2 tq + e`` (summed in ``(nt, e)`` order), the
  row max ``m`` of the raw scores, ``ref = fl(m scale2)`` with ``scale2 =
  fl(scale log2 e)``, the weights ``ex2(fma(s, scale2, -ref))``, the lane sums
  ``l = fma(l, alpha, tile sum)``, the quad's butterfly sum
  ``(l0 + l2) + (l1 + l3)`` and ``lse = fma(m, scale, logf(l))``. ``ex2.approx``
  is modelled as the correctly rounded exp2 (flushing results below 2^-126);
  its own error (about 2 ulps) moves an LSE by at most a few 1e-7, except
  through ``alpha``, where the ``+1ulp`` variant shows it.

What it shows: the rescale factor ``alpha`` of the compiled kernel. The source
writes ``alpha = ex2(fl(m_old scale2) - fl(m_new scale2))`` (exactly 1 while the
max stays), but ``m_old scale2`` is a PTX ``mul.f32`` without ``.rn`` and
ptxas contracts it with the subtraction into one FFMA (the sm_90 SASS has
``FFMA R, m_old, scale2, -ref``): ``alpha = ex2(fma(m_old, scale2, -fl(m scale2)))
= 2^r``, r the rounding error of ``m scale2`` (up to half an ulp of it), not 1.
Every tile after the max is set multiplies ``l`` by that same ``alpha`` (``o``
too, so ``out = o / l`` is unaffected), and the LSE keeps the compounded factor:
about (tiles after each term) x (alpha - 1). At head 3, row 3767 (raw max 66.06
at position 137, tile 2; ``m scale2 = 8.42``, ulp 9.5e-7) alpha is 1 + 2 ulps in
fp16, and the row's LSE is off by 6.587e-6, the H200's figure to four digits.
Variants (one step changed each; the table gives every one's error):

    kernel      the compiled kernel (contracted alpha)
    +1ulp       as kernel, alpha rounded one ulp further from 1 (ex2.approx's
                latitude; bf16 row 3767 sits on a rounding tie of alpha, and
                this gives the H200's bf16 figure, 7.18e-6)
    f64 ref     ref = m scale2 unrounded (float64) in the weights and alpha: r = 0
    f64 s2      scale2 = scale log2 e unrounded; ref still rounded (r changes,
                the compounding stays)
    f64 p       weights and alpha exp2 in float64 from unrounded arguments (and
                the sums in float64): alpha = 1 + r ln 2, still compounding
    f64 l       the tile sums, the rescale of l and the quad sum in float64
    f64 log     the final log and fma in float64 (lse not rounded to float32)
    fix         alpha = ex2(ref_old - ref_new) with the reference kept from the
                last tile (no multiply left to contract): the kernel's form now
    fa2         alpha = ex2(fl(fl(m_old - m_new) scale2)), FlashAttention-2's form

Found (head 3): kernel 6.587e-6 (fp16; H200 6.587e-6) and 6.12e-6 (bf16; row
3767 3.36e-6, 7.18e-6 with +1ulp; H200 7.178e-6) against bounds 3.95e-6 /
3.84e-6; "f64 ref", "fix" and "fa2" bring it to 1.1e-6-1.2e-6 (baseline
1.02e-6 / 0.97e-6); "f64 l" and "f64 log" change nothing that matters.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

F32, F64 = np.float32, np.float64
T, H, H_KV, D = 4096, 32, 8, 128
WARPS, ROWS, BN = 8, 16, 64  # the plan of D 128 (``default_warps``, ``default_block_n``)
LOG2E = F32(np.log2(np.e))

VARIANTS = ("kernel", "+1ulp", "f64 ref", "f64 s2", "f64 p", "f64 l", "f64 log", "fix", "fa2")


def inputs(dtype):
    """q [T, H*D], k, v [T, H_KV*D] as ``test_full_shape_matches_the_oracle`` draws
    them (``make_qkv`` with ``default_rng(4096)``)."""
    rng = np.random.default_rng(4096)
    q = rng.standard_normal((T, H * D), np.float32).astype(dtype)
    k = rng.standard_normal((T, H_KV * D), np.float32).astype(dtype)
    v = rng.standard_normal((T, H_KV * D), np.float32).astype(dtype)
    return q, k, v


def _round_f32(x):
    return np.asarray(x, F64).astype(F32)


def _fma(a, b, c):
    """fl(a b + c) for float32 operands (the float64 product is exact)."""
    return _round_f32(np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64))


def _ex2(x, f64=False):
    """ex2.approx.ftz.f32 as the correctly rounded exp2, results below 2^-126 flushed."""
    y = np.exp2(np.asarray(x, F64))
    if f64:
        return y
    y = y.astype(F32)
    y[y < F32(2.0 ** -126)] = 0
    return y


def _away_from_one(a):
    """a moved one float32 ulp further from 1 (1 stays 1)."""
    out = a.copy()
    up, down = a > 1, a < 1
    out[up] = np.nextafter(a[up], F32(np.inf))
    out[down] = np.nextafter(a[down], F32(0))
    return out


def kernel_lse(scores, scale, variant="kernel"):
    """The kernel's lse [T] float32 (float64 for "f64 log") of one head from its
    raw scores [T, T] float32, causal, the GPU plan; also the rows' final m [T]
    and l [T]. ``variant``: one of ``VARIANTS`` (module docstring)."""
    scale = F32(scale)
    s2 = F64(scale) * F64(np.log2(np.e)) if variant == "f64 s2" else F64(F32(scale * LOG2E))
    wide = variant in ("f64 p", "f64 l")  # lane sums in float64
    rows = np.arange(T)
    wrow0 = rows // ROWS * ROWS
    q0 = rows // (ROWS * WARPS) * (ROWS * WARPS)
    n_tiles = (np.minimum(T, q0 + ROWS * WARPS) + BN - 1) // BN  # the block's
    m = np.full((T, 1), -np.inf, F32)
    kept = np.full((T, 1), -np.inf)  # "fix": the last tile's reference (-inf: none)
    lanes = np.zeros((T, 4), F64 if wide else F32)
    for j in range(T // BN):
        k0 = j * BN
        r = rows[(j < n_tiles) & (k0 <= wrow0 + ROWS - 1)]  # warps that compute tile j
        s = np.array(scores[r, k0:k0 + BN])
        s[np.arange(k0, k0 + BN)[None, :] > r[:, None]] = -np.inf
        # lane tq holds positions k0 + 8 nt + 2 tq + e, summed in (nt, e) order
        s = s.reshape(len(r), BN // 8, 4, 2).transpose(0, 2, 1, 3).reshape(len(r), 4, -1)
        old = m[r]
        new = np.maximum(old, s.max(axis=(1, 2))[:, None])
        seen = new > F32(-3.0e38)
        prod = new.astype(F64) * s2
        if variant != "f64 ref":
            prod = _round_f32(prod).astype(F64)  # ref = fl(m scale2)
        ref = np.where(seen, prod, 0.0)  # a row that saw nothing: reference 0
        with np.errstate(invalid="ignore"):
            if variant == "fix":
                arg = _round_f32(kept[r] - ref)
            elif variant == "fa2":
                arg = np.where(seen, _round_f32(_round_f32(old - new) * s2), -np.inf)
            else:  # ptxas's FFMA: fl(m_old scale2 - ref), the product unrounded
                arg = _round_f32(old.astype(F64) * s2 - ref)
        alpha = np.exp2(arg.astype(F64)) if variant == "f64 p" else _ex2(arg)
        if variant == "+1ulp":
            alpha = _away_from_one(alpha)
        x = s.astype(F64) * s2 - ref[:, :, None]  # the weights' fma, unrounded
        p = np.exp2(x) if variant == "f64 p" else _ex2(_round_f32(x))
        tile = np.zeros((len(r), 4), lanes.dtype)
        for i in range(p.shape[2]):
            tile = tile + p[:, :, i].astype(lanes.dtype)
        if wide:
            lanes[r] = lanes[r] * alpha + tile
        else:
            lanes[r] = _fma(lanes[r], alpha, tile)
        m[r] = new
        kept[r] = np.where(seen, prod, -np.inf)
    m = m[:, 0]
    l = (lanes[:, 0] + lanes[:, 2]) + (lanes[:, 1] + lanes[:, 3])  # the quad's butterfly
    if variant == "f64 log":
        return m.astype(F64) * F64(scale) + np.log(l.astype(F64)), m, l
    return _fma(m, scale, np.log(l.astype(F64)).astype(F32)), m, l


def tiles_after(row, argmax):
    """Tiles row ``row`` computes after the one holding its max (each rescales l)."""
    wrow0 = row // ROWS * ROWS
    last = min(wrow0 + ROWS - 1, T - 1) // BN
    return last - argmax // BN


def study(dtype, head, n_rows):
    from attention.oracle import prefill_attention_ref
    from validation.baselines import mma16_scores, prefill_rounded_p
    from validation.tolerance import budget, floor

    q, k, v = inputs(dtype)
    g = head * H_KV // H
    qh = np.ascontiguousarray(q[:, head * D:(head + 1) * D])
    kh = np.ascontiguousarray(k[:, g * D:(g + 1) * D])
    vh = np.ascontiguousarray(v[:, g * D:(g + 1) * D])
    scale = 1.0 / np.sqrt(D)
    ref = prefill_attention_ref(qh, kh, vh, 1, 1, causal=True, scale=scale)[1][0]
    base = prefill_rounded_p(qh, kh, vh, 1, 1, True, scale, dtype)[1][0]
    scores = mma16_scores(qh.astype(F32), kh.astype(F32))
    errs, ms, ls = {}, None, None
    for variant in VARIANTS:
        lse, m, l = kernel_lse(scores, scale, variant)
        errs[variant] = lse.astype(F64) - ref
        if variant == "kernel":
            ms, ls = m, l
    base_err = base.astype(F64) - ref
    bound = budget(ref, base)
    name = np.dtype(dtype).name
    print(f"\n{name} head {head}: bound {bound:.3e} (2 x baseline {np.abs(base_err).max():.3e}"
          f" + floor {floor(ref):.3e}); max |err| of each:")
    print("  " + "  ".join(f"{v} {np.abs(e).max():.3e}" for v, e in errs.items()))
    s2 = F32(F32(scale) * LOG2E)
    print("  worst rows of the kernel model (m raw max; r = m s2 - fl(m s2); alpha - 1 in "
          "ulps of 1 (2^-23); n: tiles after the max's):")
    cols = ["row", "m", "r", "a-1", "n", "l", "baseline"] + list(VARIANTS)
    print("  " + " ".join(f"{c:>9}" for c in cols))
    worst = np.argsort(-np.abs(errs["kernel"]))[:n_rows]
    for row in sorted(set(worst.tolist()) | {3767}, key=lambda x: -abs(errs["kernel"][x])):
        mm = ms[row]
        fl = F32(mm * s2)
        r = float(F64(mm) * F64(s2) - F64(fl))
        alpha = F32(np.exp2(F64(F32(r))))
        a_ulps = (F64(alpha) - 1.0) / 2.0 ** -23
        n = tiles_after(row, int(np.argmax(scores[row, :row + 1])))
        vals = [f"{row:>9d}", f"{mm:9.3f}", f"{r:+9.2e}", f"{a_ulps:+9.1f}", f"{n:>9d}",
                f"{ls[row]:9.3f}", f"{base_err[row]:+9.2e}"]
        vals += [f"{errs[v][row]:+9.2e}" for v in VARIANTS]
        print("  " + " ".join(vals))
    return {v: float(np.abs(e).max()) for v, e in errs.items()}, bound


def main(argv=None):
    from attention.core.device import BFLOAT16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--heads", default="3", help="query heads, comma-separated (0..31)")
    ap.add_argument("--rows", type=int, default=8, help="worst rows shown a head")
    args = ap.parse_args(argv)
    dtypes = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
    for name in args.dtypes.split(","):
        for head in (int(h) for h in args.heads.split(",")):
            t0 = time.time()
            study(dtypes[name], head, args.rows)
            print(f"  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
