"""The 16-bit tensor-core kernels in the validation registry (family "mma").

``decode_mma``, ``decode_mma_paged16``, ``decode_mma_paged1_nhd``,
``decode_mma_t4`` (``attention.decode.mma.mma_decode``) and ``prefill_mma``
(``attention.prefill.mma.prefill_attention_mma``) are judged by the sweep's
rule against the rounded-P baseline (``validation.baselines``: "mma16_p16", S
summed as the mma model sums it, P rounded to the case's 16-bit type before
P.V; the prefill's weights in FlashAttention-2's form, "ex2fma"). Checked here:

* plain process: the entries resolve, their baseline labels resolve per dtype
  and give exactly ``decode_rounded_p`` / ``prefill_rounded_p`` on a sweep
  case; the prefill's FlashAttention-2 weights (EXP "ex2fma") carry the
  argument rounding at large scores; cases the kernels cannot take (float32,
  head dim 40, GQA group x T_q over 16 rows) are "unsupported" with the
  reason, raised before any launch, and the prefill's head dim is q's row over
  H; the tensor-core shapes are run by the "mma" family only; the "mma" suite
  is discovered and plants both kernels' switches; the multi-token entry's
  later tokens are finite;
* simulator (``device``): one small case of each entry passes through
  ``sweep.run_case`` (one warp a block, the tests' plans, to stay fast on the
  simulator); a planted defect of each kernel fails the same case (positive
  controls); the suite's clean run passes and a planted defect is caught.

The MLA tensor-core entry ``mla_mma`` (``mla_decode(method="mma")``, kind
"mla", the same label "mma16_p16/after" resolved to ``baselines.mla_rounded_p``):
plain process: it resolves with its label and its baseline is
``mla_rounded_p`` on a sweep case; float32 caches, latent widths that are not
multiples of 64 and t_q > 16 are unsupported with the reason; its quick shape
is the "mma" family's only. Simulator: the quick case passes through
``sweep.run_case``, ``ldmatrix_no_trans`` fails it, and the suite catches each
of the three ``mla_*`` switches.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from validation import baselines, defects, fixtures, registry

MMA_ENTRIES = ("decode_mma", "decode_mma_paged16", "decode_mma_paged1_nhd", "decode_mma_t4",
               "prefill_mma")
DECODE_SHAPE, PREFILL_SHAPE = "mma_gqa4_d64", "mma_gqa2_d64_t20_causal"


def _case(kernel, shape, dtype="float16", small=True, fixture="normal"):
    return registry.Case(kernel, shape, fixture, 0, dtype, small)


def _cast_all(kind, shape, dtype="float16"):
    """A small sweep case's inputs with every floating input in ``dtype`` (what
    the sweep gives the tensor-core kernels)."""
    x = registry.make_inputs(kind, registry.find_shape(kind, shape, True), "normal", 0)
    return {n: fixtures.cast(a, dtype) if isinstance(a, np.ndarray)
            and np.issubdtype(a.dtype, np.floating) else a for n, a in x.items()}


# ---------------------------------------------------------------------------
# plain process: no kernel runs
# ---------------------------------------------------------------------------

def test_entries_resolve_with_rounded_p_baselines():
    for name in MMA_ENTRIES:
        spec = registry.KERNELS_BY_NAME[name]
        status, fn = registry.resolve(spec)
        assert status == "ok", (name, fn)
        assert spec.family == "mma"
        want = "mma16_p16/after" + ("/divide/ex2fma" if spec.kind == "prefill"
                                    else "/recip_after")
        assert spec.baseline == want
        # the pooled 16-bit entry carries the P-in-bf16 precision mutant
        assert registry.mutants_of(name) == (("p_bf16",) if name == "decode_mma" else ())


@pytest.mark.parametrize("name,page", [("mla_mma_paged64", 64), ("mla_fp8_tok_paged3", 3)])
def test_paged_mla_entries_hand_the_kernel_shuffled_hostile_pages(name, page):
    """The paged MLA entries' wrapper (no kernel: ``mla_decode`` replaced by a
    recorder) lays the case's rows out in pages that are not in order, with NaN
    (fp8: 0xFF bytes) in every unused row and a huge unused table entry, and
    gathering the rows back through the table gives the contiguous cache the
    contiguous entry hands over (per token: the scales too)."""
    spec = registry.KERNELS_BY_NAME[name]
    base = registry.KERNELS_BY_NAME[name.rsplit("_paged", 1)[0]]
    kind_shape = registry.find_shape("mla", "mma_dsv3_nh16_q1_kv1025", False)
    x = registry.make_inputs("mla", kind_shape, "normal", 0)
    x = {n: fixtures.cast(a, np.float16) if n in spec.storage else a for n, a in x.items()}
    if spec.quantize:
        x = fixtures.mla_fp8_quantize(x, spec.quantize)
    seen = {}

    def record(tag):
        def fn(q_nope, q_pe, cache, lengths, w_uk, w_uv, **kw):
            seen[tag] = (np.asarray(cache), np.asarray(lengths), kw)
            return np.zeros(q_nope.shape[:-1] + (w_uv.shape[1],), np.float32)
        return fn

    spec.run(record("paged"), x)
    base.run(record("cont"), x)
    pages, lens, kw = seen["paged"]
    cont, _, kw_cont = seen["cont"]
    table = kw["page_table"]
    n = int(lens[0])
    assert pages.shape[1] == page and n == cont.shape[1] and table.shape[0] == 1
    used = table[0, :-(-n // page)]
    assert len(used) > 16 and not np.array_equal(used, np.sort(used))  # shuffled
    assert table[0, -1] == fixtures.MLA_HUGE_ENTRY
    rows = np.concatenate([pages[p] for p in used])[:n]
    np.testing.assert_array_equal(rows.view(np.uint8), cont[0].view(np.uint8))
    spare = np.setdiff1d(np.arange(pages.shape[0]), used)
    assert len(spare) >= 2
    unused = np.concatenate([pages[spare].reshape(-1, pages.shape[2]),
                             pages[used[-1], n - (len(used) - 1) * page:]])
    assert len(unused) > 2 * page
    if pages.dtype == np.uint8:
        assert (unused == 0xFF).all()
    else:
        assert np.isnan(unused).all()
    if spec.quantize == "token":
        sc = kw["latent_scale"]
        assert sc.shape == pages.shape[:2]
        np.testing.assert_array_equal(np.concatenate([sc[p] for p in used])[:n],
                                      kw_cont["latent_scale"][0])
        assert np.isnan(sc[spare]).all()


def test_fp8_decode_entries_carry_their_precision_mutants():
    """Per tensor: P in bf16 only; per (token, kv head): also the unnormalised P vs."""
    assert registry.mutants_of("decode_mma_fp8") == ("p_bf16",)
    assert registry.mutants_of("decode_mma_fp8_tok") == ("p_bf16", "fp8_p_unnormalized")


def test_rounded_p_labels_resolve_per_dtype_and_reject_other_orders():
    x = _cast_all("decode", DECODE_SHAPE)
    assert baselines.resolve("mma16_p16/after", x, np.float16) == "mma16_pf16/after"
    assert baselines.resolve("matmul_p16/after", x, np.float16) == "matmul_pf16/after"
    assert baselines.resolve("mma16_p16/after", x,
                             fixtures.resolve_dtype("bfloat16")) == "mma16_pbf16/after"
    assert baselines.resolve("mma16_pf16/after", x, np.float32) == "mma16_pf16/after"
    # a float32 case (unsupported by the kernels): P kept in float32
    assert baselines.resolve("mma16_p16/after", x, np.float32) == "mma16_pf32/after"
    with pytest.raises(ValueError, match="rounded to the case's dtype"):
        baselines.resolve("mma16_p16/after", x, np.float64)
    assert baselines.resolve("mma16_p16/after/recip_after", x,
                             np.float16) == "mma16_pf16/after/recip_after"
    for bad in ("matmul_p16/before", "mma16_pf16/after/recip_first", "mma16_pf8/after",
                "mma16_pf16/after/recip_after/ex2fma"):
        with pytest.raises(ValueError):
            baselines.parse(bad)
    # the reciprocal epilogue is the tensor-core decode's; the prefill's label divides
    with pytest.raises(ValueError, match="is a decode order"):
        baselines.baseline("prefill", _cast_all("prefill", PREFILL_SHAPE),
                           "mma16_pf16/after/recip_after")
    with pytest.raises(ValueError, match="has no prefill form"):
        baselines.baseline("prefill", _cast_all("prefill", PREFILL_SHAPE), "matmul_pf16/after")


def test_rounded_p_baselines_are_the_tensor_core_functions():
    """The registry's labels give exactly ``decode_rounded_p`` (rows gathered by
    slot, T = 1; S summed as the mma model, or by numpy for ``matmul_pT``) and
    ``prefill_rounded_p`` on a sweep case's 16-bit inputs."""
    x = _cast_all("decode", DECODE_SHAPE)
    slots = x["slot_table"]
    scale = 1.0 / np.sqrt(x["q"].shape[-1])
    outs = {}
    for label, sums, norm in (("mma16_pf16/after", "mma16", "divide"),
                              ("matmul_pf16/after", "matmul", "divide"),
                              ("mma16_pf16/after/recip_after", "mma16", "recip_after")):
        got = baselines.baseline("decode", x, label)
        out, lse = baselines.decode_rounded_p(x["q"][:, None], x["k_cache"][slots],
                                              x["v_cache"][slots], x["seq_lens"], scale,
                                              np.float16, sums, norm=norm)
        np.testing.assert_array_equal(got["out"], out[:, 0])
        np.testing.assert_array_equal(got["lse"], lse[:, 0])
        assert np.isneginf(got["lse"][1]).all() and not np.isnan(got["out"]).any()  # length 0
        outs[norm if sums == "mma16" else sums] = out
    # the control: the reciprocal epilogue is another rounding, not the division again
    # (apart somewhere, by at most an ulp or two of each output)
    diff = np.abs(outs["recip_after"] - outs["divide"])
    assert 0 < diff.max() <= 2.0 ** -22 * np.abs(outs["divide"]).max()

    x = _cast_all("prefill", PREFILL_SHAPE)
    for label, exp in (("mma16_pf16/after", "exp"), ("mma16_pf16/after/divide/ex2fma", "ex2fma")):
        got = baselines.baseline("prefill", x, label)
        out, lse = baselines.prefill_rounded_p(x["q"], x["k"], x["v"], 2, 1, True,
                                               1.0 / np.sqrt(64), np.float16, exp=exp)
        np.testing.assert_array_equal(got["out"], out)
        np.testing.assert_array_equal(got["lse"], lse)
    assert baselines.resolve("mma16_p16/after/divide/ex2fma", x, np.float16) == \
        "mma16_pf16/after/divide/ex2fma"
    for bad in ("fma/after/divide/ex2fma", "matmul_pf16/after/divide/ex2fma"):
        with pytest.raises(ValueError, match="ex2fma"):
            baselines.parse(bad)


