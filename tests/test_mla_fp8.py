"""MLA decode over the fp8 latent cache (``mla.fp8``; ``mla_decode`` and
``MLADecodeGraph`` with ``latent_scale``, ``mla.mma``'s fp8 mode).

* the format's numpy reference: codes, k_pe bytes, the exact and the rounded
  dequantization;
* the decode over an fp8 cache gives, bit for bit, the 16-bit tensor-core
  decode over the fp16 cache holding the values it dequantizes to (both scale
  modes, contiguous and paged, with NaN codes and NaN scales in every unused
  row; per tensor with a power-of-two scale, which the kernel's placement of
  the scale, on S's c_kv part and on O, leaves exact): the fp8 mode changes
  only how a tile reaches shared memory and where the tensor's scale goes;
* the per-tensor baseline order (``mma16_pcT``) against the plain rounded-P
  baseline: equal with a power-of-two scale, apart by a rounding otherwise;
* the graph over an fp8 cache gives ``mla_decode``'s bits and reads the scales
  in place (an append between runs is seen);
* the registry entries (``mla_fp8``, ``mla_fp8_tok``) and the defect suite
  (``validation.suite_mla_fp8``): a clean pass, each planted defect caught;
* bad input named before any copy or launch;
* the kernels compile to the e4m3 conversion with no local memory (plain
  process).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla import fp8

RANK, D_ROPE, NH, D_NOPE, D_V = 64, 64, 2, 16, 16
W, RB = RANK + D_ROPE, RANK + 2 * D_ROPE


def _case(rng, lens, s_q=1, mode="token", cap=None, nan_unused=True, rank=RANK):
    """q_nope / q_pe [B, s_q, nh, .], weights, an fp8 cache [B, cap, rank + 2 D_ROPE]
    with its scales, and the fp16 cache [B, cap, rank + D_ROPE] holding the values
    the decode attends (``fp8.dequantize(..., rounded=True)``)."""
    n_b = len(lens)
    cap = cap or max(lens)
    q_nope = rng.standard_normal((n_b, s_q, NH, D_NOPE)).astype(np.float32)
    q_pe = rng.standard_normal((n_b, s_q, NH, D_ROPE)).astype(np.float32)
    w_uk = (rng.standard_normal((NH, D_NOPE, rank)) / np.sqrt(rank)).astype(np.float32)
    w_uv = (rng.standard_normal((NH, D_V, rank)) / np.sqrt(rank)).astype(np.float32)
    rows = rng.standard_normal((n_b, cap, rank + D_ROPE)).astype(np.float32)
    rows[..., :rank] *= np.float32(2.0) ** rng.integers(-8, 8, (n_b, cap, 1))
    # per tensor a power of two: the kernel takes the codes' values and puts the
    # scale on S's c_kv part and on O, which then commutes with every rounding,
    # so the fp16 path over the dequantized values gives the same bits
    tensor = None if mode == "token" else np.array([2.0 ** -4], np.float32)
    codes, scales = fp8.quantize(rows, rank, tensor)
    scales = tensor if mode == "tensor" else scales
    fp16 = fp8.dequantize(codes, scales, rank, rounded=True).astype(np.float16)
    if nan_unused:
        for b, n in enumerate(lens):
            codes[b, n:, :rank] = 0x7F
            fp16[b, n:] = np.nan
            if mode == "token":
                scales[b, n:] = np.nan
    return dict(q_nope=q_nope, q_pe=q_pe, w_uk=w_uk, w_uv=w_uv, codes=codes, scales=scales,
                fp16=fp16, lens=np.asarray(lens, np.int32))


def _paged(codes, scales, fp16, lens, page, rng):
    """The contiguous caches laid out in shuffled pages of ``page`` rows."""
    n_b, cap = codes.shape[:2]
    per = -(-cap // page)
    n_pages = n_b * per + 1
    order = rng.permutation(n_pages)
    table = order[:n_b * per].reshape(n_b, per).astype(np.int32)
    pc = np.full((n_pages, page, codes.shape[2]), 0x7F, np.uint8)
    pf = np.full((n_pages, page, fp16.shape[2]), np.nan, np.float16)
    ps = np.full((n_pages, page), np.nan, np.float32) if scales.ndim == 2 else scales
    for b in range(n_b):
        for p in range(cap):
            pg, off = table[b, p // page], p % page
            pc[pg, off], pf[pg, off] = codes[b, p], fp16[b, p]
            if scales.ndim == 2:
                ps[pg, off] = scales[b, p]
    return pc, ps, pf, table


# ---------------------------------------------------------------------------
# the format (numpy)
# ---------------------------------------------------------------------------

def test_format_rows_and_dequantization():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, 5, W)).astype(np.float32)
    rows[1, 2, :RANK] = 0.0
    codes, s = fp8.quantize(rows, RANK)
    assert codes.shape == (3, 5, fp8.row_bytes(RANK, D_ROPE)) and codes.dtype == np.uint8
    assert s.shape == (3, 5) and s[1, 2] == 0 and not codes[1, 2, :RANK].any()
    np.testing.assert_array_equal(codes[..., RANK:].copy().view(np.float16),
                                  rows[..., RANK:].astype(np.float16))
    exact = fp8.dequantize(codes, s, RANK)
    rounded = fp8.dequantize(codes, s, RANK, rounded=True)
    assert exact.dtype == np.float64 and rounded.dtype == np.float32
    want = (exact[..., :RANK].astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(rounded[..., :RANK], want.astype(np.float32))
    assert np.abs(exact[..., :RANK] - rows[..., :RANK]).max() <= np.abs(rows).max() / 16


# ---------------------------------------------------------------------------
# the decode: the fp16 path's bits
# ---------------------------------------------------------------------------

def _decode_both(c, paged=None, rng=None, **kw):
    from mla.pipeline import mla_decode

    args = (c["q_nope"], c["q_pe"])
    weights = (c["w_uk"], c["w_uv"])
    codes, scales, fp16, table = c["codes"], c["scales"], c["fp16"], None
    if paged:
        codes, scales, fp16, table = _paged(codes, scales, fp16, c["lens"], paged, rng)
    got = mla_decode(*args, codes, c["lens"], *weights, latent_scale=scales, page_table=table,
                     return_lse=True, **kw)
    want = mla_decode(*args, fp16, c["lens"], *weights, method="mma", page_table=table,
                      return_lse=True)
    return got, want


@pytest.mark.device
@pytest.mark.parametrize("mode,rank,row_groups,length", [
    ("token", RANK, 1, 20), ("tensor", RANK, 1, 20), ("token", 256, 4, 20),
    ("tensor", 256, 4, 20), ("tensor", 256, 1, 20), ("token", 256, 4, 130)])
def test_fp8_kernel_gives_the_fp16_kernel_bits(mode, rank, row_groups, length):
    """The kernel alone (one row group: the simulator's cheapest plan; four: the
    offsets derived again each tile): one sequence of length 20 in a cache of 26
    rows (one tile; NaN codes and scales past the length), 2 heads, one query.
    Rank 256: four 64-column blocks of c_kv (the other cases have one; a
    conversion that misplaced codes within the chunks of odd blocks passed
    them). Length 130 at rank 256 / RG 4: two whole tiles, whose codes a thread
    copies in two passes of rows 32 apart (``issue8``'s whole-tile path; at rank
    64 one pass covers a tile)."""
    c = _case(np.random.default_rng(5), [length], mode=mode, cap=length + 6, rank=rank)
    qc = np.random.default_rng(6).standard_normal((1, NH, rank + D_ROPE)).astype(np.float32)
    _kernel_bits_match(c["codes"], c["scales"], c["fp16"], np.zeros((1, 1), np.int32),
                       c["lens"], qc, mode, rank, row_groups, length)


def _kernel_bits_match(codes, scales, fp16, table, lens, qc, mode, rank, row_groups, cap,
                       paged=False, page_size=None, n_split=1, defect=None):
    """``mla.mma`` launched alone over the fp8 cache and over its fp16
    dequantization (``table``: slots or the page table; ``page_size``: the
    plan's; ``n_split`` > 1: the splits' partials compared; ``defect``: planted
    in the fp8 kernel): the same bits (with a defect: returns whether they are)."""
    from attention.core.device import device_empty, to_device
    from mla import mma as MM

    n_b, n_rows = qc.shape[0], qc.shape[1]
    results = []
    for lat, fp8_mode, sc, d in ((codes, mode, scales, defect), (fp16, None, None, None)):
        pl = MM.plan(n_b, n_rows, rank, D_ROPE, cap, "f16", row_groups=row_groups,
                     n_split=n_split, paged=paged, fp8=fp8_mode, page_size=page_size,
                     defect=d)
        o = device_empty((n_b, n_rows, rank), np.float32)
        lse = device_empty((n_b, n_rows), np.float32)
        pa, pm = MM.scratch(pl, n_b, n_rows)
        try:
            MM.launch(pl, to_device(qc), to_device(lat), to_device(lens), to_device(table),
                      NH, 0.125, o, lse, pa, pm, 0,
                      d_scale=None if sc is None else to_device(sc))
        except OverflowError:
            # the simulator's math.exp raises where a GPU gives inf (fp8_as_e5m2's
            # values reach 57344): the planted kernel did not give the same bits
            if d is None:
                raise
            return False
        if pl["n_split"] > 1:
            results.append((pa.copy_to_host(), pm.copy_to_host()))
        else:
            results.append((o.copy_to_host(), lse.copy_to_host()))
    (o8, l8), (o16, l16) = results
    if defect is not None:
        return np.array_equal(o8, o16, equal_nan=True) and np.array_equal(l8, l16,
                                                                           equal_nan=True)
    np.testing.assert_array_equal(o8, o16)
    np.testing.assert_array_equal(l8, l16)
    assert np.isfinite(o8).all() and np.abs(o8).max() > 0
    return True


def _direct_case(rank, lens, cap, paged, seed):
    """Per tensor at ``rank`` (a power of two >= 128: ``mla.mma`` reads the codes
    straight into S's and P.V's fragments, ``DIRECT``): the fp8 cache, its fp16
    dequantization, the table (slots, or shuffled pages of ``paged`` rows) and qc
    [B, NH, W]."""
    rng = np.random.default_rng(seed)
    c = _case(rng, lens, mode="tensor", cap=cap, rank=rank)
    codes, scales, fp16 = c["codes"], c["scales"], c["fp16"]
    table = np.arange(len(lens), dtype=np.int32)[:, None]
    if paged:
        codes, scales, fp16, table = _paged(codes, scales, fp16, c["lens"], paged, rng)
    qc = rng.standard_normal((len(lens), NH, rank + D_ROPE)).astype(np.float32)
    return codes, scales, fp16, table, c["lens"], qc


@pytest.mark.device
@pytest.mark.parametrize("rank,row_groups,paged,n_split", [
    (128, 1, None, 1), (128, 1, None, 2), (128, 4, 64, 2), (128, 2, 16, 1), (256, 2, None, 1)])
def test_codes_read_in_registers_give_the_fp16_kernel_bits(rank, row_groups, paged, n_split):
    """Per tensor at ranks 128 and 256 the kernel keeps no f16 tile: K's and V's
    fragments come from the staged codes (swizzled; ldmatrix, ``.trans`` for V),
    converted in registers, Q's c_kv columns permuted to match, O's columns of
    even and odd n tiles put back at the end. The same bits as the fp16 kernel
    (the mma sums a k step's 16 products in one go, so their order within it
    does not count): two sequences (lengths 150 and 70: whole tiles and a
    partial one), contiguous, pages of 64 (one page-table read a tile) and of
    16 (a read a row, rows past the end zero-filled; shuffled pages), one split
    (O / l written) and two (the partials compared: their columns too), RG 1,
    2, 4 (RG 4 derives the lane offsets again each tile)."""
    codes, scales, fp16, table, lens, qc = _direct_case(rank, [150, 70], 192, paged, 21)
    _kernel_bits_match(codes, scales, fp16, table, lens, qc, "tensor", rank, row_groups, 192,
                       paged=paged is not None, page_size=paged, n_split=n_split)


@pytest.mark.device
@pytest.mark.parametrize("defect", ["ldmatrix_no_trans", "swizzle_off_by_one",
                                    "v_block_stride", "fp8_as_e5m2", "fp8_no_scale"])
def test_codes_read_in_registers_planted_defects_change_the_bits(defect):
    """Positive controls of the test above at rank 128 (RG 1, two splits): each
    planted switch acts on the codes' path (V loaded without ``.trans``; the
    codes stored with the next row's swizzle; V's chunks all from the first 64
    columns; e5m2 decoding; no scale on S's c_kv part and O) and the bits
    differ from the fp16 kernel's. The clean kernel on this case (seed 21,
    rank 128, RG 1, contiguous, two splits) is the test above's second case,
    which gives the fp16 kernel's bits."""
    codes, scales, fp16, table, lens, qc = _direct_case(128, [150, 70], 192, None, 21)
    assert scales[0] != 1  # (so that fp8_no_scale shows)
    assert not _kernel_bits_match(codes, scales, fp16, table, lens, qc, "tensor", 128, 1, 192,
                                  n_split=2, defect=defect)


