"""Tensor-core prefill (``attention.prefill.mma``): 16-bit q / k / v, fp32
accumulation, P rounded to the inputs' 16-bit type before P.V.

The kernel's arithmetic is not the fp32 prefill's, so its baseline is a
float32 numpy prefill with the same roundings (``baseline``: the scores of the
16-bit inputs accumulated as the mma does, 16-wide k steps added to an fp32
accumulator and truncated, the model ``tests/test_mma16`` holds the H200 to;
P rounded to the inputs' dtype before P.V; ``l`` the sum of the unrounded P),
judged with the float64 oracle on the same 16-bit inputs
(``attention.oracle.prefill_attention_ref``). An output passes when NaN
and inf sit where the oracle has them and

    max|kernel - oracle| <= 2 * max|baseline - oracle| + floor,

floor = 2 float32 ulps of max|oracle| (``validation.tolerance.floor``), for out
and for lse; out also has ``1 - cos(kernel, oracle) < 1e-5`` (FlashMLA's
check). Checked here:

* on the simulator (``device``) and on a GPU: causal and full attention, GQA
  (two query heads a kv head), T not a multiple of the query or K / V tile
  (40, 37, 20, 140), one, two, four and eight warps a block (a warp whose rows
  all lie past T; a warp skipping the tile above its diagonal), K / V tiles of 16, 32 and 64
  positions, head dims 16, 32, 64 (a row of 8 swizzle chunks) and 96 (stored
  in 128 columns), fp16; bf16 on a GPU (the simulator has no bfloat16);
  device arrays in and caller-given ``out`` / ``lse`` buffers;
* the planted defects (``mma.DEFECTS``) each fail the same rule on a case the
  clean kernel passes (the positive controls): V fragments loaded without
  ``.trans``, K tiles stored with the next row's swizzle, a causal row whose
  diagonal is a tile's first position not seeing it. The last leaves row 0
  with nothing to attend: it must come out as zeros and LSE -inf, never NaN
  (the guard for rows that attend nothing);
* host checks: errors name the argument and the expected shape, dtype or range;
  the shared tiles' swizzle is a bijection without bank conflicts, the same in
  every 16-row block (what the kernel's fragment addresses assume);
* compile-only: sm_90 kernels with ``mma.sync...m16n8k16``, ``ldmatrix`` x4 and
  x4.trans and ``cp.async``, no local memory in the PTX, and (where nvJitLink
  is installed) no spills in ptxas's report, at D 64, 128 and 256 with their
  default warps (4, 8, 4);
  the online rescale's ``ex2`` takes a difference of two rounded references, not
  a ``mul.f32`` ptxas would contract into an FFMA (``alpha`` != 1 while the max
  stays: the LSE error of the full shape, ``validation/prefill_lse_model.py``);
* on a GPU (``gpu``): T 4096, H 32, H_kv 8, D 128, causal, fp16 and bf16,
  against the oracle on two kv groups (8 query heads, every row), with torch
  SDPA's error on the same inputs printed beside ours when torch is present.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.prefill import mma
from tests.conftest import storage_dtype
from tests.test_decode_mma import errors, fails
from validation.baselines import prefill_rounded_p as baseline

F16 = np.dtype(np.float16)
COS_LIMIT = 1e-5  # FlashMLA's bound on 1 - cos(kernel, reference)


# ---------------------------------------------------------------------------
# the baseline and the rule
# ---------------------------------------------------------------------------

def oracle(q, k, v, n_heads, n_kv, causal, scale):
    from attention.oracle import prefill_attention_ref

    return prefill_attention_ref(q, k, v, n_heads, n_kv, causal=causal, scale=scale)


def cos_diff(got, ref):
    """1 - cos(got, ref) over the entries finite in both (float64)."""
    g = np.asarray(got, np.float64).ravel()
    r = np.asarray(ref, np.float64).ravel()
    both = np.isfinite(g) & np.isfinite(r)
    g, r = g[both], r[both]
    denom = np.linalg.norm(g) * np.linalg.norm(r)
    return 0.0 if denom == 0 else float(1.0 - (g @ r) / denom)


def judge(got, ref, base, what):
    for name, g, r, b in zip(("out", "lse"), got, ref, base):
        err, bound, placed = errors(g, r, b)
        assert placed, f"{what} {name}: NaN / inf placement differs from the oracle"
        if err > bound:
            where = np.unravel_index(np.argmax(np.abs(np.nan_to_num(
                np.asarray(g, np.float64) - r, posinf=0, neginf=0))), np.shape(r))
            raise AssertionError(f"{what} {name}: max err {err:.3e} > bound {bound:.3e} "
                                 f"(largest at {tuple(int(i) for i in where)})")
    assert cos_diff(got[0], ref[0]) < COS_LIMIT, f"{what} out: 1 - cos {cos_diff(got[0], ref[0])}"


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------

def make_qkv(rng, t_len, n_heads, n_kv, head_dim, dtype):
    """Standard-normal rows rounded to ``dtype``: scores spread ~1, so every
    key carries weight and P spans many binades."""
    q = rng.standard_normal((t_len, n_heads * head_dim), np.float32).astype(dtype)
    k = rng.standard_normal((t_len, n_kv * head_dim), np.float32).astype(dtype)
    v = rng.standard_normal((t_len, n_kv * head_dim), np.float32).astype(dtype)
    return q, k, v


def check_case(q, k, v, n_heads, n_kv, causal, got, dtype, what):
    scale = 1.0 / np.sqrt(q.shape[1] // n_heads)
    ref = oracle(q, k, v, n_heads, n_kv, causal, scale)
    base = baseline(q, k, v, n_heads, n_kv, causal, scale, dtype)
    judge(got, ref, base, what)
    assert not np.isnan(got[0]).any() and not np.isnan(got[1]).any(), what


def run(q, k, v, n_heads, n_kv, causal, **kw):
    out, lse = mma.prefill_attention_mma(q, k, v, n_heads, n_kv, causal=causal, **kw)
    return np.asarray(out), np.asarray(lse)


# ---------------------------------------------------------------------------
# against the oracle (simulator and GPU)
# ---------------------------------------------------------------------------

CASES = [
    # (t_len, n_heads, n_kv, head_dim, causal, warps, block_n)
    # causal GQA; T 40 ends inside a query tile and a K / V tile; the last block
    # sees two K / V tiles (online rescaling), the first two one each
    (40, 2, 1, 32, True, 1, 32),
    # full attention over three K / V tiles of 16 (the last 5 positions of 16);
    # 32-row blocks: the second block's second warp has no row below T
    (37, 2, 2, 16, False, 2, 16),
    # D 64 (rows of 8 swizzle chunks), two warps: warp 0 skips the tile above its
    # diagonal while warp 1 computes it
    (24, 2, 1, 64, True, 2, 16),
    # D 96 in 128-column tiles, one K / V tile of 32 with 12 zero-filled positions
    (20, 1, 1, 96, True, 1, 32),
    # the GPU's plan (4 warps, tiles of 64): rows 40 .. 63 of the one block lie
    # past T (warp 2 in part, warp 3 wholly); each thread stages 1 of 128 chunks
    (40, 1, 1, 16, True, mma.WARPS, mma.BLOCK_N),
    # the default plan of 128-column rows (8 warps, tiles of 64) at D 96: the
    # second block's rows 128 .. 139 are warp 0's, warps 1 .. 7 lie past T; its
    # second K / V tile (64 .. 127) is whole, the third (128 .. 139) checked
    (140, 1, 1, 96, True, mma.default_warps(96), mma.BLOCK_N),
    # the last K / V tile holds 13 positions: a thread copies rows 8 apart, so
    # the tile's checked copies take two passes with positions below T
    (45, 2, 1, 32, False, 1, 32),
]


@pytest.mark.device
@pytest.mark.parametrize("t_len,n_heads,n_kv,head_dim,causal,warps,block_n", CASES,
                         ids=["causal-gqa-d32", "full-d16-w2", "causal-d64-w2", "causal-d96",
                              "gpu-plan-d16", "full-d32-partial-tile", "gpu-plan-d96-w8"])
def test_matches_the_oracle(t_len, n_heads, n_kv, head_dim, causal, warps, block_n):
    rng = np.random.default_rng(t_len + head_dim)
    q, k, v = make_qkv(rng, t_len, n_heads, n_kv, head_dim, F16)
    got = run(q, k, v, n_heads, n_kv, causal, warps=warps, block_n=block_n)
    check_case(q, k, v, n_heads, n_kv, causal, got, F16,
               f"T={t_len} H={n_heads}/{n_kv} D={head_dim} causal={causal}")


@pytest.mark.device
@pytest.mark.parametrize("causal", [True, False])
def test_warps_a_block_do_not_change_a_bit(causal):
    """A row's arithmetic does not depend on the warps a block (a warp computes
    the tiles up to its own diagonal, or all of them, in the same order), so
    the 8-warp default of 128-column rows gives the 4-warp plan's bits, and the
    2-warp plan's (T 70, D 32: blocks of 32, 64 and 128 rows, the last one
    partial, K / V tiles of 32 with a checked last tile; the full-shape GPU
    timings of D 64, 96, 128 and 256 gave the same bits at 4 and 8 warps:
    notes/bench.md)."""
    rng = np.random.default_rng(70)
    q, k, v = make_qkv(rng, 70, 1, 1, 32, F16)
    want = run(q, k, v, 1, 1, causal, warps=4, block_n=32)
    for warps in (2, 8):
        got = run(q, k, v, 1, 1, causal, warps=warps, block_n=32)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    # the control: tiles of 16 sum in another order, and the comparison sees it
    other = run(q, k, v, 1, 1, causal, warps=4, block_n=16)
    assert not np.array_equal(other[0], want[0])


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtypes_match_the_oracle(dtype):
    """fp16 and bf16 (P rounded to bf16 in both the kernel and the baseline)."""
    dt = storage_dtype(dtype)
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 21, 2, 1, 16, dt)
    got = run(q, k, v, 2, 1, True, warps=1, block_n=16)
    check_case(q, k, v, 2, 1, True, got, dt, f"{dtype} T=21")


@pytest.mark.device
def test_device_arrays_and_given_buffers():
    """Device inputs give device results, written into the caller's buffers."""
    from numba import cuda

    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, 17, 1, 1, 16, F16)
    d_out = cuda.to_device(np.full((17, 16), np.nan, np.float32))
    d_lse = cuda.to_device(np.full((1, 17), np.nan, np.float32))
    r_out, r_lse = mma.prefill_attention_mma(cuda.to_device(q), cuda.to_device(k),
                                             cuda.to_device(v), 1, causal=False, out=d_out,
                                             lse=d_lse, warps=1, block_n=16)
    assert r_out is d_out and r_lse is d_lse
    got = (d_out.copy_to_host(), d_lse.copy_to_host())
    check_case(q, k, v, 1, 1, False, got, F16, "device arrays")


