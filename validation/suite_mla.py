"""Falsification suite for the MLA kernels (absorbed form, latent cache, RoPE).

Contract: ``validation/suite.py``. ``run_suite(None)`` returns only passing
checks; ``run_suite(d)`` for each planted defect ``d`` in ``DEFECTS`` returns
at least one failing check. The defects are switches of the same kernel
sources (``mla.kernels`` factories, ``defect=``):

    rope_pairs_swapped        RoPE rotates half-split pairs (i, i + d/2)
    w_uk_transposed           absorb_q reads each head's W_UK plane transposed
    append_one_row_late       append_latent writes row i at lo + i + 1
    causal_offset_off_by_one  attention sees one position past the causal bound
    stuck_rescale             the running softmax state is never rescaled
    k_pe_ignored              the rotary half of the score is dropped

Fixtures (``make_case``) are unit-scale inputs with weights ~ 1/sqrt(r), so
scores and outputs are O(1) and an absolute tolerance means something.
Tolerance: the validation rule's max bound (``validation.tolerance.budget``:
2x the error of the float32 baseline in the order of the path's kernels,
``validation.baselines``, plus two float32 ulps of max|ref|).

``small=True`` (the simulator) uses the small shapes with 8-row attention tiles
(so 11 positions span two tiles); ``small=False`` adds both presets with the
default tile plan at (4, 4), (3, 9) and (17, 17).
"""

from __future__ import annotations

import numpy as np

from mla import oracle
from mla.kernels import APPEND_DEFECTS, ROPE_DEFECTS
from mla.dims import DEEPSEEK_V3, NOPE_64x256, SMALL_SHAPES
from validation import baselines, tolerance
from validation.suite import Check

FAMILY = "mla"
DEFECTS = (
    "rope_pairs_swapped",
    "w_uk_transposed",
    "append_one_row_late",
    "causal_offset_off_by_one",
    "stuck_rescale",
    "k_pe_ignored",
)


def make_case(dims, t_q, t_kv, seed):
    """(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv) float32, the oracles' argument order."""
    rng = np.random.default_rng(seed)
    ws = 1.0 / np.sqrt(dims.kv_rank)

    def f(*shape, sc=1.0):
        return (rng.standard_normal(shape) * sc).astype(np.float32)

    return (f(t_q, dims.n_head, dims.d_nope), f(t_q, dims.n_head, dims.d_rope),
            f(t_kv, dims.kv_rank), f(t_kv, dims.d_rope),
            f(dims.n_head, dims.d_nope, dims.kv_rank, sc=ws),
            f(dims.n_head, dims.d_v, dims.kv_rank, sc=ws))


def baseline_order(method, args):
    """The registry's baseline order of the kernel behind ``method`` (flash,
    gemm, gemm_fma), resolved for these arguments (``validation.baselines``)."""
    from validation.registry import KERNELS_BY_NAME

    name = {"flash": "mla", "gemm": "mla_gemm", "gemm_fma": "mla_gemm_fma"}[method]
    return baselines.resolve(KERNELS_BY_NAME[name].baseline, {"q_nope": args[0]}, np.float32)


def parity(got, args, scale=None, naive=True, method=None):
    """Compare a kernel output with both oracles (``naive=False``: the absorbed one
    only, for long contexts where decompressing every row per head is too slow).

    ``method`` (the suites): the bound is the validation rule's max bound
    (``validation.tolerance.budget``) against the baseline in the order of the
    kernel behind ``method``; None (kernel unit tests): ``mla.oracle.tolerance``
    against the oracle code in float32.

    Returns a dict: err_naive, err_absorbed, baseline_err, tol, magnitude,
    finite, where (index of the largest error) and ok.
    """
    got = np.asarray(got, dtype=np.float64)
    absorbed = oracle.mla_attend_absorbed(*args, scale=scale)
    naive = oracle.mla_attend_naive(*args, scale=scale) if naive else absorbed
    if method is not None and scale is None:
        baseline = baselines.mla_order(*args, baseline_order(method, args))
    else:
        baseline = oracle.mla_attend_float32(*args, scale=scale)
    baseline_err = float(np.abs(baseline - naive).max()) if naive.size else 0.0
    magnitude = float(np.abs(naive).max()) if naive.size else 0.0
    d_nope, width = args[0].shape[2], args[2].shape[1] + args[3].shape[1]
    if method is not None and scale is None:
        tol = tolerance.budget(naive, baseline)
    else:
        tol = oracle.tolerance(baseline_err, magnitude, max(width, d_nope))
    finite = bool(np.isfinite(got).all())
    err_n = float(np.abs(got - naive).max()) if got.size and finite else (0.0 if finite
                                                                           else np.inf)
    err_a = float(np.abs(got - absorbed).max()) if got.size and finite else (0.0 if finite
                                                                             else np.inf)
    where = (tuple(int(i) for i in np.unravel_index(np.argmax(np.abs(got - naive)), got.shape))
             if got.size and finite else None)
    return {"err_naive": err_n, "err_absorbed": err_a, "baseline_err": baseline_err,
            "tol": tol, "magnitude": magnitude, "finite": finite, "where": where,
            "ok": finite and err_n <= tol and err_a <= tol}


