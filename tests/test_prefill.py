"""Multi-head prefill attention: the fused product kernel (``attention.prefill.kernels``)
and the batched and per-head reference paths (``attention.reference.prefill_paths``).

Every method is held to the float64 oracle with the derived budget of
``validation.tolerance`` (at most 2x the error of the same oracle code run in
float32, plus a few float32 ulps of the largest reference value, so a baseline
that happens to be exact does not demand bit-exactness).

Processes:
* plain: bad input (before any copy or launch), T == 0, tile configuration,
  the tolerance machinery's positive control, compile-only PTX checks;
* simulator (``device``): every method at small shapes (T <= 37, H <= 4,
  D <= 40): each simulated shuffle or barrier costs milliseconds, so the
  shapes are picked to cross tile edges with as few rows as possible;
* GPU (``device`` at full shapes, ``gpu``): T up to 4096, H 32, H_kv 8,
  D 64 / 80 / 128, T 1 / 97 / 1025.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest


import attention.prefill.kernels as prefill_mod
import attention.reference.prefill_paths as reference_mod
from attention.core import checks
from attention.oracle import prefill_attention_ref
from attention.prefill.kernels import (
    FUSED_WARPS,
    PREFILL_DEFECTS,
    SHARED_BUDGET,
    fused_config,
    prefill_attention,
)
from attention.reference.prefill_paths import prefill_attention_reference
from tests.conftest import MODE, small
from validation import suite_prefill, tolerance
from validation.baselines import prefill_order
from validation.suite import caught
from validation.suite_prefill import METHODS, attend, compare

# the logger each method traces to under ATTN_PREFILL_DEBUG
LOGGERS = {"fused": "attention.prefill.kernels", "batched": "attention.reference.prefill_paths",
           "per_head": "attention.reference.prefill_paths"}


def make_qkv(t_len, n_heads, n_kv, head_dim, seed=0):
    """Standard-normal rows: scores spread ~1, so every key carries weight."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t_len, n_heads * head_dim)).astype(np.float32)
    k = rng.standard_normal((t_len, n_kv * head_dim)).astype(np.float32)
    v = rng.standard_normal((t_len, n_kv * head_dim)).astype(np.float32)
    return q, k, v


def group_inputs(t_len, n_heads, n_kv, head_dim, seed, g):
    """(query columns, (q, k, v, H/H_kv, 1)) of kv group ``g``: its kv head and
    query heads as a problem of their own."""
    q, k, v = make_qkv(t_len, n_heads, n_kv, head_dim, seed)
    per = n_heads // n_kv
    qcols = slice(g * per * head_dim, (g + 1) * per * head_dim)
    kcols = slice(g * head_dim, (g + 1) * head_dim)
    return qcols, (q[:, qcols], k[:, kcols], v[:, kcols], per, 1)


def kv_groups(t_len, n_heads, n_kv, head_dim, causal, seed, groups, label):
    """Oracle and same-precision baseline for the query heads of the chosen kv heads.

    A kv head and its ``H/H_kv`` query heads form an independent problem
    (H = H/H_kv, H_kv = 1), so large shapes are checked on a few groups
    (the float64 oracle loops over rows in Python). The baseline sums q.k in
    order ``label`` (``validation.baselines.prefill_order``; the method's, from
    ``suite_prefill.baseline_label``). Returns a list of ``(g, query columns,
    (ref_out, ref_lse), (base_out, base_lse))``.
    """
    found = []
    for g in groups:
        qcols, args = group_inputs(t_len, n_heads, n_kv, head_dim, seed, g)
        found.append((g, qcols, oracle(t_len, n_heads, n_kv, head_dim, causal, seed, g),
                      prefill_order(*args, causal, label)))
    return found


@functools.lru_cache(maxsize=None)
def oracle(t_len, n_heads, n_kv, head_dim, causal, seed, g):
    """The float64 oracle (out, lse) of kv group ``g``'s query heads (shared by the
    methods, whose baselines differ)."""
    _, args = group_inputs(t_len, n_heads, n_kv, head_dim, seed, g)
    return prefill_attention_ref(*args, causal=causal)