@pytest.mark.device
@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_fp8_kernel_paged_whole_tiles_give_the_fp16_kernel_bits(mode):
    """Pages of 64 (one page-table read a 64-row tile; the page size compiled in,
    as ``mla_decode`` plans it), one split, length 200: a
    block streams four tiles, so a page looked up for the wrong tile shows past
    the first two (the planted check: the fp8 loop's copies of tile it + 1
    looking up tile it's page fail here). The fp16 kernel over the same pages is
    judged against the oracle in ``tests/test_mla_mma.py``."""
    rng = np.random.default_rng(12)
    c = _case(rng, [200], mode=mode, cap=256)
    codes, scales, fp16, table = _paged(c["codes"], c["scales"], c["fp16"], c["lens"], 64, rng)
    qc = rng.standard_normal((1, NH, RANK + D_ROPE)).astype(np.float32)
    _kernel_bits_match(codes, scales, fp16, table, c["lens"], qc, mode, RANK, 1, 256, paged=True,
                       page_size=64)


@pytest.mark.device
def test_fp8_decode_gives_the_fp16_cache_bits_token_contiguous():
    """Per token, contiguous, 2 queries a sequence, lengths 20 and 3."""
    c = _case(np.random.default_rng(1), [20, 3], s_q=2, mode="token")
    (out, lse), (out16, lse16) = _decode_both(c)
    np.testing.assert_array_equal(out, out16)
    np.testing.assert_array_equal(lse, lse16)
    assert np.isfinite(out).all() and np.abs(out).max() > 0


