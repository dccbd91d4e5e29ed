"""Float32 prefill on tensor cores (``attention.prefill.tf32``): operands split
in tf32 halves (V in three terms), a fresh partial a k step.

The kernel is held to the fused fp32 prefill's rule and baseline, unchanged: a
float32 numpy prefill with q pre-scaled and each score one FMA sum over the head
dim (``validation.baselines.prefill_order``, ``fma/before/recip_after``, the
registry's for both kernels), judged with the float64 oracle
(``attention.oracle.prefill_attention_ref``) by the sweep's rule
(``validation.tolerance.verdict``: NaN / inf where the oracle has them, max error
<= 2x the baseline's + floor, mean error <= 1.5x the baseline's + floor / n), for
out and lse. Checked here:

* on the simulator (``device``) and on a GPU: causal and full attention, GQA, T
  not a multiple of the query or K / V tile, one, two and four warps a block
  (warps whose rows lie past T, a warp skipping the tile above its diagonal),
  K / V tiles of 16, 32 and 64, head dims 8, 16, 40, 64 and 96; T 1 (one
  position: out is V's row); device arrays in and caller-given buffers;
  ``prefill_attention(method="tf32")``;
* one-hot weights (the 'equal' keys of the registry's fixtures give every row
  the same weights; here one key dominates): the output is V's row exactly,
  which the three-term V gives and two tf32 halves would not;
* planted switches (``tf32.SWITCHES``) on a case the clean kernel passes: the
  gross defects and the two one-term precision mutants each fail the rule;
  ``long_partials`` changes the output bits (it acts; whether the rule sees it
  is the sweep's resolving-power table);
* host checks: errors name the argument and the expected shape, dtype or range;
  the tile stride ``D + 4`` gives every fragment load 32 distinct banks;
* compile-only: sm_90 PTX with ``mma.sync...m16n8k8...tf32`` and ``cp.async``,
  P.V written out (``3 or 4 x`` its mmas), no local memory, and (where nvJitLink
  is installed) no spills at D 64 and 128 with 4 warps;
* on a GPU (``gpu``): T 2048, H 16, H_kv 4, D 128, causal, two kv groups judged.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.oracle import prefill_attention_ref
from attention.prefill import tf32
from validation import tolerance
from validation.baselines import prefill_order

BASELINE = "fma/before/recip_after"


def make_qkv(rng, t_len, n_heads, n_kv, head_dim):
    q = rng.standard_normal((t_len, n_heads * head_dim)).astype(np.float32)
    k = rng.standard_normal((t_len, n_kv * head_dim)).astype(np.float32)
    v = rng.standard_normal((t_len, n_kv * head_dim)).astype(np.float32)
    return q, k, v


def verdicts(q, k, v, n_heads, n_kv, causal, got):
    """[(output name, passed, text)] of out and lse under the sweep's rule."""
    ref = prefill_attention_ref(q, k, v, n_heads, n_kv, causal=causal, dtype=np.float64)
    base = prefill_order(q, k, v, n_heads, n_kv, causal, BASELINE)
    return [(name,) + tuple(tolerance.verdict(np.asarray(g), r, b))
            for name, g, r, b in zip(("out", "lse"), got, ref, base)]


def check_case(q, k, v, n_heads, n_kv, causal, got, what):
    for name, ok, text in verdicts(q, k, v, n_heads, n_kv, causal, got):
        assert ok, f"{what} {name}: {text}"
    assert not np.isnan(got[0]).any() and not np.isnan(got[1]).any(), what


def run(q, k, v, n_heads, n_kv, causal, **kw):
    out, lse = tf32.prefill_attention_tf32(q, k, v, n_heads, n_kv, causal=causal, **kw)
    return np.asarray(out), np.asarray(lse)