def test_ex2fma_weights_carry_the_argument_rounding_at_large_scores():
    """FlashAttention-2's weights 2^fl(fma(r, c, -fl(m c))) round the argument at the
    size of the scaled scores: at the 'large' fixture (|score| 1e4) the baseline's
    out mean error is ~100x numpy's exp of the differences (what the H200's prefill
    showed, 9.8e-5 at t1025_gqa4_d128_causal; notes/validation.md); at the normal
    fixture the two agree."""
    from validation import tolerance

    errors = {}
    for fixture in ("large", "normal"):
        shape = registry.find_shape("prefill", "d80_t17_causal", True)
        x = registry.make_inputs("prefill", shape, fixture, 0)
        x = {n: fixtures.cast(a, "float16") if isinstance(a, np.ndarray) else a
             for n, a in x.items()}
        ref, _ = registry.references("prefill", x, "float16")
        errors[fixture] = [tolerance.mean_abs_error(baselines.baseline("prefill", x, lab)["out"],
                                                    ref["out"])
                           for lab in ("mma16_pf16/after", "mma16_pf16/after/divide/ex2fma")]
    assert errors["large"][1] > 20 * errors["large"][0]
    assert errors["normal"][1] < 1.2 * errors["normal"][0]


@pytest.mark.parametrize("kernel,shape,dtype,small,reason", [
    ("decode_mma", "gqa9x3_d40", "float16", True, "head dim 40"),
    ("decode_mma_paged16", "d111_t97", "float16", True, "head dim 111"),
    ("decode_mma", DECODE_SHAPE, "float32", True, "16-bit q, K and V only"),
    ("decode_mma_t4", "qwen_gqa6_d128", "float16", False,
     "GQA group x T_q = 24 query rows"),
    ("prefill_mma", "gqa3x1_d40_t5_causal", "float16", True, "head dim 40"),
    ("prefill_mma", PREFILL_SHAPE, "float32", True, "16-bit q, K and V only"),
    ("prefill_mma", "t97_gqa9x3_d40_causal", "float16", False, "head dim 40:"),
])
def test_cases_the_kernels_cannot_take_are_unsupported_with_the_reason(kernel, shape, dtype,
                                                                      small, reason):
    """Raised by the run wrapper before anything is launched, so no kernel runs
    here (the plain process)."""
    from validation import sweep

    rec = sweep.run_case(_case(kernel, shape, dtype, small))
    assert rec["status"] == "unsupported", rec
    assert reason in rec["detail"] and not rec["passed"]