@pytest.mark.device
@pytest.mark.parametrize("mode,page", [("tensor", None), ("token", 64)])
def test_fp8_decode_gives_the_fp16_cache_bits_on_whole_tiles(mode, page):
    """Lengths 130, 64 and 70: whole 64-row tiles, which both kernels copy
    without position checks (``issue8``'s and ``issue``'s whole-tile paths, one
    chunk of every n-th row a thread), then a partial one; contiguous per
    tensor, pages of 64 per token (one page-table read a tile). The fp16
    kernel's whole-tile copies are judged against the oracle in
    ``tests/test_mla_mma.py`` (lengths 64 to 130)."""
    rng = np.random.default_rng(8)
    c = _case(rng, [130, 64, 70], mode=mode)
    (out, lse), (out16, lse16) = _decode_both(c, paged=page, rng=rng)
    np.testing.assert_array_equal(out, out16)
    np.testing.assert_array_equal(lse, lse16)
    assert np.isfinite(out).all() and np.abs(out).max() > 0


@pytest.mark.device
@pytest.mark.parametrize("page,mode", [(16, "tensor"), (64, "token")])
def test_fp8_decode_gives_the_fp16_cache_bits_paged(page, mode):
    """Pages of 16 (shuffled; a page-table read a row) per tensor and of 64 (one
    read a 64-row tile) per token, lengths 37, 0 and 16, one query."""
    rng = np.random.default_rng(2)
    c = _case(rng, [37, 0, 16], mode=mode, cap=40)
    (out, lse), (out16, lse16) = _decode_both(c, paged=page, rng=rng)
    np.testing.assert_array_equal(out, out16)
    np.testing.assert_array_equal(lse, lse16)
    assert not out[1].any() and np.isneginf(lse[1]).all()