CASES = [
    # (t_len, n_heads, n_kv, head_dim, causal, warps, block_n)
    # causal GQA over two K / V tiles of 16 (online rescaling), T inside a tile
    (20, 2, 1, 16, True, 1, 16),
    # full attention, D 8 (one k step), three tiles of 16, two warps: the second
    # block's second warp has no row below T
    (37, 1, 1, 8, False, 2, 16),
    # D 40 (five k steps), causal, two warps: warp 0 skips the tile above its diagonal
    (24, 2, 1, 40, True, 2, 16),
    # D 96, tiles of 64 with 19 zero-filled positions, full
    (45, 1, 1, 96, False, 1, 64),
    # the GPU's plan (4 warps, tiles of 32): rows 40 .. 63 of the block lie past T
    (40, 1, 1, 64, True, 4, 32),
    # T 1: out is V's row
    (1, 2, 2, 16, True, 1, 16),
]


@pytest.mark.device
@pytest.mark.parametrize("t_len,n_heads,n_kv,head_dim,causal,warps,block_n", CASES,
                         ids=["causal-gqa-d16", "full-d8-w2", "causal-d40-w2", "full-d96-n64",
                              "gpu-plan-d64", "t1"])
def test_matches_the_oracle(t_len, n_heads, n_kv, head_dim, causal, warps, block_n):
    rng = np.random.default_rng(t_len + head_dim)
    q, k, v = make_qkv(rng, t_len, n_heads, n_kv, head_dim)
    got = run(q, k, v, n_heads, n_kv, causal, warps=warps, block_n=block_n)
    check_case(q, k, v, n_heads, n_kv, causal, got,
               f"T={t_len} H={n_heads}/{n_kv} D={head_dim} causal={causal}")


@pytest.mark.device
def test_one_hot_rows_give_v_exactly():
    """q aligned with one key and scaled far up: every row's weights are one-hot
    (the others underflow), so out must be that key's V row bit for bit; V's
    third split term makes the product by P = 1 exact (two tf32 halves keep 22
    of its 24 bits)."""
    rng = np.random.default_rng(3)
    t_len, head_dim = 17, 16
    k = rng.standard_normal((t_len, head_dim)).astype(np.float32)
    v = rng.standard_normal((t_len, head_dim)).astype(np.float32)
    v[:, 0] = np.float32(1.0) + np.float32(2.0 ** -23) * np.arange(1, t_len + 1)  # low bits set
    q = (k[[0] * t_len] * np.float32(400.0)).astype(np.float32)  # every row: key 0 wins
    out, _ = run(q, k, v, 1, 1, False, warps=1, block_n=16)
    assert np.array_equal(out, v[[0] * t_len]), np.abs(out - v[0]).max()


@pytest.mark.device
def test_device_arrays_given_buffers_and_the_product_entry():
    """Device inputs give device results written into the caller's buffers; and
    ``prefill_attention(method="tf32")`` is the same kernel."""
    from numba import cuda

    from attention.prefill.kernels import prefill_attention

    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, 17, 1, 1, 16)
    d_out = cuda.to_device(np.full((17, 16), np.nan, np.float32))
    d_lse = cuda.to_device(np.full((1, 17), np.nan, np.float32))
    r_out, r_lse = tf32.prefill_attention_tf32(cuda.to_device(q), cuda.to_device(k),
                                               cuda.to_device(v), 1, causal=False, out=d_out,
                                               lse=d_lse, warps=1, block_n=16)
    assert r_out is d_out and r_lse is d_lse
    got = (d_out.copy_to_host(), d_lse.copy_to_host())
    check_case(q, k, v, 1, 1, False, got, "device arrays")
    out, lse = prefill_attention(q, k, v, 1, causal=False, method="tf32", return_lse=True)
    want = run(q, k, v, 1, 1, False)
    assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])


# ---------------------------------------------------------------------------
# planted switches: each fails the rule on a case the clean kernel passes
# ---------------------------------------------------------------------------

_RUNS = {}