@functools.lru_cache(maxsize=None)
def references(t_len, n_heads, n_kv, head_dim, causal, seed, all_groups, label):
    groups = range(n_kv) if all_groups else sorted({0, n_kv - 1})
    return kv_groups(t_len, n_heads, n_kv, head_dim, causal, seed, tuple(groups), label)


def assert_matches_oracle(method, t_len, n_heads, n_kv, head_dim, causal, seed=0):
    q, k, v = make_qkv(t_len, n_heads, n_kv, head_dim, seed)
    out, lse = attend(method, q, k, v, n_heads, n_kv_heads=n_kv, causal=causal,
                      return_lse=True)
    assert out.shape == (t_len, n_heads * head_dim) and lse.shape == (n_heads, t_len)
    all_groups = t_len * n_heads <= 4096  # small problems: every head
    per = n_heads // n_kv
    for g, qcols, ref, base in references(t_len, n_heads, n_kv, head_dim, causal, seed,
                                          all_groups, suite_prefill.baseline_label(method)):
        label = f"{method} T={t_len} H={n_heads} H_kv={n_kv} D={head_dim} causal={causal} g={g}"
        for what, got, r, b in (("out", out[:, qcols], ref[0], base[0]),
                                ("lse", lse[g * per:(g + 1) * per], ref[1], base[1])):
            check = compare(f"{label} {what}", got, r, b)
            assert check.passed, f"{check.name}: {check.detail}"


# ---------------------------------------------------------------------------
# plain process: validation, empty input, configuration, the tolerance itself
# ---------------------------------------------------------------------------