@pytest.mark.device
def test_decode_graph_reads_the_scales_in_place():
    """``MLADecodeGraph`` over an fp8 cache gives ``mla_decode``'s bits; after
    ``fp8_append_latent`` writes one more row (codes and per-token scale) and
    the length grows, the next run sees it."""
    from attention.core.device import to_device, to_host
    from mla.decode_graph import MLADecodeGraph
    from mla.fp8_append import fp8_append_latent
    from mla.pipeline import mla_decode

    rng = np.random.default_rng(3)
    c = _case(rng, [9, 4], mode="token", cap=12, nan_unused=False)
    d_codes, d_scales = to_device(c["codes"]), to_device(c["scales"])
    d_lens = to_device(c["lens"])
    g = MLADecodeGraph(to_device(c["q_nope"][:, 0]), to_device(c["q_pe"][:, 0]), d_codes,
                       d_lens, c["w_uk"], c["w_uv"], latent_scale=d_scales)
    assert g.method == "mma" and g.fp8 == "token"
    g.run(sync=True)
    want = mla_decode(c["q_nope"][:, 0], c["q_pe"][:, 0], c["codes"], c["lens"], c["w_uk"],
                      c["w_uv"], latent_scale=c["scales"])
    np.testing.assert_array_equal(to_host(g.out), want)
    new = (rng.standard_normal((2, 1, W)) * 30).astype(np.float32)
    fp8_append_latent(new, d_codes, None, c["lens"], scales=d_scales)
    d_lens.copy_to_device(c["lens"] + 1)
    g.run(sync=True)
    codes, scales = to_host(d_codes), to_host(d_scales)
    want = mla_decode(c["q_nope"][:, 0], c["q_pe"][:, 0], codes, c["lens"] + 1, c["w_uk"],
                      c["w_uv"], latent_scale=scales)
    np.testing.assert_array_equal(to_host(g.out), want)