def switch_run(defect):
    """Causal, T 33, two query heads on one kv head, D 16, tiles of 16 (rows 0,
    16 and 32 have their diagonal on a tile's first position): (q, k, v, got)."""
    if "case" not in _RUNS:
        _RUNS["case"] = make_qkv(np.random.default_rng(11), 33, 2, 1, 16)
    q, k, v = _RUNS["case"]
    if defect not in _RUNS:
        _RUNS[defect] = run(q, k, v, 2, 1, True, warps=1, block_n=16, defect=defect)
    return q, k, v, _RUNS[defect]


@pytest.mark.device
def test_clean_kernel_passes_the_switch_case():
    q, k, v, got = switch_run(None)
    check_case(q, k, v, 2, 1, True, got, "clean kernel on the switch case")


@pytest.mark.device
@pytest.mark.parametrize("defect", tf32.DEFECTS + ("tf32_single", "no_low_b"))
def test_planted_switch_is_caught(defect):
    q, k, v, got = switch_run(defect)
    failed = [name for name, ok, _ in verdicts(q, k, v, 2, 1, True, got) if not ok]
    assert failed, f"{defect}: passed the rule"
    if defect == "causal_tile_edge":
        # row 0 sees nothing: zeros and LSE -inf, never NaN
        assert np.all(got[0][0] == 0) and got[1][0, 0] == -np.inf
        assert not np.isnan(got[0]).any()


@pytest.mark.device
def test_long_partials_acts():
    """The subtle mutant changes the output bits on the switch case (it is not
    inert); its detection is the sweep's resolving power, not asserted here."""
    _, _, _, clean = switch_run(None)
    _, _, _, mutant = switch_run("long_partials")
    assert not np.array_equal(clean[0], mutant[0])


# ---------------------------------------------------------------------------
# host checks (no kernel runs)
# ---------------------------------------------------------------------------

def _small(t_len=8, n_heads=2, n_kv=1, head_dim=16, dtype=np.float32):
    q = np.zeros((t_len, n_heads * head_dim), dtype)
    k = np.zeros((t_len, n_kv * head_dim), dtype)
    return q, k, k.copy()


def test_bad_inputs_are_named():
    q, k, v = _small()
    call = tf32.prefill_attention_tf32
    with pytest.raises(checks.DTypeError, match="q: expected dtype float32"):
        call(q.astype(np.float16), k, v, 2, 1)
    with pytest.raises(checks.DTypeError, match="v: expected dtype float32"):
        call(q, k, v.astype(np.float16), 2, 1)
    with pytest.raises(checks.ShapeError, match=r"k: expected shape \[T=8, H_kv\*D=1\*16"):
        call(q, k[:7], v, 2, 1)
    with pytest.raises(checks.RangeError, match="q: expected head_dim D a multiple of 8"):
        call(*_small(head_dim=12), 2, 1)
    with pytest.raises(checks.RangeError, match=r"q: expected head_dim in \[1, 256\]"):
        call(*_small(head_dim=264), 2, 1)
    with pytest.raises(checks.RangeError, match="n_kv_heads: H_kv=3 must divide"):
        call(*_small(n_kv=3), 2, 3)
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
    out, lse = tf32.prefill_attention_tf32(*_small(t_len=0), 2, 1)
    assert out.shape == (0, 32) and lse.shape == (2, 0)


def test_default_tiles_fit_the_shared_memory():
    """D <= 128: two blocks of 4 warps an SM (227 KB); D 256: one."""
    if tf32.SIMULATOR:
        pytest.skip("the simulator's default tile is 16 (its plan); the GPU's are checked "
                    "in the plain process")
    assert tf32.default_block_n(128) == 32 and tf32.default_block_n(256) == 16
    assert 2 * 4 * tf32.smem_words(128, 4, 32) <= 227 * 1024
    assert 4 * tf32.smem_words(256, 4, 16) <= 227 * 1024