def test_qwen_shape_is_a_case_for_the_one_query_decode():
    """GQA 6 x T_q 1 fits a tile: only the 4-query entry is unsupported there."""
    from attention.decode import mma

    shape = registry.find_shape("decode", "qwen_gqa6_d128", False)
    group = shape.dims["h"] // shape.dims["h_kv"]
    assert group <= mma.TILE_ROWS < group * 4 and shape.dims["d"] in mma.HEAD_DIMS


def test_tensor_core_shapes_are_run_by_their_families_only():
    """The tensor-core shapes run by the mma family's kernels, and the decode one
    also by the fp8 family's (which holds the tensor-core fp8 decode)."""
    cases = registry.cases(registry.KERNELS, small=True, quick=True, seeds=[0],
                           dtypes=["float16"])
    fp8 = {k.name for k in registry.KERNELS if k.family == "decode_fp8"}
    assert "decode_mma_fp8" in fp8
    assert {c.kernel for c in cases if c.shape == PREFILL_SHAPE} <= set(MMA_ENTRIES)
    on_own = {c.kernel for c in cases if c.shape in (DECODE_SHAPE, PREFILL_SHAPE)}
    assert on_own == set(MMA_ENTRIES) | fp8
    mma_shapes = {c.shape for c in cases if c.kernel == "decode_mma"}
    assert {DECODE_SHAPE, "zero_len", "gqa9x3_d40"} <= mma_shapes
    # not among the shapes every kernel of the kind runs (nor the fp8 table's)
    assert DECODE_SHAPE not in {s.name for s in registry.shapes("decode", True)}
    assert registry.find_shape("prefill", PREFILL_SHAPE, True).families == ("mma",)