# ---------------------------------------------------------------------------
# validation: the registry entries and the defect suite
# ---------------------------------------------------------------------------

MLA_SHAPE = "mma_nh2_r64_rope64_q2_kv40"


def test_registry_entries_share_the_tensor_core_shape():
    from validation import registry

    cases = registry.cases(registry.KERNELS, small=True, quick=True, seeds=[0],
                           dtypes=["float16"])
    assert {c.kernel for c in cases if c.shape == MLA_SHAPE} == {
        "mla_mma", "mla_fp8", "mla_fp8_tok", "mla_mma_paged64", "mla_fp8_tok_paged3"}
    for name, mode, label in (("mla_fp8", "tensor", "mma16_pc16/after"),
                              ("mla_fp8_tok", "token", "mma16_p16/after")):
        spec = registry.KERNELS_BY_NAME[name]
        assert (spec.quantize, spec.baseline, spec.storage) == (mode, label, ("k_pe",))


@pytest.mark.parametrize("code_scale,equal", [(2.0 ** -4, True), (0.037, False)])
def test_per_tensor_order_moves_only_the_scale(code_scale, equal):
    """``mla_rounded_p(code_scale=)`` (the order ``mma16_pcT``, the per-tensor
    kernel's) over the codes' values against the plain rounded-P order over the
    dequantized values rounded to fp16: the same bits with a power-of-two scale
    (the scale then commutes with every rounding); with another scale apart
    (a positive control: the two orders are told apart) by about fp16's
    rounding of the values, no more."""
    from attention.cache.fp8 import decode_e4m3
    from validation.baselines import mla_rounded_p

    rng = np.random.default_rng(11)
    t_q, t_kv = 2, 37
    q_nope = rng.standard_normal((t_q, NH, D_NOPE)).astype(np.float32)
    q_pe = rng.standard_normal((t_q, NH, D_ROPE)).astype(np.float32)
    w_uk = (rng.standard_normal((NH, D_NOPE, RANK)) / np.sqrt(RANK)).astype(np.float32)
    w_uv = (rng.standard_normal((NH, D_V, RANK)) / np.sqrt(RANK)).astype(np.float32)
    rows = rng.standard_normal((t_kv, RANK + D_ROPE)).astype(np.float32)
    codes, _ = fp8.quantize(rows, RANK, np.array([code_scale], np.float32))
    values = decode_e4m3(codes[:, :RANK]).astype(np.float32)
    k_pe = rows[:, RANK:].astype(np.float16).astype(np.float32)
    deq = (values.astype(np.float64) * np.float32(code_scale)).astype(np.float32)
    scale = 1.0 / np.sqrt(D_NOPE + D_ROPE)
    got = mla_rounded_p(q_nope, q_pe, values, k_pe, w_uk, w_uv, scale, np.float16,
                        code_scale=code_scale)
    want = mla_rounded_p(q_nope, q_pe, deq, k_pe, w_uk, w_uv, scale, np.float16)
    if equal:
        np.testing.assert_array_equal(got, want)
    else:
        diff = np.abs(got - want).max()
        assert 0 < diff <= 2.0 ** -9 * np.abs(want).max(), diff
    with pytest.raises(ValueError, match="code_scale"):
        mla_rounded_p(q_nope, q_pe, values, k_pe, w_uk, w_uv, scale, np.float16,
                      sums="matmul", code_scale=code_scale)