# ---------------------------------------------------------------------------
# planted defects: each caught by the same rule, the clean kernel passes
# ---------------------------------------------------------------------------

_DEFECT_RUNS = {}


def defect_case():
    """Causal, T 33, one head, D 16, tiles of 16: rows 0, 16 and 32 have their
    diagonal on a tile's first position; (q, k, v, ref, base)."""
    if "case" not in _DEFECT_RUNS:
        rng = np.random.default_rng(11)
        q, k, v = make_qkv(rng, 33, 1, 1, 16, F16)
        scale = 1.0 / np.sqrt(16)
        _DEFECT_RUNS["case"] = (q, k, v, oracle(q, k, v, 1, 1, True, scale),
                                baseline(q, k, v, 1, 1, True, scale, F16))
    return _DEFECT_RUNS["case"]


def defect_run(defect):
    q, k, v, ref, base = defect_case()
    return run(q, k, v, 1, 1, True, warps=1, block_n=16, defect=defect), ref, base


@pytest.mark.device
def test_clean_kernel_passes_the_defect_case():
    got, ref, base = defect_run(None)
    judge(got, ref, base, "clean kernel on the defect case")


@pytest.mark.device
@pytest.mark.parametrize("defect", mma.DEFECTS)
def test_planted_defect_is_caught(defect):
    got, ref, base = defect_run(defect)
    assert fails(got, ref, base), f"{defect}: passed the rule"
    if defect == "causal_tile_edge":
        # row 0 sees nothing: the guard gives zeros and LSE -inf, never NaN
        assert np.all(got[0][0] == 0) and got[1][0, 0] == -np.inf
        assert not np.isnan(got[0]).any()


