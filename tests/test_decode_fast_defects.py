"""Planted defects and precision mutants of the fast decode (attention.decode.fast).

Compile-only (plain process): the production kernels carry none of the
mutants' roundings (no fp32 -> fp16 conversion, no ``chop_exp`` mask) while a
mutant does (positive control); every switch compiles, names its kernel, and
changes the PTX of exactly the kernel forms where its concept exists.

Simulator: the falsification suite ``validation.suite_decode_fast`` passes
clean and catches every gross defect; a precision mutant (P rounded to fp16 at
an fp16 cache, scores ~ O(1)) moves the output past the budget that the
production kernel meets; and the GPU's production plans (4 warps, rows over 16
lanes in 16-byte pieces through a ring of 4 stages with one score a lane for
fp16; 32 lanes, 4-element loads and 8 positions a step for fp32; both split
so the combine runs) run against the oracle. The simulator's own default plan
takes 3 ring stages at D 128 (it stores a float32 an element, so a stage is
twice the GPU's bytes and ``RING_LIMIT`` fits 3): the production test names
its stages, and its kernel names are the GPU plan's (checked compile-only).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from attention.decode import fast as F
from attention.oracle import decode_attention_ref
from validation import tolerance

# ---- switches: names, validation, applicability (no kernel runs) ------------


def test_defect_tuples():
    assert F.DEFECTS == F.GROSS_DEFECTS + F.PRECISION_MUTANTS
    assert len(set(F.DEFECTS)) == len(F.DEFECTS)
    assert F.GROSS_DEFECTS == ("gqa_mod", "slot_off_by_one", "one_short",
                               "combine_drops_split")


def test_unknown_defect_is_a_named_error():
    """Every entry point refuses an unknown switch with a ValueError naming
    ``defect`` and listing the allowed names, before anything is built."""
    q = np.zeros((2, 4, 32), np.float32)
    k = np.zeros((2, 2, 8, 32), np.float32)
    lens = np.array([3, 4], np.int32)
    calls = [
        lambda: F.fast_decode_kernel("f32", 1, 1, 2, 2, defect="p_fp8"),
        lambda: F.combine_kernel(4, defect="p_fp8"),
        lambda: F.plan(2, 4, 2, 32, 8, "f32", defect="p_fp8"),
        lambda: F.batched_decode_attention_fast(q, k, k, lens, defect="p_fp8"),
        lambda: F.applies("p_fp8", "f32", 1, 0),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"defect: expected None or one of .*gqa_mod.*"
                                             r"ring_stale.*got 'p_fp8'"):
            call()


def test_applies():
    """A switch applies where its concept exists in the plan."""
    for d in F.DEFECTS:
        assert F.applies(d, "f16", 4, 4), d  # a split plan with a ring has every concept
    assert not F.applies(None, "f16", 4, 4)
    for d in F.COMBINE_DEFECTS + ("split_off_by_one",):
        assert not F.applies(d, "f16", 1, 4) and F.applies(d, "f32", 2, 0)
    assert not F.applies("ring_stale", "f32", 4, 0)
    assert not F.applies("ring_stale", "f16", 4, 0)  # register buffers, no ring
    assert F.applies("ring_stale", "bf16", 1, 3)
    for d in ("lse_fp16", "p_fp16", "exp_approx", "gqa_mod", "one_short"):
        assert F.applies(d, "f32", 1, 0)


def test_plan_keeps_the_defect():
    """The plan keeps its switch for the combine it launches; a kernel the switch
    does not act in is the production kernel itself (one compile, not a copy a
    switch): the main kernel under a combine-only switch, the combine under a
    main-kernel-only switch. Control: a switch that acts in both is in both."""
    pl = F.plan(2, 8, 2, 64, 100, "f16", n_split=2, defect="combine_drops_split")
    clean = F.plan(2, 8, 2, 64, 100, "f16", n_split=2)
    assert pl["defect"] == "combine_drops_split" and clean["defect"] is None
    assert pl["kernel"] is clean["kernel"]
    assert not pl["kernel"].py_func.__name__.endswith("_combine_drops_split")
    assert F.combine_switch("combine_drops_split") == "combine_drops_split"
    for d in ("p_fp16", "q_bf16", "split_off_by_one", "ring_stale", "gqa_mod", None):
        assert F.combine_switch(d) is None, d
    both = F.plan(2, 8, 2, 64, 100, "f16", n_split=2, defect="exp_approx")
    assert both["kernel"].py_func.__name__.endswith("_exp_approx")
    assert F.combine_switch("exp_approx") == "exp_approx"
    assert F.combine_kernel(2, False, "lse_fp16").py_func.__name__ == \
        "decode_fast_combine_c2_lse_fp16"
    assert F.combine_kernel(2, False, "lse_fp16") is F.combine_kernel(2, False, "lse_fp16")


# ---- compile-only ----------------------------------------------------------------

def _main_sig(kind):
    from numba import cuda, types

    elem = {"f32": types.float32, "f16": types.float16, "bf16": cuda.types.bfloat16}[kind]
    cache = types.Array(elem, 4, "C")
    f32 = types.float32
    return (types.Array(f32, 3, "C"), cache, cache, types.int32[::1], types.int32[::1], f32,
            types.int32, types.Array(f32, 3, "C"), types.Array(f32, 2, "C"),
            types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.int32[::1])


def _combine_sig():
    from numba import types

    f32 = types.float32
    return (types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.Array(f32, 3, "C"),
            types.Array(f32, 2, "C"))


# kernel forms: (name, plan arguments, plan keywords, form); every concept of
# the module lives in at least one of them
FORMS = (
    # fp16 D 128 GQA 4: pipelined, one score a lane, rows by the cp.async ring
    ("ring", (2, 8, 2, 128, 1024, "f16"), {"stages": 4}),
    # fp16 D 128 GQA 2: pipelined, a butterfly a score, two register buffers
    ("buffers", (2, 4, 2, 128, 1024, "f16"), {"stages": 0}),
    # fp32 D 40: the one-buffer loop with scalar, predicated rows and q
    ("scalar", (2, 6, 2, 40, 1024, "f32"), {}),
)
RING_FORMS = ("ring",)
COMBINE_ACTING = ("combine_drops_split", "combine_no_max", "exp_approx", "lse_fp16")
MAIN_SILENT = ("combine_drops_split", "combine_no_max")  # combine-only switches


_PTX = {}


def _ptx(form, defect):
    """PTX (sm_90) of a kernel form (``FORMS``, or "combine") with ``defect``,
    with the kernel's mangled name replaced by ``KERNEL`` (it carries the
    switch's name) and its shared arrays numbered from 0 in order of
    appearance (numba numbers them process-wide)."""
    from numba import cuda

    key = (form, defect)
    if key not in _PTX:
        if form == "combine":
            kern, sig = F.combine_kernel(4, False, defect), _combine_sig()
        else:
            _, args, kw = next(f for f in FORMS if f[0] == form)
            kern, sig = F.plan(*args, **kw, defect=defect)["kernel"], _main_sig(args[5])
        ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), fastmath=True)
        for sym in sorted(set(re.findall(r"_ZN\w*decode_fast\w+?(?=_param_\d|\(|;|\s)", ptx)),
                          key=len, reverse=True):
            ptx = ptx.replace(sym, "KERNEL")
        smem = {}
        ptx = re.sub(r"_cudapy_smem_\d+",
                     lambda m: smem.setdefault(m.group(0), f"SMEM{len(smem)}"), ptx)
        _PTX[key] = ptx
    return _PTX[key]


FP16_ROUNDING = re.compile(r"cvt\.rn(\.ftz)?\.f16\.f32")


def _chop_mask():
    from attention.core.rounding import CHOP_BITS

    return re.compile(rf"and\.b32\s+%r\d+,\s*%r\d+,\s*{-(1 << CHOP_BITS)};")


@pytest.mark.compile
@pytest.mark.parametrize("form", [f[0] for f in FORMS] + ["combine"])
def test_production_ptx_has_no_mutant_rounding(form):
    """Without a switch no kernel form rounds to fp16 or chops an exponential;
    with ``p_fp16`` / ``exp_approx`` every form does (the patterns can match)."""
    chop = _chop_mask()
    ptx = _ptx(form, None)
    assert not FP16_ROUNDING.search(ptx), f"{form}: fp32 -> fp16 rounding"
    assert not chop.search(ptx), f"{form}: the chop_exp mask"
    if form != "combine":
        assert FP16_ROUNDING.search(_ptx(form, "p_fp16")), f"{form}: p_fp16 not rounded"
    assert chop.search(_ptx(form, "exp_approx")), f"{form}: exp_approx not chopped"


@pytest.mark.compile
@pytest.mark.parametrize("defect", F.DEFECTS)
def test_each_switch_compiles_where_it_acts(defect):
    """Each switch compiles in every kernel form and the combine, and changes
    the PTX (kernel name aside) exactly where its concept exists: the combine
    for its own switches, ``exp_approx`` and ``lse_fp16``; the ring form only
    for ``ring_stale``; every main form for the rest."""
    for form in [f[0] for f in FORMS] + ["combine"]:
        if form == "combine":
            acts = defect in COMBINE_ACTING
        elif defect == "ring_stale":
            acts = form in RING_FORMS
        else:
            acts = defect not in MAIN_SILENT
        changed = _ptx(form, defect) != _ptx(form, None)
        assert changed == acts, f"{defect} in the {form} form: PTX changed {changed}"


@pytest.mark.compile
def test_gpu_production_plan_names():
    """Compiled as on the GPU (no simulator), the default plans of the
    production shapes are the kernels ``test_gpu_production_plan_on_simulator``
    runs by name: fp16 D 128 GQA 4 with a ring of 4 stages, one score a lane;
    fp32 D 128 at 8 positions a step once a chunk is long. (Both without
    programmatic dependent launch, which the simulator cannot run; it adds
    ``griddepcontrol`` instructions only.)"""
    for (kind, max_len, n_split), name in PRODUCTION_NAMES.items():
        pl = F.plan(2, 8, 2, 128, max_len, kind, n_split=n_split, pdl=False)
        assert pl["kernel"].py_func.__name__ == name
        assert pl["block"] == F.WARPS * F.WARP == 128


# ---- simulator / GPU: the suite and a precision mutant ------------------------------

@pytest.mark.device
def test_suite_clean_passes():
    from validation import suite_decode_fast as S

    assert any((case.n_split or 1) > 1 for case in S.cases_for(True)), "no combine runs"
    checks = S.run_suite(None, small=True)
    assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]


@pytest.mark.device
@pytest.mark.parametrize("defect", F.GROSS_DEFECTS)
def test_suite_catches_gross_defect(defect):
    from validation import suite_decode_fast as S
    from validation.suite import caught

    checks = S.run_suite(defect, small=True)
    assert caught(checks), f"{defect} escaped: " + "; ".join(
        f"{c.name}: {c.detail}" for c in checks)


def _normal_case(seed, m, h, kv, d, max_seq, dtype, lens):
    """Standard-normal q, K, V (scores ~ O(1), every position weighs), a
    shuffled slot table with a spare slot."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((m, h, d)).astype(np.float32)
    k = rng.standard_normal((m + 1, kv, max_seq, d)).astype(dtype)
    v = rng.standard_normal((m + 1, kv, max_seq, d)).astype(dtype)
    slots = rng.permutation(m + 1)[:m].astype(np.int32)
    return q, k, v, np.asarray(lens, np.int32), slots