def _detail(p):
    return (f"err naive {p['err_naive']:.3e} absorbed {p['err_absorbed']:.3e} tol {p['tol']:.3e} "
            f"(baseline {p['baseline_err']:.3e}, |ref| {p['magnitude']:.3g}) worst at "
            f"[t, h, j]={p['where']}")


def _only(defect, allowed):
    """The defect if the kernel being called carries it, else None."""
    return defect if defect in allowed else None


def _check(name, fn):
    """Run ``fn() -> (passed, detail)`` as a check. An exception propagates: a
    crash is not a detection (``validation.defects`` records the suite as an
    error, which fails the run)."""
    passed, detail = fn()
    return Check(name, bool(passed), detail)


def _prefill_check(dims, t_q, t_kv, seed, tile, defect, method="flash"):
    from mla.pipeline import mla_attend

    def run():
        args = make_case(dims, t_q, t_kv, seed)
        got = mla_attend(*args, tile=tile, defect=defect, method=method)
        p = parity(got, args, method=method)
        return p["ok"], _detail(p)

    label = f"prefill nh{dims.n_head} r{dims.kv_rank} p{dims.d_rope} t_q{t_q} t_kv{t_kv}"
    return _check(label, run)


def _decode_check(dims, prefill, steps, tile, defect, method="flash"):
    from mla.cache import LatentCache
    from mla.pipeline import mla_attend_cached

    total = prefill + steps
    args = make_case(dims, total, total, seed=0x57E9 + total)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = args
    rows = oracle.latent_rows_ref(c_kv, k_pe)
    append_defect = _only(defect, APPEND_DEFECTS)
    out = []

    def run():
        cache = LatentCache(1, total + 2, dims)
        cache.append(0, c_kv[:prefill], k_pe[:prefill], defect=append_defect)
        got_rows = cache.rows(0)
        if not np.array_equal(got_rows, rows[:prefill]) or not cache.in_step():
            return False, "appended rows differ from the host layout [c_kv | k_pe]"
        worst = []
        for step in range(steps):
            pos = prefill + step
            cache.append(0, c_kv[pos:pos + 1], k_pe[pos:pos + 1], defect=append_defect)
            got = mla_attend_cached(q_nope[pos:pos + 1], q_pe[pos:pos + 1], cache, 0, w_uk,
                                    w_uv, tile=tile, defect=defect, method=method)
            p = parity(got, (q_nope[pos:pos + 1], q_pe[pos:pos + 1], c_kv[:pos + 1],
                             k_pe[:pos + 1], w_uk, w_uv), method=method)
            worst.append(f"step {step}: {_detail(p)}")
            if not p["ok"]:
                return False, worst[-1]
        return cache.in_step(), "; ".join(worst[-1:])

    out.append(_check(f"decode via cache nh{dims.n_head} r{dims.kv_rank} p{dims.d_rope}", run))
    return out


def _rope_check(d_rope, defect):
    from mla.kernels import rope_interleaved

    def run():
        rng = np.random.default_rng(0x0DE2026)
        host = rng.standard_normal((7, 5, d_rope)).astype(np.float32)
        positions = np.arange(7) * 13
        want = oracle.rope_interleaved_ref(host, positions)
        base_err = float(np.abs(oracle.rope_interleaved_float32(host, positions) - want).max())
        got = rope_interleaved(host.copy(), positions, defect=_only(defect, ROPE_DEFECTS))
        err = float(np.abs(got - want).max())
        tol = 2 * base_err + 4 * oracle.F32_EPS * max(1.0, float(np.abs(want).max()))
        return err <= tol, f"err {err:.3e} tol {tol:.3e}"

    return _check(f"rope d_rope {d_rope}", run)


def run_suite(defect=None, *, small=True, method="flash", defects=DEFECTS):
    """The checks of the ``method`` path ("flash" here; ``suite_mla_gemm``
    runs them through "gemm" with its own ``defects``)."""
    if defect is not None and defect not in defects:
        raise ValueError(f"defect: expected one of {defects} or None, got {defect!r}")
    tile = 8 if small and method == "flash" else None
    rope_shape, nope_shape = SMALL_SHAPES[0], SMALL_SHAPES[2]
    results = [
        _prefill_check(rope_shape, 5, 5, 7, tile, defect, method),
        _prefill_check(rope_shape, 3, 11, 12, tile, defect, method),
        _prefill_check(nope_shape, 3, 11, 13, tile, defect, method),
    ]
    results += _decode_check(rope_shape, 5, 2, tile, defect, method)
    results.append(_rope_check(8, defect))
    if not small:
        results.append(_rope_check(64, defect))
        for dims in (DEEPSEEK_V3, NOPE_64x256):
            for (t_q, t_kv), seed in zip(((4, 4), (3, 9), (17, 17)), (27, 28, 29)):
                results.append(_prefill_check(dims, t_q, t_kv, seed, None, defect, method))
    return results