@pytest.fixture
def no_device(monkeypatch):
    """Any copy to the device fails the test: validation must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("copied to the device before validation finished")
    monkeypatch.setattr(prefill_mod, "to_device", forbidden)
    monkeypatch.setattr(prefill_mod, "device_empty", forbidden)
    monkeypatch.setattr(reference_mod, "device_empty", forbidden)


GOOD = dict(t_len=7, n_heads=4, n_kv=2, head_dim=8)


def good_inputs():
    return make_qkv(GOOD["t_len"], GOOD["n_heads"], GOOD["n_kv"], GOOD["head_dim"])


@pytest.mark.parametrize("mutate, error, words", [
    (lambda q, k, v: (q[0], k, v, 4, 2), checks.ShapeError, ["q", "[T"]),
    (lambda q, k, v: (np.ascontiguousarray(q[:, :-1]), k, v, 4, 2), checks.ShapeError,
     ["q", "H=4"]),
    (lambda q, k, v: (q, np.ascontiguousarray(k[:, :-1]), v, 4, 2), checks.ShapeError,
     ["k", "H_kv*D=2*8=16", "T=7", "H=4", "H_kv=2", "D=8"]),
    (lambda q, k, v: (q, k, v[:-1], 4, 2), checks.ShapeError, ["v", "T=7", "H_kv=2"]),
    (lambda q, k, v: (q.astype(np.float64), k, v, 4, 2), checks.DTypeError, ["q", "float32"]),
    (lambda q, k, v: (q, k, v.astype(np.float16), 4, 2), checks.DTypeError, ["v", "float32"]),
    (lambda q, k, v: (q, k, v, 4, 3), checks.RangeError, ["H_kv=3", "4"]),
    (lambda q, k, v: (q, k, v, 0, None), checks.RangeError, ["H=0"]),
    (lambda q, k, v: (q, k, v, 4.0, 2), checks.DTypeError, ["n_heads"]),
    (lambda q, k, v: (np.asfortranarray(q), k, v, 4, 2), checks.LayoutError, ["q"]),
    (lambda q, k, v: (np.zeros((7, 257), np.float32), np.zeros((7, 257), np.float32),
                      np.zeros((7, 257), np.float32), 1, 1), checks.RangeError,
     ["head_dim", "257"]),
])
@pytest.mark.parametrize("method", METHODS)
def test_bad_input_raises_before_any_copy(no_device, method, mutate, error, words):
    q, k, v = good_inputs()
    args = mutate(q, k, v)
    with pytest.raises(error) as info:
        attend(method, *args[:4], n_kv_heads=args[4])
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(scale=-1.0), checks.RangeError, "scale"),
    (dict(scale=float("nan")), checks.RangeError, "scale"),
    (dict(method="flash"), checks.RangeError, "method"),
    (dict(defect="nope"), ValueError, "defect"),
])
@pytest.mark.parametrize("entry", [prefill_attention, prefill_attention_reference],
                         ids=["product", "reference"])
def test_bad_options_raise_before_any_copy(no_device, entry, kwargs, error, word):
    q, k, v = good_inputs()
    with pytest.raises(error, match=word):
        entry(q, k, v, 4, n_kv_heads=2, **kwargs)


@pytest.mark.parametrize("method", ["batched", "per_head"])
def test_product_entry_points_to_the_reference_paths(no_device, method):
    """The product entry point runs only the fused kernel; a reference method
    name is refused with the entry point that runs it, before any copy."""
    q, k, v = good_inputs()
    with pytest.raises(checks.RangeError) as info:
        prefill_attention(q, k, v, 4, n_kv_heads=2, method=method)
    assert "attention.reference.prefill_paths.prefill_attention_reference" in str(info.value)
    assert repr(method) in str(info.value)
    with pytest.raises(checks.RangeError, match="prefill_attention"):
        prefill_attention_reference(q, k, v, 4, n_kv_heads=2, method="fused")


def test_reference_paths_carry_the_product_defects():
    """The planted defects are the same two on every path, so the suite asks
    each path for each one."""
    from attention.reference.prefill_softmax import SOFTMAX_DEFECTS

    assert reference_mod.DEFECTS == PREFILL_DEFECTS == SOFTMAX_DEFECTS
    assert set(METHODS) == {"fused", "batched", "per_head"}
    # "tf32" (attention.prefill.tf32) carries its own switches and suite
    # (validation/suite_prefill_tf32.py), not these two
    assert prefill_mod.METHODS == ("fused", "tf32")


@pytest.mark.parametrize("method", METHODS)
def test_empty_sequence_gives_empty_result(no_device, method):
    q = np.zeros((0, 4 * 8), np.float32)
    kv = np.zeros((0, 2 * 8), np.float32)
    out, lse = attend(method, q, kv, kv, 4, n_kv_heads=2, return_lse=True)
    assert out.shape == (0, 32) and out.dtype == np.float32
    assert lse.shape == (4, 0) and lse.dtype == np.float32


def test_fused_tiles_fit_shared_memory():
    """Every head size 1..256 gets a configuration within the static limit."""
    for head_dim in range(1, 257):
        bk, rw, k_stride = fused_config(head_dim)
        bq = FUSED_WARPS * rw
        shared = 4 * (bq * head_dim + bk * k_stride + bk * head_dim + bq * bk)
        assert shared <= SHARED_BUDGET, head_dim
        assert rw >= 1 and bk in (16, 32), head_dim
        assert k_stride % 2 == 1 and k_stride >= head_dim, head_dim  # odd: no bank conflicts
    assert fused_config(128)[:2] == (32, 4) and fused_config(64)[:2] == (32, 8)


def test_tolerance_rejects_a_small_perturbation():
    """Positive control: the comparison fails for an output off by 10x the budget."""
    q, k, v = make_qkv(33, 2, 1, 16)
    ref, _ = prefill_attention_ref(q, k, v, 2, 1)
    base, _ = prefill_attention_ref(q, k, v, 2, 1, dtype=np.float32)
    tol = tolerance.budget(ref, base)
    assert compare("base", base, ref, base).passed
    off = base.copy()
    off[5, 3] += np.float32(10 * tol)
    assert not compare("off", off, ref, base).passed
    # a NaN anywhere fails too
    off = base.copy()
    off[0, 0] = np.nan
    assert not compare("nan", off, ref, base).passed


def test_debug_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("ATTN_PREFILL_DEBUG", raising=False)
    assert not prefill_mod.debug_enabled()
    monkeypatch.setenv("ATTN_PREFILL_DEBUG", "1")
    assert prefill_mod.debug_enabled()
    monkeypatch.setenv("ATTN_PREFILL_DEBUG", "0")
    assert not prefill_mod.debug_enabled()


# ---------------------------------------------------------------------------
# compile-only (no GPU): every prefill kernel compiles for sm_90
# ---------------------------------------------------------------------------

def _ptx(pyfunc, sig):
    from numba import cuda

    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=(9, 0))
    return ptx


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_kernel_compiles(head_dim, causal):
    from numba import float32

    a2 = float32[:, ::1]
    ptx = _ptx(prefill_mod.fused_kernel(head_dim, causal).py_func,
               (a2, a2, a2, float32, a2, a2))
    assert "shfl.sync.bfly" in ptx  # warp_max / warp_sum
    assert "bar.sync" in ptx  # K/V tile staging
    # the per-row state and accumulators live in registers, not local memory
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.compile
@pytest.mark.parametrize("defect", [None, *PREFILL_DEFECTS])
def test_softmax_kernel_compiles_with_shuffles(defect):
    from numba import float32, int32

    from attention.reference.prefill_softmax import softmax_kernel

    ptx = _ptx(softmax_kernel(defect).py_func, (float32[:, :, ::1], int32, float32[:, ::1]))
    assert "shfl.sync" in ptx
    assert ptx.count("shfl.sync.bfly") == 10  # warp_max and warp_sum, 5 steps each


@pytest.mark.compile
def test_layout_and_gemm_kernels_compile():
    from numba import float32, int32

    from attention.reference import prefill_layout as layout
    from attention.reference import tiled_gemm as gemm

    a2, a3 = float32[:, ::1], float32[:, :, ::1]
    assert "ld.global" in _ptx(layout._gather_heads, (a2, int32, a3))
    assert "st.global" in _ptx(layout._scatter_heads, (a3, int32, a2))
    assert "bar.sync" in _ptx(layout._batched_transpose, (a3, a3))
    gemm_ptx = _ptx(gemm._batched_gemm, (a3, a3, a3))
    assert "bar.sync" in gemm_ptx and "fma.rn.f32" in gemm_ptx
    assert "ld.local" not in gemm_ptx  # the 4 x 4 micro-tile stays in registers
    assert "mul" in _ptx(gemm._batched_scale, (a3, float32))


# ---------------------------------------------------------------------------
# executing kernels (simulator at small shapes, GPU at full shapes)
# ---------------------------------------------------------------------------

# 13 rows (not a warp or tile multiple), GQA 2:1, D 24 (< 32: idle lanes)
SIM_SHAPE = (13, 4, 2, 24)
GPU_SHAPE = (97, 32, 8, 128)


@pytest.mark.device
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_matches_oracle(method, causal):
    assert_matches_oracle(method, *(SIM_SHAPE if small() else GPU_SHAPE), causal)


@pytest.mark.device
@pytest.mark.parametrize("causal", [False, True])
def test_fused_crosses_tile_edges(causal):
    """T 37 > 32 keys per tile and > 32 rows per block (D 40: RW 8), D 40 not
    a multiple of 32: two query blocks, two K/V tiles, a partial last tile."""
    assert_matches_oracle("fused", 37, 2, 1, 40, causal, seed=3)


@pytest.mark.device
@pytest.mark.parametrize("method", METHODS)
def test_single_token(method):
    """T == 1: the output is the value row, LSE the one scaled score."""
    assert_matches_oracle(method, 1, 2, 1, 8, True, seed=4)


@pytest.mark.device
def test_batched_gemm_crosses_tiles_and_shares_b():
    """M 67 > 64 (two row tiles), K 20 > 16 (a partial K slice), B_a 2 on B_b 1."""
    from attention.core.device import to_device, to_host
    from attention.reference.tiled_gemm import batched_gemm

    rng = np.random.default_rng(5)
    a = rng.standard_normal((2, 67, 20)).astype(np.float32)
    b = rng.standard_normal((1, 20, 9)).astype(np.float32)
    c = to_device(np.full((2, 67, 9), np.nan, np.float32))
    batched_gemm(to_device(a), to_device(b), c, 0)
    got = to_host(c)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    # derived budget: 2x the error of float32 numpy (BLAS) plus a few ulps
    tolerance.assert_matches(got, ref, a @ b, what="batched_gemm")


@pytest.mark.device
def test_layout_kernels_are_exact():
    """gather / scatter of heads and the tiled transpose copy bit-exactly,
    across a partial 32 x 32 tile (33 x 35), and touch nothing else."""
    from attention.core.device import to_device, to_host
    from attention.reference.prefill_layout import batched_transpose, gather_heads, scatter_heads

    rng = np.random.default_rng(6)
    t_len, n_heads, head_dim = 33, 3, 35
    x = rng.standard_normal((t_len, n_heads * head_dim)).astype(np.float32)
    heads = to_device(np.zeros((2, t_len, head_dim), np.float32))
    gather_heads(to_device(x), 1, heads, 0)
    want = x.reshape(t_len, n_heads, head_dim).transpose(1, 0, 2)[1:3]
    assert np.array_equal(to_host(heads), want)

    back = to_device(np.full((t_len, n_heads * head_dim), np.nan, np.float32))
    scatter_heads(heads, 1, back, 0)
    got = to_host(back)
    assert np.array_equal(got[:, head_dim:], x[:, head_dim:])
    assert np.isnan(got[:, :head_dim]).all()  # head 0 was not written

    flipped = to_device(np.zeros((2, head_dim, t_len), np.float32))
    batched_transpose(heads, flipped, 0)
    assert np.array_equal(to_host(flipped), want.transpose(0, 2, 1))


@pytest.mark.device
@pytest.mark.parametrize("method", METHODS)
def test_device_arrays_and_stream(method):
    """Device inputs give device outputs; with a stream the call only enqueues;
    the numbers equal the host-array path's bit for bit."""
    from numba import cuda

    q, k, v = make_qkv(5, 2, 1, 8, seed=7)
    host_out, host_lse = attend(method, q, k, v, 2, n_kv_heads=1, causal=True,
                                return_lse=True)
    stream = cuda.stream()
    d_q, d_k, d_v = (cuda.to_device(x, stream=stream) for x in (q, k, v))
    out, lse = attend(method, d_q, d_k, d_v, 2, n_kv_heads=1, causal=True,
                      stream=stream, return_lse=True)
    assert not isinstance(out, np.ndarray) and not isinstance(lse, np.ndarray)
    stream.synchronize()
    assert np.array_equal(out.copy_to_host(), host_out)
    assert np.array_equal(lse.copy_to_host(), host_lse)
    # T == 0 with device inputs: empty device arrays, nothing launched
    empty = cuda.to_device(np.zeros((0, 16), np.float32))
    kv = cuda.to_device(np.zeros((0, 8), np.float32))
    out, lse = attend(method, empty, kv, kv, 2, n_kv_heads=1, return_lse=True)
    assert not isinstance(out, np.ndarray)
    assert tuple(out.shape) == (0, 16) and tuple(lse.shape) == (2, 0)