def test_quantized_case_keeps_exact_values_for_the_oracle():
    from validation import fixtures, registry

    x = registry.make_inputs("mla", registry.find_shape("mla", MLA_SHAPE, True), "normal", 0)
    for mode in fixtures.MLA_FP8_MODES:
        y = fixtures.fp8_quantize(x, mode)
        codes = y["latent_codes"]
        assert y["c_kv"].dtype == np.float64 and codes.dtype == np.uint8
        rows = np.concatenate([codes, np.zeros((len(codes), 2 * D_ROPE), np.uint8)], 1)
        exact = fp8.dequantize(rows, y["latent_scale"], RANK)[:, :RANK]
        np.testing.assert_array_equal(y["c_kv"], exact)
        # the codes are the source's: within half a step of e4m3's 3-bit mantissa
        src = y["c_kv_source"]
        assert np.abs(exact - src).max() <= np.abs(src).max() / 16


@pytest.mark.parametrize("dtype,reason", [("float32", "k_pe as float16"),
                                          ("bfloat16", "k_pe as float16")])
def test_registry_other_dtypes_are_unsupported(dtype, reason):
    from validation import registry, sweep

    rec = sweep.run_case(registry.Case("mla_fp8_tok", MLA_SHAPE, "normal", 0, dtype, True))
    assert rec["status"] == "unsupported" and (reason in rec["detail"]
                                               or "bfloat16" in rec["detail"]), rec