def test_mma_suite_is_discovered_and_plants_both_kernels_switches():
    from attention.decode import mma as decode_mma
    from attention.prefill import mma as prefill_mma
    from validation import suite_mma

    assert "validation.suite_mma" in defects.discover()
    assert suite_mma.FAMILY == "mma"
    from mla import mma as mla_mma

    assert set(suite_mma.DEFECTS) == ({f"decode_{d}" for d in decode_mma.DEFECTS}
                                      | {f"prefill_{d}" for d in prefill_mma.DEFECTS}
                                      | {f"mla_{d}" for d in mla_mma.DEFECTS})
    units, broken = defects.units(["validation.suite_mma"], small=True)
    assert not broken and len(units) == 1 + len(suite_mma.DEFECTS)


# ---------------------------------------------------------------------------
# simulator (or GPU): real kernels at the small shapes
# ---------------------------------------------------------------------------

SMALL_PLANS = {"decode": {"warps": 1, "stages": 2}, "prefill": {"warps": 1, "block_n": 16}}


def _entry(name, defect=None, monkeypatch=None):
    """The registry entry ``name`` with the small plan (and ``defect``), registered
    under a new name so that ``sweep.run_case`` runs it."""
    base = registry.KERNELS_BY_NAME[name]
    kw = dict(SMALL_PLANS[base.kind], defect=defect)

    def run(fn, x):
        return base.run(fn, x, **kw)

    spec = replace(base, name=f"{name}+{defect or 'small'}", run=run)
    monkeypatch.setitem(registry.KERNELS_BY_NAME, spec.name, spec)
    return spec.name


@pytest.mark.device
@pytest.mark.parametrize("name", MMA_ENTRIES)
def test_small_case_of_each_entry_passes(name, monkeypatch):
    from validation import sweep

    shape = PREFILL_SHAPE if name == "prefill_mma" else DECODE_SHAPE
    rec = sweep.run_case(_case(_entry(name, monkeypatch=monkeypatch), shape))
    assert rec["status"] == "pass", rec["detail"]
    assert rec["cast"] == "all" and rec["baseline"].startswith("mma16_pf16/after")
    assert set(rec["outputs"]) == {"out", "lse"}