@pytest.mark.device
@pytest.mark.parametrize("method", METHODS)
def test_debug_switch_logs_head_zero(method, monkeypatch, caplog):
    q, k, v = make_qkv(5, 2, 1, 8, seed=8)
    monkeypatch.delenv("ATTN_PREFILL_DEBUG", raising=False)
    with caplog.at_level(logging.INFO, logger=LOGGERS[method]):
        quiet = attend(method, q, k, v, 2, n_kv_heads=1, causal=True)
    assert not caplog.records  # positive control: silent without the switch
    monkeypatch.setenv("ATTN_PREFILL_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger=LOGGERS[method]):
        loud = attend(method, q, k, v, 2, n_kv_heads=1, causal=True)
    assert {r.name for r in caplog.records} == {LOGGERS[method]}
    text = "\n".join(r.getMessage() for r in caplog.records)
    for word in ("head 0", "Q mean", "K mean", "V mean", "scores", "row sums", "output"):
        assert word in text, (word, text)
    # the rows of a correct kernel sum to 1 (to float32 rounding)
    worst = float(text.split("max |sum-1|=")[1].split()[0])
    assert worst < 1e-5
    assert np.array_equal(quiet, loud)  # tracing does not change the result


def test_suite_contract():
    assert suite_prefill.FAMILY == "prefill"
    assert set(suite_prefill.DEFECTS) >= {"softmax_not_normalised", "causal_off_by_one"}
    with pytest.raises(ValueError, match="defect"):
        suite_prefill.run_suite("no_such_defect")


@pytest.mark.device
def test_suite_passes_clean_and_catches_every_defect():
    clean = suite_prefill.run_suite(None, small=small())
    failed = [f"{c.name}: {c.detail}" for c in clean if not c.passed]
    assert not failed, failed
    for defect in suite_prefill.DEFECTS:
        found = suite_prefill.run_suite(defect, small=small())
        assert caught(found), defect
        for method in METHODS:  # every method's copy of the defect is caught
            assert any(not c.passed and f"/{method}/" in c.name for c in found), (defect, method)


# ---------------------------------------------------------------------------
# GPU only: the production shapes
# ---------------------------------------------------------------------------

GPU_CASES = [
    (4096, 32, 8, 128),
    (2048, 32, 8, 64),
    (1025, 32, 8, 80),
    (1025, 32, 8, 128),
    (97, 32, 8, 64),
    (1, 32, 8, 128),
]


# A finding, not a tolerance: the reference paths sum P.V in one running FMA sum over
# the T positions (their second GEMM), which the baseline (q.k in their order, P.V in
# BLAS's) does not model; at T 4096, non-causal, kv group 7 their out error is 2.19x the
# baseline's (H100 at 504265b: 4.35e-7, budget 4.28e-7), and a baseline with their P.V
# sum lands on the same entry (notes/validation.md, "the prefill tests' baseline").
# strict: once the baseline models that sum, these pass and the marks must go.
PV_ORDER_FINDING = pytest.mark.xfail(
    strict=True, reason="reference paths' P.V running sum over 4096 positions, not modelled "
                        "by the baseline (notes/validation.md)")


def gpu_params():
    """(method, shape, causal) of the production-shape test, the reference paths'
    non-causal T 4096 cases marked with the finding above."""
    for method in METHODS:
        for shape in GPU_CASES:
            for causal in (False, True):
                marks = (PV_ORDER_FINDING,) if (method != "fused" and shape[0] == 4096
                                                and not causal) else ()
                yield pytest.param(method, shape, causal, marks=marks,
                                   id="{}-T{}_H{}_Hkv{}_D{}-{}".format(method, *shape, causal))


@pytest.mark.gpu
@pytest.mark.parametrize("method, shape, causal", list(gpu_params()))
def test_gpu_production_shapes(method, shape, causal):
    assert MODE == "gpu"
    assert_matches_oracle(method, *shape, causal, seed=9)


def test_each_method_is_held_to_its_registry_order():
    """The tests' baseline is the registry's for the same kernel (one criterion), and
    the order matters: at T 1 the LSE is the one score, and its float32 error in
    the fused kernel's order differs from BLAS's (the oracle run in float32)."""
    from validation.registry import KERNELS_BY_NAME

    for method in METHODS:
        assert suite_prefill.baseline_label(method) == KERNELS_BY_NAME[f"prefill_{method}"].baseline
    with pytest.raises(ValueError, match="method"):
        suite_prefill.baseline_label("no_such_method")
    q, k, v = make_qkv(1, 32, 8, 128, seed=9)
    ref = prefill_attention_ref(q, k, v, 32, 8)
    blas = prefill_attention_ref(q, k, v, 32, 8, dtype=np.float32)
    ordered = prefill_order(q, k, v, 32, 8, False, suite_prefill.baseline_label("fused"))
    assert tolerance.max_abs_error(ordered[1], ref[1]) != tolerance.max_abs_error(blas[1], ref[1])