@pytest.mark.device
def test_precision_mutant_moves_the_output():
    """Positive control for the precision mutants: ``p_fp16`` at an fp16
    cache (vector rows, one score a lane, the ring) with scores ~ O(1) moves
    the output past the budget the production kernel meets, and leaves the
    LSE alone (l sums the unrounded weights)."""
    q, k, v, lens, slots = _normal_case(41, 2, 8, 2, 64, 48, np.float16, [48, 29])
    ref, ref_lse = decode_attention_ref(q, k, v, lens, slots)
    base, _ = decode_attention_ref(q, k, v, lens, slots, dtype=np.float32)
    allowed = tolerance.budget(ref, base)
    clean, clean_lse = F.batched_decode_attention_fast(q, k, v, lens, slots, return_lse=True)
    mutant, mutant_lse = F.batched_decode_attention_fast(q, k, v, lens, slots,
                                                         return_lse=True, defect="p_fp16")
    assert tolerance.max_abs_error(clean, ref) <= allowed
    err = tolerance.max_abs_error(mutant, ref)
    assert err > 10 * allowed, f"p_fp16: error {err:.3e}, budget {allowed:.3e}"
    assert np.array_equal(mutant_lse, clean_lse)


# ---- simulator / GPU: the GPU's production plans ---------------------------------