@pytest.mark.device
@pytest.mark.parametrize("name,defect,why", [
    ("decode_mma", "ldmatrix_no_trans", "max abs err"),
    ("prefill_mma", "causal_tile_edge", "max abs err"),
])
def test_planted_defect_fails_the_same_case(name, defect, why, monkeypatch):
    from validation import sweep

    shape = PREFILL_SHAPE if name == "prefill_mma" else DECODE_SHAPE
    rec = sweep.run_case(_case(_entry(name, defect, monkeypatch), shape))
    assert rec["status"] == "fail" and why in rec["detail"], rec["detail"]


@pytest.mark.device
def test_suite_clean_run_passes():
    from validation import suite_mma

    checks = suite_mma.run_suite(None)
    assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]


@pytest.mark.device
def test_suite_catches_a_planted_defect():
    from validation import suite_mma
    from validation.suite import caught

    assert caught(suite_mma.run_suite("prefill_causal_tile_edge"))


def test_multi_token_entry_gives_the_later_queries_finite_rows():
    """``decode_mma_t4``: the rows of the later queries' own tokens (between the
    case's length and the raised one) are made finite, everything else is
    left as the case has it (NaN past the raised length stays NaN)."""
    x = _cast_all("decode", DECODE_SHAPE)
    k, v, lens, slots = x["k_cache"], x["v_cache"], x["seq_lens"], x["slot_table"]
    _, raised, pick = fixtures.multi_token_case(x["q"], lens, k.shape[2], 4)
    k2, v2 = registry._own_tokens(k, v, lens, raised, slots)
    for m, (n, n_raised) in enumerate(zip(lens, raised)):
        s = slots[m]
        assert np.array_equal(k2[s, :, :n], k[s, :, :n]) and np.array_equal(
            v2[s, :, :n], v[s, :, :n])
        assert np.isfinite(k2[s, :, n:n_raised]).all() and np.isfinite(v2[s, :, n:n_raised]).all()
        assert np.isnan(k2[s, :, n_raised:]).all() and np.isnan(v2[s, :, n_raised:]).all()
    assert (raised > lens).any() and k2.dtype == k.dtype and np.isnan(k).sum() > np.isnan(k2).sum()


