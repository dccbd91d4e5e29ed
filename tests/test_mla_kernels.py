"""MLA kernels: compile-only PTX, bad input, and parity gates 1-3.

Processes (see tests/conftest.py):
* plain: ``compile`` tests (PTX for every kernel, cc 9.0, no GPU), bad-input
  tests (validation raises before any copy or launch), the d_rope 0 no-launch test;
* simulator: ``device`` tests at the small shapes, with 8-row attention tiles
  so that 11 positions span two tiles (the online-softmax merge is exercised);
* GPU: the same ``device`` tests with the default tile plan, plus the ``gpu``
  tests at both presets (128 heads x 576 latent and 64 heads x 512 latent are
  far beyond what the simulator can afford) and the full-size batched decode.

Tolerance (gates 1, 2): ``mla.oracle.tolerance`` — the kernel's error against
each float64 oracle must be at most twice the error of a float32 numpy
implementation of the same absorbed math (``mla_attend_float32``) against the
naive float64 oracle, plus one float32 rounding floor ``sqrt(k) eps32 |ref|``
for the kernels' sequential length-k sums (numpy's pairwise sums round less).
RoPE (gate 3): twice the float32-angle baseline's error plus 4 eps32 |ref|
(the kernel rotates in float64 and rounds once per element).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla import kernels as K
from mla import oracle
from mla.dims import DEEPSEEK_V3, NOPE_64x256, SMALL_SHAPES
from tests.conftest import small
from validation import suite_mla
from validation.suite_mla import make_case, parity

SIM_TILE = 8 if small() else None  # simulator: force several tiles at small t_kv
SEEDS = (7, 1234, 0xB1E55ED)


def _ids(d):
    return f"nh{d.n_head}_dn{d.d_nope}_p{d.d_rope}_v{d.d_v}_r{d.kv_rank}"


def _assert_parity(got, args, label, naive=True):
    p = parity(got, args, naive=naive)
    assert p["finite"], f"{label}: non-finite output"
    assert p["ok"], (f"{label}: err naive {p['err_naive']:.3e} absorbed {p['err_absorbed']:.3e} "
                     f"> tol {p['tol']:.3e} (baseline {p['baseline_err']:.3e}), worst at "
                     f"[t, h, j]={p['where']}")
    assert np.abs(np.asarray(got)).max() > 1e-3, f"{label}: degenerate (all ~0) output"
    return p


# ---------------------------------------------------------------------------
# compile-only (plain process, no GPU)
# ---------------------------------------------------------------------------

def _sig_types():
    from numba import types

    def arr(t, n):
        return types.Array(t, n, "C")

    return types, arr


@pytest.mark.compile
@pytest.mark.parametrize("layout", K.W_UK_LAYOUTS)
@pytest.mark.parametrize("defect", [None, "w_uk_transposed"])
def test_compile_absorb_q(layout, defect):
    from numba import cuda
    types, arr = _sig_types()
    f32 = types.float32
    ptx, _ = cuda.compile_ptx(K.absorb_q_kernel(layout, defect).py_func,
                              (arr(f32, 3), arr(f32, 3), arr(f32, 3)), cc=(9, 0))
    assert ".entry" in ptx and "fma.rn.f32" in ptx and "shfl" not in ptx


@pytest.mark.compile
def test_compile_decompress_v():
    from numba import cuda
    types, arr = _sig_types()
    f32 = types.float32
    ptx, _ = cuda.compile_ptx(K.decompress_v_kernel().py_func,
                              (arr(f32, 3), arr(f32, 3), arr(f32, 3)), cc=(9, 0))
    assert ".entry" in ptx and "fma.rn.f32" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("defect", [None, "append_one_row_late"])
def test_compile_append_latent(dtype, defect):
    from numba import cuda
    types, arr = _sig_types()
    dt, i32 = getattr(types, dtype), types.int32
    ptx, _ = cuda.compile_ptx(K.append_latent_kernel(defect).py_func,
                              (arr(dt, 3), i32, i32, arr(dt, 2), arr(dt, 2), arr(i32, 1)),
                              cc=(9, 0))
    assert ".entry" in ptx
    # a copy: no arithmetic on the data (bit-exact)
    assert "cvt.f32.f16" not in ptx and "cvt.rn.f16.f32" not in ptx


@pytest.mark.compile
@pytest.mark.parametrize("defect", [None, "rope_pairs_swapped"])
def test_compile_rope(defect):
    from numba import cuda
    types, arr = _sig_types()
    ptx, _ = cuda.compile_ptx(K.rope_kernel(defect).py_func,
                              (arr(types.float32, 3), arr(types.int32, 1), types.float64),
                              cc=(9, 0))
    assert ".entry" in ptx and "cvt.rn.f32.f64" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("dims,cache_dtype", [
    (SMALL_SHAPES[1], "float32"), (DEEPSEEK_V3, "float32"), (DEEPSEEK_V3, "float16"),
    (NOPE_64x256, "float32")], ids=lambda v: v if isinstance(v, str) else _ids(v))
def test_compile_attn_absorbed(dims, cache_dtype):
    from numba import cuda
    types, arr = _sig_types()
    f32, i32 = types.float32, types.int32
    tile, hg = K.plan_blocks(dims.n_head, dims.latent_width)
    assert K.shared_bytes(dims.latent_width, tile, hg) <= K.SHARED_BYTES
    ptx, _ = cuda.compile_ptx(
        K.attn_absorbed_kernel(dims.kv_rank, dims.d_rope, tile, hg).py_func,
        (arr(f32, 3), arr(f32, 3), arr(getattr(types, cache_dtype), 3), arr(i32, 1),
         arr(i32, 1), arr(i32, 1), f32, arr(f32, 3), arr(f32, 2)), cc=(9, 0))
    assert "shfl.sync.bfly.b32" in ptx  # warp_max / warp_sum of attention.core.warp
    assert "bar.sync" in ptx and "bar.warp.sync" in ptx
    assert ".shared" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("defect", K.ATTN_DEFECTS)
def test_compile_attn_defects(defect):
    from numba import cuda
    types, arr = _sig_types()
    f32, i32 = types.float32, types.int32
    ptx, _ = cuda.compile_ptx(
        K.attn_absorbed_kernel(64, 8, 8, 4, defect).py_func,
        (arr(f32, 3), arr(f32, 3), arr(f32, 3), arr(i32, 1), arr(i32, 1), arr(i32, 1), f32,
         arr(f32, 3), arr(f32, 2)), cc=(9, 0))
    assert ".entry" in ptx


def test_block_plan():
    # presets: 16-row tiles with 4 heads per block fit the 48 KB of static shared memory
    assert K.plan_blocks(128, 576) == (16, 4)
    assert K.plan_blocks(64, 512) == (16, 4)
    assert K.plan_blocks(3, 52) == (32, 3)
    with pytest.raises(checks.RangeError, match="tile"):
        K.plan_blocks(128, 576, tile=32)
    with pytest.raises(checks.RangeError, match="tile"):
        K.plan_blocks(4, 72, tile=12)


# ---------------------------------------------------------------------------
# bad input (plain process: every error is raised before any copy or launch)
# ---------------------------------------------------------------------------

def _small_args(t_q=3, t_kv=5):
    return list(make_case(SMALL_SHAPES[0], t_q, t_kv, seed=1))


@pytest.mark.parametrize("mutate,error,name", [
    (lambda a: a.__setitem__(4, a[4][:, :-1].copy()), checks.ShapeError, "w_uk"),
    (lambda a: a.__setitem__(1, a[1][:, :2].copy()), checks.ShapeError, "q_pe"),
    (lambda a: a.__setitem__(1, a[1][:, :, :3].copy()), checks.RangeError, "q_pe"),
    (lambda a: a.__setitem__(2, a[2][:, :-1].copy()), checks.ShapeError, "c_kv"),
    (lambda a: a.__setitem__(3, a[3][:-1]), checks.ShapeError, "k_pe"),
    (lambda a: a.__setitem__(3, a[3].astype(np.float16)), checks.DTypeError, "k_pe"),
    (lambda a: a.__setitem__(4, a[4].astype(np.float64)), checks.DTypeError, "w_uk"),
    (lambda a: a.__setitem__(5, a[5][:, :, :-2].copy()), checks.ShapeError, "w_uv"),
    (lambda a: a.__setitem__(0, np.asfortranarray(a[0])), checks.LayoutError, "q_nope"),
    (lambda a: a.__setitem__(2, a[2][:2]) or a.__setitem__(3, a[3][:2]), checks.RangeError,
     "t_q"),
])
def test_mla_attend_bad_input(mutate, error, name):
    from mla.pipeline import mla_attend

    args = _small_args()
    mutate(args)
    with pytest.raises(error, match=name):
        mla_attend(*args)


def test_mla_attend_bad_scale_and_defect():
    from mla.pipeline import mla_attend

    with pytest.raises(checks.RangeError, match="scale"):
        mla_attend(*_small_args(), scale=-1.0)
    with pytest.raises(ValueError, match="defect"):
        mla_attend(*_small_args(), defect="no_such_defect")
    with pytest.raises(checks.AttentionInputError, match="w_uk_layout"):
        mla_attend(*_small_args(), w_uk_layout="columns")


def test_append_latent_bad_input_leaves_cache_untouched():
    cache = np.full((6, 72), 7.0, np.float32)
    before = cache.copy()
    c_kv, k_pe = np.ones((4, 64), np.float32), np.ones((4, 8), np.float32)
    with pytest.raises(checks.RangeError, match="overflow"):
        K.append_latent(cache, c_kv, k_pe, 3)
    with pytest.raises(checks.ShapeError, match="k_pe"):
        K.append_latent(cache, c_kv, k_pe[:, :4], 0)
    with pytest.raises(checks.DTypeError, match="c_kv"):
        K.append_latent(cache, c_kv.astype(np.float16), k_pe, 0)
    with pytest.raises(checks.RangeError, match="lo"):
        K.append_latent(cache, c_kv, k_pe, -1)
    with pytest.raises(checks.RangeError, match="plane"):
        K.append_latent(cache[None], c_kv, k_pe, 0, plane=1)
    np.testing.assert_array_equal(cache, before)


def test_attn_and_decode_bad_input():
    from mla.pipeline import mla_decode

    q_lat = np.zeros((2, 4, 64), np.float32)
    q_pe = np.zeros((2, 4, 8), np.float32)
    latent = np.zeros((10, 72), np.float32)
    with pytest.raises(checks.RangeError, match="t_kv"):
        K.attn_absorbed(q_lat, q_pe, latent, 11, 0.1)
    with pytest.raises(checks.RangeError, match="t_kv"):
        K.attn_absorbed(q_lat, q_pe, latent, 1, 0.1)  # t_kv < t_q
    with pytest.raises(checks.ShapeError, match="latent"):
        K.attn_absorbed(q_lat, q_pe, latent[:, :70], 5, 0.1)
    args = make_case(SMALL_SHAPES[0], 2, 1, seed=0)
    cache = np.zeros((2, 10, 72), np.float32)
    with pytest.raises(checks.RangeError, match="lengths"):
        mla_decode(args[0], args[1], cache, [3, 11], args[4], args[5])
    with pytest.raises(checks.ShapeError, match="lengths"):
        mla_decode(args[0], args[1], cache, [3], args[4], args[5])
    with pytest.raises(checks.ShapeError, match="latent_cache"):
        mla_decode(args[0], args[1], cache[:1], [3, 4], args[4], args[5])
    with pytest.raises(checks.DTypeError, match="latent_cache"):
        mla_decode(args[0], args[1], cache.astype(np.float64), [3, 4], args[4], args[5])


def test_rope_bad_input():
    x = np.zeros((3, 2, 8), np.float32)
    with pytest.raises(checks.ShapeError, match="positions"):
        K.rope_interleaved(x, [0, 1])
    with pytest.raises(checks.RangeError, match="positions"):
        K.rope_interleaved(x, [0, -1, 2])
    with pytest.raises(checks.RangeError, match="d_rope"):
        K.rope_interleaved(np.zeros((3, 2, 7), np.float32), [0, 1, 2])
    with pytest.raises(checks.DTypeError, match="x"):
        K.rope_interleaved(x.astype(np.float64), [0, 1, 2])
    with pytest.raises(checks.RangeError, match="base"):
        K.rope_interleaved(x, [0, 1, 2], base=0.0)


def test_rope_d_rope_zero_launches_nothing(monkeypatch):
    """NoPE contract: d_rope 0 is a no-op, never a zero-extent launch (runs with no GPU)."""
    def no_launch(*a, **k):
        raise AssertionError("rope_interleaved launched a kernel for d_rope 0")

    monkeypatch.setattr(K, "rope_kernel", no_launch)
    x = np.zeros((3, 4, 0), np.float32)
    assert K.rope_interleaved(x, [0, 1, 2]) is x
    # positive control: the patched factory is the one a d_rope 8 call would use
    with pytest.raises(AssertionError, match="launched"):
        K.rope_interleaved(np.zeros((3, 4, 8), np.float32), [0, 1, 2])


def test_unknown_defects_rejected():
    with pytest.raises(ValueError, match="defect"):
        K.attn_absorbed_kernel(64, 8, 8, 4, "w_uk_transposed")
    with pytest.raises(ValueError, match="defect"):
        K.absorb_q_kernel("mla", "stuck_rescale")


# ---------------------------------------------------------------------------
# gate 1: prefill parity (pure and chunked) against both oracles
# ---------------------------------------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("dims", SMALL_SHAPES, ids=_ids)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("t_q,t_kv", [(4, 4), (2, 10)], ids=["pure", "chunked"])
def test_prefill_parity_small(dims, seed, t_q, t_kv):
    from mla.pipeline import mla_attend

    args = make_case(dims, t_q, t_kv, seed)
    got = mla_attend(*args, tile=SIM_TILE)
    assert got.shape == (t_q, dims.n_head, dims.d_v) and got.dtype == np.float32
    _assert_parity(got, args, f"{dims} t_q {t_q} t_kv {t_kv} seed {seed}")


@pytest.mark.device
@pytest.mark.gpu
@pytest.mark.parametrize("dims", [DEEPSEEK_V3, NOPE_64x256], ids=_ids)
@pytest.mark.parametrize("t_q,t_kv,seed", [(4, 4, 27), (3, 9, 28), (17, 17, 29)])
def test_prefill_parity_presets(dims, t_q, t_kv, seed):
    from mla.pipeline import mla_attend

    args = make_case(dims, t_q, t_kv, seed)
    _assert_parity(mla_attend(*args), args, f"{dims} t_q {t_q} t_kv {t_kv}")


@pytest.mark.device
def test_checkpoint_layout_is_bit_identical():
    """absorb_q reading attn_k_b [nh, r, d_nope] directly == the mla layout, bit for bit."""
    from mla.pipeline import mla_attend

    args = list(make_case(SMALL_SHAPES[1], 3, 7, seed=3))
    want = mla_attend(*args, tile=SIM_TILE)
    ckpt = K.w_uk_to_checkpoint(args[4])
    q_lat_mla = K.absorb_q(args[0], args[4])
    q_lat_ckpt = K.absorb_q(args[0], ckpt, w_uk_layout="checkpoint")
    np.testing.assert_array_equal(q_lat_ckpt, q_lat_mla)
    args[4] = ckpt
    np.testing.assert_array_equal(mla_attend(*args, tile=SIM_TILE, w_uk_layout="checkpoint"),
                                  want)
    # positive control: the checkpoint array read as the mla layout is rejected by shape
    with pytest.raises(checks.ShapeError, match="w_uk"):
        mla_attend(*args)


@pytest.mark.device
def test_prefill_fp16_latent_rows():
    """float16 c_kv / k_pe: the latent rows are stored in float16, accumulation is
    fp32, so the result matches the oracle on the float16 values themselves."""
    from mla.pipeline import mla_attend

    args = list(make_case(SMALL_SHAPES[0], 2, 10, seed=15))
    args[2], args[3] = args[2].astype(np.float16), args[3].astype(np.float16)
    got = mla_attend(*args, tile=SIM_TILE)
    _assert_parity(got, [a.astype(np.float32) for a in args], "fp16 latent rows")


@pytest.mark.device
def test_explicit_scale_and_device_arrays():
    """A caller's scale (e.g. DeepSeek's mscale^2 factor) is honoured; device inputs
    give device outputs."""
    from attention.core.device import to_device, to_host
    from mla.pipeline import mla_attend

    dims = SMALL_SHAPES[0]
    args = make_case(dims, 2, 6, seed=9)
    scale = 1.7 * dims.scale()
    d_out = mla_attend(*[to_device(a) for a in args], scale=scale, tile=SIM_TILE)
    assert not isinstance(d_out, np.ndarray)
    got = to_host(d_out)
    p = parity(got, args, scale=scale)
    assert p["ok"], p
    assert not parity(got, args)["ok"]  # positive control: the default scale differs


# ---------------------------------------------------------------------------
# gate 2: stepwise decode through the real latent cache
# ---------------------------------------------------------------------------

def _decode_dims():
    shapes = [SMALL_SHAPES[0], SMALL_SHAPES[2]]
    if not small():
        shapes += [DEEPSEEK_V3, NOPE_64x256]
    return shapes


@pytest.mark.device
@pytest.mark.parametrize("dims", _decode_dims(), ids=_ids)
def test_decode_stepwise_through_cache(dims):
    from mla.cache import LatentCache
    from mla.pipeline import mla_decode_step

    prefill, steps = 5, 4
    total = prefill + steps
    # one case holds the whole context; each step reads its own query out of it
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = make_case(dims, total, total, seed=0x57E9 + total)
    rows = oracle.latent_rows_ref(c_kv, k_pe)
    cache = LatentCache(2, total + 3, dims)  # two planes: the other one must stay empty
    cache.append(1, c_kv[:prefill], k_pe[:prefill])
    # bit-exact against the host layout, and the unused rows are still NaN
    plane = cache.rows(1)
    np.testing.assert_array_equal(plane.view(np.uint32), rows[:prefill].view(np.uint32))
    from attention.core.device import to_host
    full = to_host(cache.buffer)
    assert np.isnan(full[1, prefill:]).all() and np.isnan(full[0]).all()
    assert cache.lengths == [0, prefill] and cache.in_step()

    for step in range(steps):
        pos = prefill + step
        cache.append(1, c_kv[pos:pos + 1], k_pe[pos:pos + 1])
        got = mla_decode_step(q_nope[pos], q_pe[pos], cache, 1, w_uk, w_uv)
        assert got.shape == (dims.n_head, dims.d_v)
        # oracle: full-sequence recompute over positions 0..pos, the last query
        args = (q_nope[pos:pos + 1], q_pe[pos:pos + 1], c_kv[:pos + 1], k_pe[:pos + 1],
                w_uk, w_uv)
        _assert_parity(got[None], args, f"decode step {step} (t_kv {pos + 1}) {dims}")
    assert cache.lengths == [0, total] and cache.in_step()


@pytest.mark.device
def test_cache_overflow_raises_before_writing():
    from mla.cache import LatentCache

    dims = SMALL_SHAPES[1]
    cache = LatentCache(1, 4, dims)
    _, _, c_kv, k_pe, _, _ = make_case(dims, 1, 5, seed=2)
    cache.append(0, c_kv[:3], k_pe[:3])
    before = cache.rows(0).copy()
    with pytest.raises(checks.RangeError, match="overflow"):
        cache.append(0, c_kv[3:5], k_pe[3:5])
    assert cache.lengths == [3] and cache.in_step()
    np.testing.assert_array_equal(cache.rows(0), before)
    cache.append(0, c_kv[3:4], k_pe[3:4])  # exactly full is fine
    assert cache.lengths == [4] and cache.in_step()


# ---------------------------------------------------------------------------
# batched decode (the benchmark entry point), empty sequences, fp16 cache
# ---------------------------------------------------------------------------

def _batched_case(dims, lengths, max_seq, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    n_b = len(lengths)
    q_nope, q_pe, _, _, w_uk, w_uv = make_case(dims, n_b, 1, seed)
    latent = rng.standard_normal((n_b, max_seq, dims.latent_width)).astype(dtype)
    for b, n in enumerate(lengths):
        latent[b, n:] = np.nan  # rows past a sequence's length must never be read
    return q_nope, q_pe, latent, np.asarray(lengths), w_uk, w_uv


def _check_batched(dims, got, q_nope, q_pe, latent, lengths, w_uk, w_uv, which, naive=True):
    r = dims.kv_rank
    for b in which:
        n = int(lengths[b])
        rows = latent[b, :n].astype(np.float32)
        if n == 0:
            np.testing.assert_array_equal(got[b], 0.0)
            continue
        args = (q_nope[b:b + 1], q_pe[b:b + 1], rows[:, :r], rows[:, r:], w_uk, w_uv)
        _assert_parity(got[b:b + 1], args, f"sequence {b} (length {n})", naive=naive)


@pytest.mark.device
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_mla_decode_batched_small(dtype):
    from mla.pipeline import mla_decode

    dims = SMALL_SHAPES[0]
    case = _batched_case(dims, [0, 5, 11], 12, seed=21, dtype=dtype)
    got = mla_decode(*case, tile=SIM_TILE)
    assert got.shape == (3, dims.n_head, dims.d_v) and np.isfinite(got).all()
    _check_batched(dims, got, *case, which=range(3))


@pytest.mark.device
def test_attn_empty_sequence_gives_zeros_and_neg_inf_lse():
    dims = SMALL_SHAPES[2]
    rng = np.random.default_rng(0)
    q_lat = rng.standard_normal((2, dims.n_head, dims.kv_rank)).astype(np.float32)
    q_pe = np.zeros((2, dims.n_head, 0), np.float32)
    latent = np.full((2, 4, dims.latent_width), np.nan, np.float32)
    latent[1, :2] = 1.0
    o_lat, lse = K.attn_absorbed_batched(q_lat, q_pe, latent, [0, 2], 0.2, return_lse=True)
    np.testing.assert_array_equal(o_lat[0], 0.0)
    assert np.isneginf(lse[0]).all()
    np.testing.assert_allclose(o_lat[1], 1.0, rtol=1e-6)  # two equal rows average to 1
    assert np.isfinite(lse[1]).all()


@pytest.mark.device
@pytest.mark.gpu
def test_mla_decode_full_size():
    """B 64, DeepSeek-V3 heads (128 x 512 + 64 latent), L up to 4096, fp32 cache;
    sequences 0 (empty), 1 (full), and two others checked against the oracle."""
    from mla.pipeline import mla_decode

    dims, n_b, max_seq = DEEPSEEK_V3, 64, 4096
    rng = np.random.default_rng(64)
    lengths = rng.integers(1, max_seq + 1, n_b)
    lengths[0], lengths[1], lengths[17] = 0, max_seq, 17
    case = _batched_case(dims, lengths, max_seq, seed=64)
    got = mla_decode(*case)
    assert np.isfinite(got).all()
    # the absorbed oracle only: the naive one would decompress 4096 rows x 128 heads
    _check_batched(dims, got, *case, which=(0, 1, 17, 63), naive=False)


# ---------------------------------------------------------------------------
# gate 3: RoPE
# ---------------------------------------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("d_rope", [8, 64])
def test_rope_parity(d_rope):
    rng = np.random.default_rng(0x0DE2026)
    n_pos, n_vec = 7, 5
    host = rng.standard_normal((n_pos, n_vec, d_rope)).astype(np.float32)
    positions = np.arange(n_pos) * 13
    want = oracle.rope_interleaved_ref(host, positions)
    base_err = np.abs(oracle.rope_interleaved_float32(host, positions) - want).max()
    tol = 2 * base_err + 4 * oracle.F32_EPS * max(1.0, np.abs(want).max())
    x = host.copy()
    assert K.rope_interleaved(x, positions) is x  # in place
    err = np.abs(x - want).max()
    assert err <= tol, f"d_rope {d_rope}: err {err:.3e} > tol {tol:.3e}"
    np.testing.assert_array_equal(x[0], host[0])  # position 0 is the identity
    # positive control: the planted half-split pairing misses by far more than tol
    y = K.rope_interleaved(host.copy(), positions, defect="rope_pairs_swapped")
    assert np.abs(y - want).max() > 1e3 * tol


@pytest.mark.device
def test_rope_d_rope_zero_untouched_and_2d_input():
    x = np.zeros((3, 0), np.float32)
    assert K.rope_interleaved(x, [0, 1, 2]).shape == (3, 0)
    k_pe = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    want = oracle.rope_interleaved_ref(k_pe, [3, 4, 5, 6])
    got = K.rope_interleaved(k_pe.copy(), [3, 4, 5, 6])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------
# the falsification suite: clean passes, every planted defect is caught
# ---------------------------------------------------------------------------

def test_suite_contract():
    assert suite_mla.FAMILY == "mla"
    assert {"rope_pairs_swapped", "w_uk_transposed", "append_one_row_late",
            "causal_offset_off_by_one"} <= set(suite_mla.DEFECTS)
    assert set(suite_mla.DEFECTS) <= set(K.KERNEL_DEFECTS)
    with pytest.raises(ValueError, match="defect"):
        suite_mla.run_suite("no_such_defect")


# the simulator runs the clean suite and the defect only a multi-tile softmax
# exposes (about 8 s each); the validation runner covers the others there
SUITE_RUNS = (None, "stuck_rescale") if small() else (None,) + suite_mla.DEFECTS


@pytest.mark.device
@pytest.mark.parametrize("defect", SUITE_RUNS)
def test_suite_clean_and_catches(defect):
    from validation.suite import caught
    from validation.suite_mla import run_suite

    results = run_suite(defect, small=small())
    assert results
    if defect is None:
        assert not caught(results), [c for c in results if not c.passed]
    else:
        assert caught(results)
