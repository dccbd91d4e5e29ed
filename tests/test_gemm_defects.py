"""Planted switches of the MLA GEMM path's kernels (``attention.gemm.tgemm``,
``attention.gemm.sgemm``, the softmax kernels of ``mla.attn_gemm``), and the GPU's
plans of those kernels run on the simulator.

* plain process, no kernel run: the switch names, their routing
  (``mutant_applies``) and unknown names rejected;
* plain process (``compile``): production PTX carries no mutant instruction
  (no f32 -> f16 ``cvt``, no ``chop_exp`` or bf16 mask) while the mutants that
  round do (positive controls); every switch compiles, its name in the kernel's
  entry; ``tf32_single`` issues one mma a tile and k8 step where the
  production kernel issues three (two with an fp16 ``b``);
* simulator / GPU (``device``): each gross defect is caught by
  ``validation.suite_mla_gemm`` (by the check of the method that runs its
  kernel); one precision mutant per kernel moves the output measurably away
  from a float64 reference where the production kernel stays within its
  bound; ``no_partials`` reaches tgemm under method "gemm" and sgemm under
  "gemm_fma";
* simulator / GPU (``device``), the GPU's plans: ``tgemm.GPU_PLAN`` (256
  threads, 32-k slices, 4-stage ring), ``sgemm.GPU_PLAN`` (16 x 16 threads,
  8 x 8 each) and the resident softmax's 256-thread block, each on one small
  case against float64 (tolerance: 2x the error of the same computation in
  numpy float32 plus 4 float32 ulps of max |ref|). The simulator otherwise runs
  reduced plans (tgemm (1, 1, 1, 1, 8, 2), sgemm (4, 2, 2), 64-thread resident
  softmax); the warp-a-row softmax has the same 128-thread block on both.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from attention.gemm import sgemm

from attention.gemm import tgemm
from mla import attn_gemm as G

F16_CVT = "cvt.rn.f16.f32"  # round_fp16's narrowing
CHOP_MASK = re.compile(r"and\.b32\s+%r\d+,\s*%r\d+,\s*-128;")  # chop_exp, 7 bits
BF16_MASK = re.compile(r"and\.b32\s+%r\d+,\s*%r\d+,\s*-65536;")  # round_bf16
MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"


# ---------------------------------------------------------------------------
# names and routing (no kernel)
# ---------------------------------------------------------------------------

def test_switch_names_and_routing():
    assert tgemm.PRECISION_MUTANTS == ("tf32_single", "no_partials", "ring_stale")
    assert tgemm.GROSS_DEFECTS == ("k_slice_dropped",)
    assert sgemm.PRECISION_MUTANTS == ("no_partials",)
    assert sgemm.GROSS_DEFECTS == ("k_tail_dropped",)
    assert G.SOFTMAX_MUTANTS == ("p_fp16", "p_bf16", "exp_approx", "scale_fp16")
    assert G.PRECISION_MUTANTS == ("tf32_single", "no_partials", "ring_stale", "p_fp16",
                                   "p_bf16", "exp_approx", "scale_fp16", "q_bf16")
    for name in tgemm.DEFECTS:
        assert G.mutant_applies(name, "gemm")
    for name in ("tf32_single", "ring_stale", "k_slice_dropped"):
        assert not G.mutant_applies(name, "gemm_fma")
    assert G.mutant_applies("no_partials", "gemm_fma")
    assert G.mutant_applies("k_tail_dropped", "gemm_fma")
    assert not G.mutant_applies("k_tail_dropped", "gemm")
    for name in G.SOFTMAX_SWITCHES + ("q_bf16",) + G.GEMM_DEFECTS:
        assert G.mutant_applies(name, "gemm") and G.mutant_applies(name, "gemm_fma")
    # what prepare hands each kernel
    assert G._kernel_switches("no_partials", True) == {
        "tgemm": "no_partials", "sgemm": None, "softmax": None, "q_bf16": False}
    assert G._kernel_switches("no_partials", False) == {
        "tgemm": None, "sgemm": "no_partials", "softmax": None, "q_bf16": False}
    assert G._kernel_switches("k_pe_ignored", True) == {
        "tgemm": None, "sgemm": None, "softmax": None, "q_bf16": False}
    assert G._kernel_switches("q_bf16", False)["q_bf16"] is True


def test_unknown_switches_rejected():
    from mla.pipeline import _route

    with pytest.raises(ValueError, match="defect"):
        tgemm.tgemm_kernel("znk", False, defect="k_tail_dropped")
    with pytest.raises(ValueError, match="defect"):
        sgemm.sgemm_kernel("znk", defect="tf32_single")
    with pytest.raises(ValueError, match="defect"):
        G.softmax_rows_kernel("q_bf16")
    with pytest.raises(ValueError, match="defect"):
        G.softmax_resident_kernel(1, "ring_stale")
    with pytest.raises(ValueError, match="defect"):
        G.mutant_applies("stuck_rescale", "gemm")
    with pytest.raises(ValueError, match="method"):
        G.mutant_applies("p_fp16", "flash")
    for name in G.KERNEL_SWITCHES:  # the pipeline accepts every switch
        assert _route(name)["attn"] == name
    with pytest.raises(ValueError, match="defect"):
        _route("p_fp32")


# ---------------------------------------------------------------------------
# compile-only
# ---------------------------------------------------------------------------

def _softmax_signature():
    from numba import types

    return (types.Array(types.float32, 3, "C"), types.Array(types.int32, 1, "C"),
            types.Array(types.float32, 2, "C"))


@functools.lru_cache(maxsize=None)
def _ptx(kind, defect=None, b16=False):
    """PTX (cc 9.0) of one kernel: ``kind`` "tgemm" / "sgemm" (b "znk"),
    "rows", "resident" (4 values a thread) or "round" (the q_bf16 step;
    ``defect`` unused)."""
    from numba import cuda, types

    from tests.test_mla_gemm import gemm_signature

    b_dtype = types.float16 if b16 else types.float32
    if kind == "tgemm":
        fn, sig = tgemm.tgemm_kernel("znk", b16, defect=defect).py_func, gemm_signature(b_dtype)
    elif kind == "sgemm":
        fn, sig = (sgemm.sgemm_kernel("znk", defect=defect).py_func,
                   gemm_signature(b_dtype, sgemm_kernel=True))
    elif kind == "rows":
        fn, sig = G.softmax_rows_kernel(defect).py_func, _softmax_signature()
    elif kind == "resident":
        fn, sig = G.softmax_resident_kernel(4, defect).py_func, _softmax_signature()
    else:
        f3 = types.Array(types.float32, 3, "C")
        fn, sig = G._round_bf16_rows, (f3,)
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    return ptx


def _entry(ptx):
    return re.search(r"\.entry\s+(\S+)\(", ptx).group(1)


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["tgemm", "sgemm", "rows", "resident"])
def test_production_ptx_has_no_mutant_instruction(kind):
    """No narrowing to f16 and no rounding mask in a production kernel, while
    the mutants built from the same source carry them (the patterns can match)."""
    ptx = _ptx(kind)
    assert F16_CVT not in ptx
    assert not CHOP_MASK.search(ptx) and not BF16_MASK.search(ptx)
    if kind in ("rows", "resident"):
        assert F16_CVT in _ptx(kind, "p_fp16") and F16_CVT in _ptx(kind, "scale_fp16")
        assert CHOP_MASK.search(_ptx(kind, "exp_approx"))
        assert BF16_MASK.search(_ptx(kind, "p_bf16"))
    if kind == "sgemm":
        assert BF16_MASK.search(_ptx("round"))  # the q_bf16 step


SWITCHES = ([("tgemm", d) for d in tgemm.DEFECTS] + [("sgemm", d) for d in sgemm.DEFECTS]
            + [(k, d) for k in ("rows", "resident") for d in G.SOFTMAX_SWITCHES])


@pytest.mark.compile
@pytest.mark.parametrize("kind,defect", SWITCHES, ids=[f"{k}-{d}" for k, d in SWITCHES])
def test_switch_compiles(kind, defect):
    """Every switch compiles; its kernel is named after it and differs from the
    production one (the production name carries no switch)."""
    ptx = _ptx(kind, defect)
    assert _entry(ptx).find(defect) >= 0, _entry(ptx)
    clean = _ptx(kind)
    assert not any(d in _entry(clean) for d in G.KERNEL_SWITCHES)
    body = ptx.replace(_entry(ptx), "")
    assert body != clean.replace(_entry(clean), ""), "the switch changed no instruction"


@pytest.mark.compile
@pytest.mark.parametrize("b16", [False, True], ids=["f32", "f16"])
def test_tf32_single_issues_fewer_mma(b16):
    _, _, tiles_m, tiles_n, _, _ = tgemm.PLAN
    terms = 2 if b16 else 3
    assert _ptx("tgemm", None, b16).count(MMA) == terms * tiles_m * tiles_n
    assert _ptx("tgemm", "tf32_single", b16).count(MMA) == tiles_m * tiles_n


# ---------------------------------------------------------------------------
# simulator / GPU: gross defects caught, precision mutants measurable
# ---------------------------------------------------------------------------

@pytest.mark.device
def test_suite_clean_run_passes():
    from validation import suite_mla_gemm

    checks = suite_mla_gemm.run_suite(None)
    failing = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert checks and not failing, failing


@pytest.mark.device
@pytest.mark.parametrize("defect,check", [("k_slice_dropped", "tensor cores"),
                                          ("k_tail_dropped", "fma gemms"),
                                          ("softmax_not_normalised", "prefill")])
def test_gross_defect_caught_by_suite(defect, check):
    """Each kernel's gross defect is in the suite's list and fails a check of
    the method that runs its kernel (a crash would raise here, not pass)."""
    from validation import suite_mla_gemm
    from validation.suite import caught

    assert defect in suite_mla_gemm.DEFECTS
    checks = suite_mla_gemm.run_suite(defect)
    assert caught(checks)
    assert any(c.name.startswith(check) and not c.passed for c in checks), \
        [c.name for c in checks if not c.passed]


def _gemm_case(k, m, n, seed, positive=False):
    rng = np.random.default_rng(seed)
    if positive:
        return (rng.random((1, m, k)).astype(np.float32),
                rng.random((1, n, k)).astype(np.float32))
    return (rng.standard_normal((1, m, k)).astype(np.float32),
            rng.standard_normal((1, n, k)).astype(np.float32))


def _run_gemm(module, a, b, plan=None, defect=None):
    """c = a[0] @ b[0].T through ``module.launch`` ("zmk", "znk", "zmn")."""
    from attention.core.device import to_device, to_host

    z_n, m, k = a.shape
    n = b.shape[1]
    d_c = to_device(np.full((z_n, m, n), np.nan, np.float32))
    kw = {} if plan is None else {"plan": plan}
    module.launch(to_device(a), to_device(b), d_c, to_device(np.zeros(z_n, np.int32)),
                  to_device(np.full(z_n, n, np.int32)), to_device(np.full(z_n, k, np.int32)),
                  1.0, a_order="zmk", b_order="znk", c_order="zmn", max_n=n, n_batch=z_n,
                  stream=0, defect=defect, **kw)
    return to_host(d_c)


@pytest.mark.device
def test_tgemm_mutants_measurable():
    """``tf32_single`` and ``ring_stale`` against the production kernel: it
    stays within the split-tf32 bound of ``tests.test_tgemm``; they leave it
    (tf32: ~2^-11 of |a||b| a product; stale: a slice multiplied twice)."""
    from tests.test_tgemm import _bound

    bm, bn = tgemm.tile_shape()
    k = 4 * tgemm.PLAN[4] + 8  # several slices, the last one short
    a, b = _gemm_case(k, bm // 2 + 1, bn, seed=3)
    want = a[0].astype(np.float64) @ b[0].astype(np.float64).T
    bound = _bound(a[0], b[0], k)
    clean = np.abs(_run_gemm(tgemm, a, b)[0] - want)
    assert (clean <= bound).all(), f"production: worst err/bound {(clean / bound).max():.3f}"
    for defect in ("tf32_single", "ring_stale"):
        err = np.abs(_run_gemm(tgemm, a, b, defect=defect)[0] - want)
        assert (err > bound).any() and err.max() > 30 * clean.max(), \
            f"{defect}: max err {err.max():.3e}, production {clean.max():.3e}"


@pytest.mark.device
def test_sgemm_no_partials_measurable():
    """One running sum over K = 2048 positive products (softmax weights times
    values) against the two-level sum: a larger error on average (the module
    docstring's emulation: 1.85x against 0.36x numpy's at K = 4096)."""
    k = 2048
    a, b = _gemm_case(k, 8, 8, seed=5, positive=True)
    want = a[0].astype(np.float64) @ b[0].astype(np.float64).T
    clean = np.abs(_run_gemm(sgemm, a, b)[0] - want).mean()
    mutant = np.abs(_run_gemm(sgemm, a, b, defect="no_partials")[0] - want).mean()
    assert mutant > 2 * clean, f"mean err: one sum {mutant:.3e}, two-level {clean:.3e}"


def _softmax_case(width, n_head, seed):
    rng = np.random.default_rng(seed)
    vis = np.array([1, width // 2 + 1, width], np.int32)
    return (rng.standard_normal((len(vis), n_head, width)) * 4).astype(np.float32), vis


def _run_softmax(s, vis, defect=None, threads=G.RESIDENT_THREADS):
    from attention.core.device import to_device, to_host

    p = {"n_q": s.shape[0], "nh": s.shape[1], "s": to_device(s.copy()), "vis": to_device(vis),
         "lse": to_device(np.full(s.shape[:2], np.nan, np.float32))}
    G.launch_softmax(p, 0, defect, threads)
    return to_host(p["s"]), to_host(p["lse"])


def _softmax_rows(s, vis):
    """For each query q: (its visible scores' count n, the float64 softmax of
    s[q, :, :n], numpy's float32 softmax of them)."""
    for q, n in enumerate(vis):
        x = s[q, :, :n].astype(np.float64)
        ref = np.exp(x - x.max(-1, keepdims=True))
        ref /= ref.sum(-1, keepdims=True)
        x32 = s[q, :, :n]
        e32 = np.exp(x32 - x32.max(-1, keepdims=True))
        yield q, n, ref, e32 / e32.sum(-1, keepdims=True)


def _softmax_errors(s, vis, got):
    """(max |got - float64 softmax|, the same for numpy's float32 softmax,
    max |ref|) over every visible entry."""
    err = base = mag = 0.0
    for q, n, ref, p32 in _softmax_rows(s, vis):
        base = max(base, np.abs(p32 - ref).max())
        err = max(err, np.abs(got[q, :, :n] - ref).max())
        mag = max(mag, np.abs(ref).max())
    return err, base, mag


def _relative_errors(s, vis, got, floor=1e-3):
    """(max relative error of ``got``, of numpy's float32 softmax) against the
    float64 softmax over the visible probabilities of at least ``floor`` (the
    smallest ones carry the float32 rounding of their large negative
    exponents: that error is the arguments', not the kernel's)."""
    err = base = 0.0
    for q, n, ref, p32 in _softmax_rows(s, vis):
        keep = ref >= floor
        base = max(base, (np.abs(p32 - ref)[keep] / ref[keep]).max())
        err = max(err, (np.abs(got[q, :, :n] - ref)[keep] / ref[keep]).max())
    return err, base


@pytest.mark.device
@pytest.mark.parametrize("form,defect", [("resident", "p_bf16"), ("resident", "scale_fp16"),
                                         ("warp", "exp_approx"), ("warp", "p_fp16")])
def test_softmax_mutant_measurable(form, defect, monkeypatch):
    """Relative error of the probabilities: the production softmax within 2x
    numpy float32's; the mutant at least 4x past that bound (bf16
    probabilities: up to 2^-9 relative; fp16 ones 2^-12; scores in fp16: up
    to 2^-11 of a score of magnitude ~10 in the exponent; chopped exp: up to
    2^-16, always low)."""
    if form == "warp":
        monkeypatch.setattr(G, "RESIDENT_VALS", ())
    s, vis = _softmax_case(2 * G.RESIDENT_THREADS + 3, 3, seed=12)
    clean, _ = _run_softmax(s, vis)
    err, base = _relative_errors(s, vis, clean)
    bound = 2 * base
    assert err <= bound, f"production: relative err {err:.3e} > {bound:.3e}"
    mutant, _ = _run_softmax(s, vis, defect)
    err_m, _ = _relative_errors(s, vis, mutant)
    assert err_m > 4 * bound, f"{defect}: relative err {err_m:.3e}, bound {bound:.3e}"


@pytest.mark.device
def test_q_bf16_measurable():
    """q rounded to bf16 before the score GEMM: the output leaves the oracle's
    tolerance that the production path meets."""
    from mla.dims import SMALL_SHAPES
    from mla.pipeline import mla_attend
    from validation.suite_mla import make_case, parity

    args = make_case(SMALL_SHAPES[0], 3, 11, seed=21)
    for method in ("gemm", "gemm_fma"):
        p = parity(mla_attend(*args, method=method), args)
        assert p["ok"], p
        m = parity(mla_attend(*args, method=method, defect="q_bf16"), args)
        assert not m["ok"] and m["err_naive"] > 4 * p["err_naive"], (method, m, p)


@pytest.mark.device
@pytest.mark.parametrize("method,kernel", [("gemm", "tgemm"), ("gemm_fma", "sgemm")])
def test_no_partials_routed_by_method(method, kernel, monkeypatch):
    """``no_partials`` reaches tgemm's launches under "gemm" (at a shape where
    tgemm takes the attention GEMMs) and sgemm's under "gemm_fma", never the
    other GEMM."""
    from mla.pipeline import mla_attend
    from validation.suite_mla import make_case
    from validation.suite_mla_gemm import tensor_dims

    seen = []
    for mod in (tgemm, sgemm):
        real = mod.launch

        def spy(*args, _real=real, _name=mod.__name__.rsplit(".", 1)[-1], **kw):
            seen.append((_name, kw.get("defect")))
            return _real(*args, **kw)

        monkeypatch.setattr(mod, "launch", spy)
    args = make_case(tensor_dims(), 2, 5, seed=2)
    mla_attend(*args, method=method, defect="no_partials")
    assert (kernel, "no_partials") in seen, seen
    assert all(d is None for name, d in seen if name != kernel), seen
    if kernel == "tgemm":
        assert sum(name == "tgemm" for name, _ in seen) == 2, seen


# ---------------------------------------------------------------------------
# simulator / GPU: the GPU's plans
# ---------------------------------------------------------------------------

def _gemm_tolerance(a, b, want):
    """2x numpy float32's error on the same product plus 4 ulps of max |ref|."""
    base = np.abs(a[0] @ b[0].T - want).max()
    return 2 * base + 4 * float(np.spacing(np.float32(np.abs(want).max())))


@pytest.mark.device
def test_tgemm_gpu_plan():
    """``tgemm.GPU_PLAN`` (8 warps as 2 x 4, 4 x 4 tiles each, 32-k slices, a
    4-entry ring): one block, one slice (K = 32: on the simulator the 256
    threads' shuffle-built mmas take ~40 s a slice), rows 65 of the block's 128
    and columns 24 of 128 (bounded copies, the epilogue's edge tests)."""
    plan = tgemm.GPU_PLAN
    bm, _ = tgemm.tile_shape(plan)
    a, b = _gemm_case(plan[4], bm // 2 + 1, 24, seed=8)
    want = a[0].astype(np.float64) @ b[0].astype(np.float64).T
    got = _run_gemm(tgemm, a, b, plan=plan)[0]
    err, tol = np.abs(got - want).max(), _gemm_tolerance(a, b, want)
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e}"


@pytest.mark.device
def test_sgemm_gpu_plan():
    """``sgemm.GPU_PLAN`` (16 x 16 threads, 8 x 8 each: a 128 x 128 tile):
    M 20, N 24, K 40 (three 16-k slices, the last short; bounded fetches)."""
    a, b = _gemm_case(40, 20, 24, seed=9)
    want = a[0].astype(np.float64) @ b[0].astype(np.float64).T
    got = _run_gemm(sgemm, a, b, plan=sgemm.GPU_PLAN)[0]
    err, tol = np.abs(got - want).max(), _gemm_tolerance(a, b, want)
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e}"


@pytest.mark.device
def test_softmax_resident_gpu_block():
    """The resident softmax with the GPU's 256-thread block (8 warps in
    ``block_max`` / ``block_sum``): rows of 1, 258 and 515 visible positions
    (four slots a thread, up to three used; most threads empty in the first)."""
    threads = G.GPU_RESIDENT_THREADS
    s, vis = _softmax_case(2 * threads + 3, 2, seed=13)
    assert G.resident_vals(s.shape[2], threads) == 4
    got, lse = _run_softmax(s, vis, threads=threads)
    err, base, mag = _softmax_errors(s, vis, got)
    tol = 2 * base + 4 * float(np.spacing(np.float32(mag)))
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e}"
    for q, n in enumerate(vis):
        np.testing.assert_array_equal(got[q, :, n:], s[q, :, n:])  # past the length
        x = s[q, :, :n].astype(np.float64)
        ref_lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
        assert np.abs(lse[q] - ref_lse).max() <= 1e-5 * max(1.0, np.abs(ref_lse).max())