def test_prefill_head_dim_is_the_query_row_over_the_heads():
    """The prefill's head dim is q's row width over H (K's row holds H_kv of them):
    t1_gqa9x3_d80 (K rows of 3 x 80) is a case for the kernel, not 'head dim 240'."""
    from attention.prefill import mma

    shape = registry.find_shape("prefill", "t1_gqa9x3_d80", False)
    x = registry.make_inputs("prefill", shape, "normal", 0)
    x = {n: fixtures.cast(a, "float16") if isinstance(a, np.ndarray) else a for n, a in x.items()}
    registry._mma_inputs(mma, x["q"], x["k"], x["q"].shape[1] // x["n_heads"], None)
    with pytest.raises(registry.unsupported_case(), match="head dim 240"):
        registry._mma_inputs(mma, x["q"], x["k"], x["k"].shape[1], None)


# ---------------------------------------------------------------------------
# the MLA tensor-core entry (mla_mma)
# ---------------------------------------------------------------------------

MLA_SHAPE = "mma_nh2_r64_rope64_q2_kv40"


def _mla_case_fp16(shape=MLA_SHAPE, fixture="normal"):
    """A small MLA sweep case's inputs with the latent rows in float16 (the sweep's
    storage cast)."""
    x = registry.make_inputs("mla", registry.find_shape("mla", shape, True), fixture, 0)
    return dict(x, c_kv=fixtures.cast(x["c_kv"], "float16"),
                k_pe=fixtures.cast(x["k_pe"], "float16"))


def test_mla_entry_resolves_with_its_label():
    spec = registry.KERNELS_BY_NAME["mla_mma"]
    status, fn = registry.resolve(spec)
    assert status == "ok", fn
    assert (spec.family, spec.kind, spec.attr) == ("mma", "mla", "mla_decode")
    assert spec.baseline == "mma16_p16/after" and registry.mutants_of("mla_mma") == ()
    x = _mla_case_fp16()
    label = baselines.resolve(spec.baseline, x, x["c_kv"].dtype)
    assert label == "mma16_pf16/after"
    got = baselines.baseline("mla", x, label)
    want = baselines.mla_rounded_p(*(x[n] for n in registry.MLA_ARGS), x["scale"], np.float16)
    np.testing.assert_array_equal(got["out"], want)
    assert set(got) == {"out"} and want.shape == x["q_nope"].shape[:2] + (x["w_uv"].shape[1],)


def test_mla_rounded_p_rounds_the_query_and_p():
    """Against the float64 oracle, the fp16 roundings cost far more than float32
    arithmetic; kept in float32 (``pf32``) the baseline is the float32 code's size."""
    from validation import tolerance

    x = _mla_case_fp16()
    ref, plain = registry.references("mla", x, "float16")
    e16 = tolerance.max_abs_error(baselines.baseline("mla", x, "mma16_pf16/after")["out"],
                                  ref["out"])
    e32 = tolerance.max_abs_error(baselines.baseline("mla", x, "mma16_pf32/after")["out"],
                                  ref["out"])
    e_plain = tolerance.max_abs_error(plain["out"], ref["out"])
    assert e16 > 30 * e32 and e32 <= 4 * e_plain + 1e-6


@pytest.mark.parametrize("shape,dtype,small,reason", [
    (MLA_SHAPE, "float32", True, "float16 latent cache only"),
    ("s1_q3_kv9", "float16", True, "r + d_rope = 52: expected a multiple of 64"),
    ("s0_q1_kv9", "float16", True, "r + d_rope = 72"),
    ("dsv3_q17_kv17", "float16", False, "t_q = 17"),
])
def test_mla_cases_the_kernel_cannot_take_are_unsupported(shape, dtype, small, reason):
    from validation import sweep

    rec = sweep.run_case(_case("mla_mma", shape, dtype, small))
    assert rec["status"] == "unsupported", rec
    assert reason in rec["detail"] and not rec["passed"]


def test_mla_tensor_core_shape_is_run_by_its_families_only():
    cases = registry.cases(registry.KERNELS, small=True, quick=True, seeds=[0],
                           dtypes=["float16"])
    # the fp8 latent cache's entries (tests/test_mla_fp8.py) share the shape
    assert {c.kernel for c in cases if c.shape == MLA_SHAPE} == {
        "mla_mma", "mla_fp8", "mla_fp8_tok", "mla_mma_paged64", "mla_fp8_tok_paged3"}
    mla_shapes = {c.shape for c in cases if c.kernel == "mla_mma"}
    assert mla_shapes == {MLA_SHAPE} | {s.name for s in registry.shapes("mla", True) if s.quick}
    assert MLA_SHAPE not in {s.name for s in registry.shapes("mla", True)}
    assert registry.find_shape("mla", MLA_SHAPE, True).families == ("mma", "mla_fp8")
    dims = registry.find_shape("mla", MLA_SHAPE, True).dims["dims"]
    from mla import mma

    assert mma.supported(dims.kv_rank, dims.d_rope) is None


def _mla_entry(defect, monkeypatch):
    """``mla_mma`` with ``defect=``, registered under a new name for ``sweep.run_case``."""
    base = registry.KERNELS_BY_NAME["mla_mma"]

    def run(fn, x):
        return base.run(fn, x, defect=defect)

    spec = replace(base, name=f"mla_mma+{defect}", run=run)
    monkeypatch.setitem(registry.KERNELS_BY_NAME, spec.name, spec)
    return spec.name


@pytest.mark.device
def test_mla_small_case_passes():
    from validation import sweep

    rec = sweep.run_case(_case("mla_mma", MLA_SHAPE))
    assert rec["status"] == "pass", rec["detail"]
    assert rec["cast"] == "storage" and rec["baseline"] == "mma16_pf16/after"
    assert set(rec["outputs"]) == {"out"}


@pytest.mark.device
def test_mla_planted_defect_fails_the_same_case(monkeypatch):
    from validation import sweep

    rec = sweep.run_case(_case(_mla_entry("ldmatrix_no_trans", monkeypatch), MLA_SHAPE))
    assert rec["status"] == "fail" and "max abs err" in rec["detail"], rec["detail"]


@pytest.mark.device
@pytest.mark.parametrize("defect", ["mla_ldmatrix_no_trans", "mla_swizzle_off_by_one",
                                    "mla_causal_tile_edge", "mla_v_block_stride"])
def test_suite_catches_each_mla_switch(defect):
    from validation import suite_mma
    from validation.suite import caught

    assert defect in suite_mma.MLA_DEFECTS
    checks = suite_mma.run_suite(defect)
    assert [c.name for c in checks] == ["out[s2_kv49]", "out[s2_kv49_r128]"] and caught(checks)
    if defect == "mla_v_block_stride":  # invisible at r 64: the r 128 case catches it
        assert checks[0].passed and not checks[1].passed
