"""MLA references (mla/oracle.py) and geometry (mla/dims.py): plain process, no kernels.

The two oracle forms are independent computations of the same attention (the
naive one decompresses keys and values, the absorbed one never does), so their
float64 agreement checks both; the causal rule is checked by perturbing rows a
query must (and must not) see; RoPE against hand-rotated pairs.
"""

from __future__ import annotations

import numpy as np
import pytest

from mla import oracle
from mla.dims import DEEPSEEK_V3, NOPE_64x256, SMALL_SHAPES, MlaDims
from validation.suite_mla import make_case  # unit-scale inputs, weights ~ 1/sqrt(r)


def test_presets_and_small_shapes():
    assert (DEEPSEEK_V3.n_head, DEEPSEEK_V3.d_nope, DEEPSEEK_V3.d_rope, DEEPSEEK_V3.d_v,
            DEEPSEEK_V3.kv_rank) == (128, 128, 64, 128, 512)
    assert DEEPSEEK_V3.latent_width == 576
    assert (NOPE_64x256.n_head, NOPE_64x256.d_nope, NOPE_64x256.d_rope, NOPE_64x256.d_v,
            NOPE_64x256.kv_rank) == (64, 256, 0, 256, 512)
    assert NOPE_64x256.latent_width == 512
    assert [tuple(vars(d).values()) for d in SMALL_SHAPES] == [
        (4, 24, 8, 32, 64), (3, 12, 4, 20, 48), (4, 32, 0, 32, 64)]
    assert DEEPSEEK_V3.scale() == pytest.approx(1 / np.sqrt(192))
    with pytest.raises(Exception):
        DEEPSEEK_V3.n_head = 1  # frozen
    with pytest.raises(ValueError, match="d_rope"):
        MlaDims(4, 8, 3, 8, 16)
    with pytest.raises(ValueError, match="kv_rank"):
        MlaDims(4, 8, 2, 8, 0)


@pytest.mark.parametrize("dims", SMALL_SHAPES,
                         ids=lambda d: f"nh{d.n_head}_r{d.kv_rank}_p{d.d_rope}")
@pytest.mark.parametrize("t_q,t_kv", [(6, 6), (3, 11), (1, 7)])
def test_naive_equals_absorbed(dims, t_q, t_kv):
    args = make_case(dims, t_q, t_kv, seed=11)
    naive, lse_n = oracle.mla_attend_naive(*args, return_lse=True)
    absorbed, lse_a = oracle.mla_attend_absorbed(*args, return_lse=True)
    assert naive.shape == (t_q, dims.n_head, dims.d_v) and naive.dtype == np.float64
    # float64, two association orders of the same sums: agreement at 1e-12
    np.testing.assert_allclose(naive, absorbed, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse_n, lse_a, rtol=0, atol=1e-12)
    # positive control: a different scale changes the result far beyond that
    other = oracle.mla_attend_absorbed(*args, scale=2 * dims.scale())
    assert np.abs(other - naive).max() > 1e-3


def test_causal_rule_chunked():
    """Query i of t_q sees positions <= t_kv - t_q + i, and nothing later."""
    dims = SMALL_SHAPES[0]
    t_q, t_kv = 3, 9
    args = list(make_case(dims, t_q, t_kv, seed=5))
    base = oracle.mla_attend_naive(*args)
    for pos in range(t_kv):
        bumped = [a.copy() for a in args]
        bumped[2][pos] += 1.0  # c_kv row pos
        bumped[3][pos] += 1.0  # k_pe row pos
        out = oracle.mla_attend_absorbed(*bumped)
        for i in range(t_q):
            changed = np.abs(out[i] - base[i]).max() > 1e-9
            assert changed == (pos <= t_kv - t_q + i), (pos, i)


def test_decode_is_last_row_of_prefill():
    dims = SMALL_SHAPES[1]
    args = make_case(dims, 7, 7, seed=2)
    full = oracle.mla_attend_naive(*args)
    last = oracle.mla_attend_naive(args[0][-1:], args[1][-1:], *args[2:])
    np.testing.assert_allclose(last[0], full[-1], rtol=0, atol=1e-13)


def test_float32_baseline_is_close_but_not_exact():
    dims = SMALL_SHAPES[0]
    args = make_case(dims, 4, 9, seed=3)
    ref = oracle.mla_attend_naive(*args)
    base = oracle.mla_attend_float32(*args)
    err = np.abs(base - ref).max()
    assert 0 < err < 1e-5  # float32 rounding, not a different computation


def test_rope_ref_rotates_interleaved_pairs():
    rng = np.random.default_rng(0)
    d_rope, base = 8, 10000.0
    x = rng.standard_normal((3, 2, d_rope))
    positions = np.array([0, 5, 130])
    got = oracle.rope_interleaved_ref(x, positions, base)
    np.testing.assert_array_equal(got[0], x[0])  # position 0: identity
    for p in range(3):
        for v in range(2):
            for i in range(d_rope // 2):
                ang = positions[p] * base ** (-2 * i / d_rope)
                x0, x1 = x[p, v, 2 * i], x[p, v, 2 * i + 1]
                assert got[p, v, 2 * i] == pytest.approx(x0 * np.cos(ang) - x1 * np.sin(ang))
                assert got[p, v, 2 * i + 1] == pytest.approx(x0 * np.sin(ang) + x1 * np.cos(ang))
    # pair norms are preserved; a half-split pairing would not preserve these
    np.testing.assert_allclose(got[..., 0::2] ** 2 + got[..., 1::2] ** 2,
                               x[..., 0::2] ** 2 + x[..., 1::2] ** 2, rtol=1e-12)
    # d_rope 0: nothing to rotate
    empty = np.zeros((2, 0))
    assert oracle.rope_interleaved_ref(empty, [1, 2]).shape == (2, 0)


def test_rope_float32_baseline():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 5, 64)).astype(np.float32)
    pos = np.arange(7) * 13
    err = np.abs(oracle.rope_interleaved_float32(x, pos) - oracle.rope_interleaved_ref(x, pos))
    assert 0 < err.max() < 1e-4


def test_w_uk_checkpoint_layout_and_conversion():
    """attn_k_b [nh, r, d_nope]: element (h, l, p) is w_uk[h, p, l]."""
    from mla.kernels import w_uk_from_checkpoint, w_uk_to_checkpoint

    rng = np.random.default_rng(4)
    w_uk = rng.standard_normal((3, 12, 48)).astype(np.float32)
    ckpt = oracle.w_uk_checkpoint_ref(w_uk)
    assert ckpt.shape == (3, 48, 12) and ckpt[2, 40, 7] == w_uk[2, 7, 40]
    np.testing.assert_array_equal(w_uk_to_checkpoint(w_uk), ckpt)
    np.testing.assert_array_equal(w_uk_from_checkpoint(ckpt), w_uk)
    assert w_uk_from_checkpoint(ckpt).flags["C_CONTIGUOUS"]


def test_latent_rows_layout():
    c_kv = np.arange(6, dtype=np.float32).reshape(2, 3)
    k_pe = -np.arange(4, dtype=np.float32).reshape(2, 2) - 1
    np.testing.assert_array_equal(oracle.latent_rows_ref(c_kv, k_pe),
                                  [[0, 1, 2, -1, -2], [3, 4, 5, -3, -4]])


def test_tolerance_formula():
    eps = np.finfo(np.float32).eps
    assert oracle.tolerance(1e-7, 0.5, 64) == pytest.approx(2e-7 + 8 * eps)
    assert oracle.tolerance(0.0, 10.0, 16) == pytest.approx(4 * eps * 10)