# ---------------------------------------------------------------------------
# host checks (no kernel runs)
# ---------------------------------------------------------------------------

def _small(t_len=8, n_heads=2, n_kv=1, head_dim=16, dtype=F16):
    q = np.zeros((t_len, n_heads * head_dim), dtype)
    k = np.zeros((t_len, n_kv * head_dim), dtype)
    return q, k, k.copy()


def test_bad_inputs_are_named():
    q, k, v = _small()
    call = mma.prefill_attention_mma
    with pytest.raises(checks.DTypeError, match="q: expected dtype float16 or bfloat16"):
        call(q.astype(np.float32), k, v, 2, 1)
    with pytest.raises(checks.DTypeError, match="v: expected dtype float16"):
        call(q, k, v.astype(np.float32), 2, 1)
    if len(mma.DTYPES) > 1:  # bfloat16 available (ml_dtypes)
        with pytest.raises(checks.DTypeError, match="k: expected dtype float16"):
            call(q, k.astype(mma.DTYPES[-1]), v, 2, 1)
    with pytest.raises(checks.ShapeError, match=r"k: expected shape \[T=8, H_kv\*D=1\*16"):
        call(q, k[:7], v, 2, 1)
    with pytest.raises(checks.ShapeError, match=r"v: expected shape \[T=8, H_kv\*D=1\*16"):
        call(q, k, np.zeros((8, 32), F16), 2, 1)
    with pytest.raises(checks.RangeError, match="q: expected head_dim D in"):
        call(*_small(head_dim=24), 2, 1)
    with pytest.raises(checks.RangeError, match="n_kv_heads: H_kv=3 must divide"):
        call(*_small(n_kv=3), 2, 3)
    with pytest.raises(checks.ShapeError, match=r"q: expected shape \[T, H\*D\]"):
        call(q, k, v, 3, 1)
    with pytest.raises(checks.RangeError, match="warps: expected warps a block in"):
        call(q, k, v, 2, 1, warps=9)
    with pytest.raises(checks.RangeError, match="block_n: expected one of"):
        call(q, k, v, 2, 1, block_n=48)
    with pytest.raises(checks.RangeError, match="scale: expected a finite positive"):
        call(q, k, v, 2, 1, scale=float("nan"))
    with pytest.raises(checks.ShapeError, match=r"out: expected shape \[T=8, H\*D=32\]"):
        call(q, k, v, 2, 1, out=np.zeros((8, 16), np.float32))
    with pytest.raises(checks.DTypeError, match="lse: expected dtype float32"):
        call(q, k, v, 2, 1, lse=np.zeros((2, 8), np.float16))
    with pytest.raises(ValueError, match="defect: expected None or one of"):
        call(q, k, v, 2, 1, defect="p_unrounded")