@pytest.mark.device
@pytest.mark.parametrize("kernel", ["mla_fp8", "mla_fp8_tok"])
def test_registry_case_passes(kernel):
    from validation import registry, sweep

    rec = sweep.run_case(registry.Case(kernel, MLA_SHAPE, "large", 0, "float16", True))
    assert rec["status"] == "pass", rec["detail"]
    label = "mma16_pcf16/after" if kernel == "mla_fp8" else "mma16_pf16/after"
    assert rec["baseline"] == label and rec["cast"] == "storage"


@pytest.mark.device
def test_suite_clean_run_passes():
    from validation import suite_mla_fp8
    from validation.suite import caught

    checks_ = suite_mla_fp8.run_suite(None)
    assert [c.name for c in checks_] == ["out[tensor_s2]", "out[token_s2]", "out[tensor_r128]",
                                        "append[token]", "append[tensor]"]
    assert not caught(checks_), [c for c in checks_ if not c.passed]


@pytest.mark.device
@pytest.mark.parametrize("defect", ["fp8_scale_twice", "fp8_no_scale", "fp8_scale_wrong_token",
                                    "fp8_as_e5m2", "codes_no_trans", "codes_swizzle_off",
                                    "codes_v_block", "append_round_to_zero"])
def test_suite_catches_each_defect(defect):
    from validation import suite_mla_fp8
    from validation.suite import caught

    assert defect in suite_mla_fp8.DEFECTS
    checks_ = suite_mla_fp8.run_suite(defect)
    assert caught(checks_)
    if defect.startswith("codes_"):  # caught on the direct path's case, which it acts on
        assert [c.name for c in checks_] == ["out[tensor_r128]"]


# ---------------------------------------------------------------------------
# bad input: named, before any copy or launch
# ---------------------------------------------------------------------------

def _bad_args(**change):
    rng = np.random.default_rng(4)
    c = _case(rng, [5, 3], mode="token", cap=8)
    args = dict(q_nope=c["q_nope"][:, 0], q_pe=c["q_pe"][:, 0], latent_cache=c["codes"],
                lengths=c["lens"], w_uk=c["w_uk"], w_uv=c["w_uv"], latent_scale=c["scales"])
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,text", [
    ({"latent_scale": None}, checks.DTypeError, "latent_scale: a uint8"),
    ({"latent_scale": np.ones((2, 7), np.float32)}, checks.ShapeError, "latent_scale"),
    ({"latent_scale": np.ones((2, 8), np.float64)}, checks.DTypeError, "latent_scale"),
    ({"latent_scale": np.array([0.0], np.float32)}, checks.RangeError, "finite scale > 0"),
    ({"latent_scale": np.array([200.0], np.float32)}, checks.RangeError, "65504"),
    ({"latent_cache": np.zeros((2, 8, RB - 16), np.uint8)}, checks.ShapeError, "latent_cache"),
    ({"latent_cache": np.zeros((2, 8, W), np.float16)}, checks.DTypeError,
     "latent_scale: only with an fp8"),
    ({"method": "gemm"}, checks.DTypeError, "method='mma'"),
    ({"lengths": np.array([9, 3])}, checks.RangeError, "lengths"),
])
def test_bad_input_is_named_before_any_launch(change, error, text, monkeypatch):
    from mla import pipeline

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(pipeline, "_core", no_launch)
    args = _bad_args(**{k: v for k, v in change.items() if k != "method"})
    passed = args["latent_cache"]
    before = passed.copy()
    lead = tuple(args.pop(n) for n in ("q_nope", "q_pe", "latent_cache", "lengths", "w_uk",
                                       "w_uv"))
    with pytest.raises(error, match=text):
        pipeline.mla_decode(*lead, method=change.get("method", "auto"), **args)
    np.testing.assert_array_equal(passed, before)  # the cache given is untouched