@pytest.mark.parametrize("head_dim", [8, 16, 40, 64, 80, 96, 128, 256])
def test_fragment_loads_hit_32_distinct_banks(head_dim):
    """Rows of ``D + 4`` words: the A / K-fragment words ``x[g][k + t]`` and the
    V-fragment words ``x[2 t (+1)][n + g]`` of the 32 lanes fall on 32 banks."""
    ws = tf32.row_words(head_dim)
    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    for col in (0, 4):
        assert len({(g * ws + t + col) % 32 for g, t in lanes}) == 32
    for row in (0, 1):
        assert len({((2 * t + row) * ws + g) % 32 for g, t in lanes}) == 32


# ---------------------------------------------------------------------------
# compile-only: PTX and ptxas
# ---------------------------------------------------------------------------

_PTX = {}


def _ptx(head_dim, causal=True, warps=4, block_n=None, defect=None):
    from numba import cuda, types

    f32, arr = types.float32, types.Array
    sig = (arr(f32, 1, "C"), arr(f32, 1, "C"), arr(f32, 1, "C"), types.int32, types.int32,
           f32, arr(f32, 2, "C"), arr(f32, 2, "C"))
    key = (head_dim, causal, warps, block_n, defect)
    if key not in _PTX:
        kern = tf32.prefill_tf32_kernel(head_dim, causal, warps, block_n, defect)
        _PTX[key] = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), fastmath=True)[0]
    return _PTX[key]


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,block_n", [(64, 32), (128, 32)])
def test_compiles_to_tf32_mma_and_cp_async_without_spills(head_dim, block_n):
    from tests.test_prefill_mma import _ptxas_report, spill_bytes

    ptx = _ptx(head_dim, block_n=block_n)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group 1" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, "local memory"
    # P V written out: BN/8 k steps x D/8 n tiles x 4 mmas (V in three terms);
    # S's k-step loop may stay a loop (at least one step: BN/8 n tiles x 3)
    pv = block_n // 8 * head_dim // 8 * 4
    assert ptx.count("mma.sync.aligned.m16n8k8") >= pv + 3 * block_n // 8
    report = _ptxas_report(ptx)
    if report is not None:
        assert spill_bytes(report) == 0, report


@pytest.mark.compile
def test_switches_change_only_their_kernels():
    clean = _ptx(16, warps=1, block_n=16)
    assert clean == _ptx(16, warps=1, block_n=16, defect=None)
    counts = {d: _ptx(16, warps=1, block_n=16, defect=d).count("mma.sync") for d in
              tf32.SWITCHES}
    n = clean.count("mma.sync")
    assert counts["tf32_single"] < counts["no_low_b"] < n  # 1 and 2 terms (S), 1 / 2 (PV)
    for d in ("long_partials", "pv_rows_unpermuted", "causal_tile_edge"):
        ptx = _ptx(16, warps=1, block_n=16, defect=d)
        assert ptx != clean and ".local" not in ptx, d


# ---------------------------------------------------------------------------
# GPU: a larger shape
# ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_large_shape_matches_the_oracle():
    """T 2048, H 16, H_kv 4, D 128, causal (GPU defaults: 4 warps, tiles of 32),
    judged on kv groups 0 and 3 (every row)."""
    t_len, n_heads, n_kv, head_dim = 2048, 16, 4, 128
    q, k, v = make_qkv(np.random.default_rng(2048), t_len, n_heads, n_kv, head_dim)
    out, lse = run(q, k, v, n_heads, n_kv, True)
    group = n_heads // n_kv
    for g in (0, n_kv - 1):
        heads = slice(g * group * head_dim, (g + 1) * group * head_dim)
        kv = slice(g * head_dim, (g + 1) * head_dim)
        check_case(q[:, heads], k[:, kv], v[:, kv], group, 1, True,
                   (out[:, heads], lse[g * group:(g + 1) * group]), f"kv group {g}")