def test_empty_sequence_gives_empty_results():
    out, lse = mma.prefill_attention_mma(*_small(t_len=0), 2, 1)
    assert out.shape == (0, 32) and lse.shape == (2, 0)


def test_default_tiles_fit_two_blocks_an_sm():
    """The default K / V tile: 64 positions, 32 at D 256, where two stages of 64
    would take 128 KB of shared memory (one block an SM of 227 KB)."""
    assert mma.default_block_n(128) == 64 and mma.default_block_n(96) == 64
    assert mma.default_block_n(256) == 32
    assert 2 * 4 * mma.smem_words(256, 4, 32) <= 227 * 1024
    assert 4 * mma.smem_words(128, 4, 64) == 80 * 1024  # Q 16 KB + 2 x (K + V) 64 KB


def test_default_warps_follow_the_row_width():
    """8 warps where a shared row is 128 columns (D 80 .. 128), 4 elsewhere; the
    8-warp block's shared memory (Q 32 KB + 64 KB of stages at D 128) fits (its
    registers, 224 a thread under ptxas 13.0, hold one such block an SM: the
    same 8 warps as two 4-warp blocks), and the public call plans with it."""
    assert [mma.default_warps(d) for d in mma.HEAD_DIMS] == [4, 4, 4, 4, 8, 8, 8, 8, 4]
    assert 4 * mma.smem_words(128, 8, 64) == 96 * 1024
    pl = mma.plan(300, 2, 128, "f16", True)
    assert pl["warps"] == 8 and pl["block"] == 256 and pl["grid"] == (2, 3)
    assert mma.plan(300, 2, 64, "f16", True)["warps"] == 4
    assert mma.plan(300, 2, 128, "f16", True, warps=2)["warps"] == 2


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 96, 128, 256])
def test_tile_layout_is_conflict_free_and_the_same_in_every_16_row_block(head_dim):
    """The shared tiles' swizzle: a bijection onto the tile's 16-byte chunks,
    every ldmatrix phase (8 consecutive rows of one chunk) on 8 distinct bank
    groups, ``mma16``'s layout for rows of up to 8 chunks, and the same keys in
    every 16-row block (the kernel's fragment addresses rely on it)."""
    from attention.gemm import mma16

    cols = mma.padded_cols(head_dim)
    chunks, rows = cols // 8, 64
    slots = [mma.tile_slot(r, c, head_dim) for r in range(rows) for c in range(chunks)]
    assert sorted(slots) == [4 * i for i in range(rows * chunks)]
    for r0 in range(0, rows, 8):
        for c in range(chunks):
            groups = {(mma.tile_slot(r0 + r, c, head_dim) // 4) % 8 for r in range(8)}
            assert len(groups) == 8, (r0, c)
    for r in range(rows):
        for c in range(chunks):
            key = mma.tile_slot(r, c, head_dim) - r * cols // 2
            assert key == mma.tile_slot(r % 16, c, head_dim) - (r % 16) * cols // 2
            if chunks <= 8:
                assert mma.tile_slot(r, c, head_dim) == mma16.tile_index_host(r, 8 * c, cols)


# ---------------------------------------------------------------------------
# compile-only: PTX and ptxas
# ---------------------------------------------------------------------------

def _signature():
    from numba import types

    u32, i32, f32 = types.uint32, types.int32, types.float32
    arr = types.Array
    return (arr(u32, 1, "C"), arr(u32, 1, "C"), arr(u32, 1, "C"), i32, i32, f32,
            arr(f32, 2, "C"), arr(f32, 2, "C"))


_PTX = {}


def _ptx(kind, head_dim, causal=True, warps=None, block_n=None, defect=None):
    from numba import cuda

    warps = mma.default_warps(head_dim) if warps is None else warps
    block_n = mma.default_block_n(head_dim) if block_n is None else block_n
    key = (kind, head_dim, causal, warps, block_n, defect)
    if key not in _PTX:
        kern = mma.prefill_mma_kernel(kind, head_dim, causal, warps, block_n, defect)
        _PTX[key] = cuda.compile_ptx(kern.py_func, _signature(), cc=(9, 0), fastmath=True)[0]
    return _PTX[key]


def _ptxas_report(ptx, arch="sm_90"):
    """ptxas's verbose report of ``ptx`` for ``arch`` (nvJitLink through cuda.core),
    headed by the nvJitLink version (spill figures differ between versions), or
    None where that is not installed. PTX ptxas rejects raises."""
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError:
        return None
    try:
        from cuda.bindings import nvjitlink

        version = "nvJitLink %d.%d" % tuple(nvjitlink.version())
    except Exception:  # an older binding: the report alone
        version = "nvJitLink (version unknown)"
    linker = Linker(ObjectCode.from_ptx(ptx.encode()),
                    options=LinkerOptions(arch=arch, verbose=True, ptxas_options=["-v"]))
    linker.link("cubin")
    return f"{version}\n{linker.get_info_log()}"


def spill_bytes(report):
    """The most bytes any function of a ptxas ``-v`` report spills (stores or loads).

    ptxas 12 prints "N bytes spill stores, M bytes spill loads" for every function;
    the nvJitLink of CUDA 13 leaves that line out when nothing spills and gives
    "N bytes lmem" instead. Without a spill line, all local memory counts as spill."""
    import re

    pairs = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if pairs:
        return max(max(int(a), int(b)) for a, b in pairs)
    lmem = re.findall(r"(\d+) bytes lmem", report)
    assert lmem, f"no spill or lmem figure in the ptxas report:\n{report}"
    return max(int(x) for x in lmem)


def test_spill_bytes_reads_both_report_formats():
    """The spill figure of ptxas 12's report and of CUDA 13's nvJitLink report (no
    spill line when nothing spills), and a report with neither is an error."""
    v12 = ("ptxas info    : Used 214 registers\n"
           "ptxas info    : 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : 8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n")
    assert spill_bytes(v12) == 12
    v13 = "info    : used 214 registers, used 1 barriers, 0 stack, 1024 bytes smem, 0 bytes lmem"
    assert spill_bytes(v13) == 0
    assert spill_bytes(v13.replace("0 bytes lmem", "16 bytes lmem")) == 16
    with pytest.raises(AssertionError, match="no spill or lmem"):
        spill_bytes("info    : used 214 registers")


@pytest.mark.compile
@pytest.mark.parametrize("kind,head_dim,causal", [("f16", 128, True), ("bf16", 64, False),
                                                   ("f16", 256, True)])
def test_compiles_to_mma_ldmatrix_and_cp_async_without_spills(kind, head_dim, causal):
    ptx = _ptx(kind, head_dim, causal)
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx  # Q and K fragments
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx  # V fragments
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group 1" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "spilled to local memory"
    # a tile: D/16 k steps x BN/8 n tiles for S, BN/16 k steps x D/8 n tiles for P V
    bn = mma.default_block_n(head_dim)
    assert ptx.count("mma.sync.aligned.m16n8k16") == (head_dim // 16 * bn // 8
                                                      + bn // 16 * head_dim // 8)
    report = _ptxas_report(ptx)
    if report is not None:
        assert spill_bytes(report) == 0, report


def ex2_of_differences(ptx):
    """The ``ex2.approx`` arguments of ``ptx`` that are a ``sub`` (the online
    rescale's), each with the plain ``mul.f32`` (no ``.rn``: ptxas may contract the
    pair into one FFMA) its operands come from, or None: [(sub, mul or None)]."""
    defs = {}
    for line in ptx.splitlines():
        parts = line.strip().rstrip(";").replace(",", " ").split()
        if len(parts) >= 3 and "." in parts[0] and parts[1].startswith("%"):
            defs[parts[1]] = parts
    found = []
    for parts in list(defs.values()):
        sub = defs.get(parts[2]) if parts[0].startswith("ex2.approx") else None
        if sub is not None and sub[0].startswith("sub."):
            muls = [defs.get(reg) for reg in sub[2:4]]
            muls = [" ".join(m) for m in muls
                    if m is not None and m[0].startswith("mul.") and ".rn" not in m[0]]
            found.append((" ".join(sub), muls[0] if muls else None))
    return found


@pytest.mark.compile
@pytest.mark.parametrize("kind,head_dim", [("f16", 128), ("bf16", 64)])
def test_rescale_leaves_ptxas_nothing_to_contract(kind, head_dim):
    """The online rescale ``2^(old reference - new reference)`` is exactly 1 while a
    row's max stays only if the old reference is the rounded ``fl(m scale2)`` the
    weights took: a ``mul.f32`` feeding the subtraction is contracted by ptxas into
    ``fma(m, scale2, -fl(m scale2))``, a factor of up to 2^(half an ulp) a tile that
    compounds into the LSE (6.6e-6 at T 4096 on the H200:
    ``validation/prefill_lse_model.py``). The kernel keeps the last tile's reference."""
    rescales = ex2_of_differences(_ptx(kind, head_dim, True))
    assert len(rescales) == 2, rescales  # rows g and g + 8
    assert all(mul is None for _, mul in rescales), rescales


@pytest.mark.compile
def test_defect_switches_change_only_their_kernels():
    clean = _ptx("f16", 16, warps=1, block_n=16)
    assert clean == _ptx("f16", 16, warps=1, block_n=16, defect=None)
    no_trans = _ptx("f16", 16, warps=1, block_n=16, defect="ldmatrix_no_trans")
    assert "x4.trans" not in no_trans and "x4.trans" in clean
    assert no_trans.count("m8n8.x4.shared") > clean.count("m8n8.x4.shared")
    for defect in ("swizzle_off_by_one", "causal_tile_edge"):
        ptx = _ptx("f16", 16, warps=1, block_n=16, defect=defect)
        assert ptx != clean and ".local" not in ptx


# ---------------------------------------------------------------------------
# GPU: the full shape
# ---------------------------------------------------------------------------

def _torch_sdpa(q, k, v, n_heads, n_kv, dtype):
    """torch's all-16-bit SDPA on the same inputs (causal, GQA), out [T, H*D]
    float32, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    t_len, head_dim = q.shape[0], q.shape[1] // n_heads
    tdt = torch.float16 if dtype == F16 else torch.bfloat16

    def tensor(x, heads):
        t = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(tdt).cuda()
        return t.view(t_len, heads, head_dim).transpose(0, 1)[None]  # [1, heads, T, D]

    o = torch.nn.functional.scaled_dot_product_attention(
        tensor(q, n_heads), tensor(k, n_kv), tensor(v, n_kv), is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(t_len, n_heads * head_dim).float().cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_full_shape_matches_the_oracle(dtype):
    """T 4096, H 32, H_kv 8, D 128, causal (GPU defaults: 8 warps, tiles of 64),
    judged on kv groups 0 and 7 (query heads 0-3 and 28-31, every row)."""
    dt = storage_dtype(dtype)
    t_len, n_heads, n_kv, head_dim = 4096, 32, 8, 128
    rng = np.random.default_rng(4096)
    q, k, v = make_qkv(rng, t_len, n_heads, n_kv, head_dim, dt)
    out, lse = run(q, k, v, n_heads, n_kv, True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    group = n_heads // n_kv
    sdpa = _torch_sdpa(q, k, v, n_heads, n_kv, dt)
    for g in (0, n_kv - 1):
        heads = slice(g * group * head_dim, (g + 1) * group * head_dim)
        kv = slice(g * head_dim, (g + 1) * head_dim)
        sub = (q[:, heads], k[:, kv], v[:, kv])
        got = (out[:, heads], lse[g * group:(g + 1) * group])
        check_case(*sub, group, 1, True, got, dt, f"full shape {dtype} kv group {g}")
        if sdpa is not None:
            ref = oracle(*sub, group, 1, True, 1.0 / np.sqrt(head_dim))[0]
            print(f"{dtype} kv group {g}: max err vs oracle: ours "
                  f"{np.abs(got[0] - ref).max():.3e}, torch SDPA "
                  f"{np.abs(sdpa[:, heads] - ref).max():.3e}; 1 - cos: ours "
                  f"{cos_diff(got[0], ref):.2e}, torch {cos_diff(sdpa[:, heads], ref):.2e}")