# (kind, max_len, n_split) -> the kernel a GPU plans (compile-only test above)
PRODUCTION_NAMES = {
    ("f16", 160, 2): "decode_fast_f16_v8c1g4of4w4u4l16psa4",
    ("f32", 769, 2): "decode_fast_f32_v4c1g4of4w4u8",
}


@pytest.mark.device
@pytest.mark.parametrize("kind,lens", [("f16", [160, 97]), ("f32", [769, 40])])
def test_gpu_production_plan_on_simulator(kind, lens):
    """The GPU's production plan at D 128, GQA 4 (H 8, H_kv 2), 2 splits (the
    combine runs), on two sequences, against the oracle. fp16: 4 warps, rows
    over 16 lanes in 16-byte pieces (8 elements), 4 positions a lane group and
    step, one score a lane, rows through a cp.async ring of ``ASYNC_STAGES``
    (named: the simulator's default plan takes 3). fp32: 32 lanes a row,
    4-element loads, 8 positions a step (a chunk of 416 >= ``LONG_CHUNK``).
    Hostile caches as in ``tests.test_decode_fast`` (NaN past the lengths and
    in the spare slots)."""
    from numba import cuda

    from tests.test_decode_fast import make_case

    start = time.perf_counter()
    dtype = {"f16": np.float16, "f32": np.float32}[kind]
    m, h, kv, d = 2, 8, 2, 128
    max_len, n_split = max(lens), 2
    q, k, v, lens, slots = make_case(51, m, h, kv, d, max_len, dtype, lens=lens)
    stages = F.ASYNC_STAGES if kind == "f16" else None
    pl = F.plan(m, h, kv, d, max_len, kind, n_split=n_split, stages=stages, pdl=False)
    assert pl["kernel"].py_func.__name__ == PRODUCTION_NAMES[(kind, max_len, n_split)]
    want = ({"lanes": 16, "vec": 8, "unroll": 4, "stages": 4, "pipeline": True}
            if kind == "f16" else {"lanes": 32, "vec": 4, "unroll": 8, "stages": 0,
                                   "pipeline": False})
    assert {key: pl[key] for key in want} == want
    assert pl["block"] == 128 and pl["heads_per_block"] == 4 and pl["n_split"] == 2
    assert (pl["n_split"] - 1) * pl["chunk"] < max_len  # the last split holds positions
    out = cuda.device_array((m, h, d), np.float32)
    lse = cuda.device_array((m, h), np.float32)
    part_acc, part_ml = F.scratch(m, h, d, pl["n_split"])
    F.launch(pl, cuda.to_device(q), cuda.to_device(k), cuda.to_device(v),
             cuda.to_device(lens), cuda.to_device(slots), 1.0 / np.sqrt(d), out, lse,
             part_acc, part_ml, 0)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    ref, ref_lse = decode_attention_ref(q, k, v, lens, slots)
    base, base_lse = decode_attention_ref(q, k, v, lens, slots, dtype=np.float32)
    for what, got, r, b in (("out", out, ref, base), ("lse", lse, ref_lse, base_lse)):
        assert tolerance.same_nonfinite(got, r), what
        err, allowed = tolerance.max_abs_error(got, r), tolerance.budget(r, b)
        assert err <= allowed, f"{what}: max abs error {err:.3e} > budget {allowed:.3e}"
    print(f"{kind} production plan: {time.perf_counter() - start:.1f} s")