def test_defects_are_checked_by_mode():
    from mla import mma

    with pytest.raises(ValueError, match="fp8_scale_wrong_token"):
        mma.check_defect("fp8_scale_wrong_token", "tensor")
    with pytest.raises(ValueError, match="fp8_no_scale"):
        mma.check_defect("fp8_no_scale", None)
    mma.check_defect("fp8_scale_wrong_token", "token")


# ---------------------------------------------------------------------------
# compile-only: the e4m3 conversion, no local memory
# ---------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("mode,rank,row_groups,paged", [
    ("token", 512, 2, True), ("tensor", 192, 4, False), ("tensor", 512, 4, False),
    ("tensor", 512, 4, True)])
def test_fp8_kernel_compiles_without_local_memory(mode, rank, row_groups, paged):
    """Per token, and per tensor at a rank that is not a power of two (192), the
    tile is converted into f16 in shared memory; per tensor at 512 (``DIRECT``)
    the codes go from their staging buffers straight into the fragments."""
    from numba import cuda

    from mla import mma as MM
    from tests.test_mla_mma import _signature

    kern = MM.mla_mma_kernel("f16", rank, 64, row_groups, 64, paged, None, mode)
    ptx, _ = cuda.compile_ptx(kern.py_func, _signature(), cc=(9, 0), fastmath=True)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.f16x2.f32" in ptx
    n_t = rank // 4 // 8  # n tiles of a warp's O
    assert ptx.count("mma.sync.aligned.m16n8k16") == (rank + 64) // 16 * 2 + 4 * n_t
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx and "ld.local" not in ptx
    # per tensor the codes' f16 values (no fp32); per token through fp32, times the
    # row's scale
    assert ("cvt.ftz.f32.f16" in ptx) == (mode == "token")
    trans = ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans")
    loads = ptx.count("ld.shared.u64")
    if mode == "tensor" and rank == 512:
        # no conversion units; V by ldmatrix .trans of the codes (32 columns a
        # load, then prmt to pair each column's positions): 4 k steps x n_t / 4
        assert loads == 0 and ptx.count("st.shared.u64") == 0
        assert trans == 4 * n_t // 4 and "prmt.b32" in ptx
    else:
        # the conversion's units: a uint64 of codes in, a 16-byte f16 chunk out as
        # two uint64 (a warp's loads and stores free of bank conflicts: mla.mma's
        # docstring); the compiler unrolls the units' loop, so count the pairs
        assert loads >= 1 and ptx.count("st.shared.u64") == 2 * loads
        assert trans == 4 * n_t // 2


# ---------------------------------------------------------------------------
# error growth over decode steps through the quantizing append
# ---------------------------------------------------------------------------

def test_growth_run_is_registered_and_float16_only():
    from validation import growth

    assert "mla_fp8_decode" in growth.GROWTH_KERNELS
    assert growth.REGISTRY_KERNEL["mla_fp8_decode"] == "mla_fp8_tok"
    rec = growth.run_growth(growth.GrowthJob("mla_fp8_decode", "float32", 0, 2, True))
    assert rec["status"] == "unsupported" and "k_pe as float16" in rec["detail"], rec


@pytest.mark.device
def test_growth_run_passes_and_keeps_the_cache_bytes():
    """Three steps on the simulator (1024 on a GPU): every step within the rule,
    every cache byte and scale the reference quantizer's, NaN codes past the
    last row."""
    from validation import growth

    rec = growth.run_growth(growth.GrowthJob("mla_fp8_decode", "float16", 0, 3, True))
    assert rec["status"] == "pass", rec["detail"]
    assert rec["cache_ok"] and len(rec["series"]["step"]) == 3
    assert rec["geometry"]["row_bytes"] == 64 + 2 * 64
