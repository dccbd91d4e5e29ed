"""``mla.decode_graph.MLADecodeGraph``: the GEMM-path MLA decode prepared once.

* plain process: bad input raised at construction, before any copy;
* simulator / GPU (``device``): runs match ``mla_decode`` (method "gemm") bit
  for bit and the oracles, lengths and buffers changed in place between runs
  are picked up, an empty sequence gives zeros, and a length written out of
  range on the device attends nothing and is reported by ``check()`` (the
  positive control of that check);
* GPU (``gpu``): a graph is built, and its replay gives the bits of the plain
  launch path, with the weight GEMMs' K split too (and those of the split off).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla.dims import SMALL_SHAPES
from tests.conftest import MODE, small


def _case(seed, n_b=3, max_seq=8, dtype=np.float32):
    dims = SMALL_SHAPES[0]
    nh, r, p_ = dims.n_head, dims.kv_rank, dims.d_rope
    rng = np.random.default_rng(seed)
    q_nope = rng.standard_normal((n_b, nh, dims.d_nope)).astype(np.float32)
    q_pe = rng.standard_normal((n_b, nh, p_)).astype(np.float32)
    cache = rng.standard_normal((n_b, max_seq, r + p_)).astype(dtype)
    w_uk = (rng.standard_normal((nh, dims.d_nope, r)) / np.sqrt(r)).astype(np.float32)
    w_uv = (rng.standard_normal((nh, dims.d_v, r)) / np.sqrt(r)).astype(np.float32)
    return q_nope, q_pe, cache, w_uk, w_uv


def test_bad_input_raises_before_any_copy():
    from mla.decode_graph import MLADecodeGraph

    q_nope, q_pe, cache, w_uk, w_uv = _case(0)
    lens = np.array([1, 2, 3], np.int32)
    with pytest.raises(checks.ShapeError, match="latent_cache"):
        MLADecodeGraph(q_nope, q_pe, cache[:, :, :-1], lens, w_uk, w_uv)
    with pytest.raises(checks.RangeError, match="lengths"):
        MLADecodeGraph(q_nope, q_pe, cache, np.array([1, 9, 3]), w_uk, w_uv)
    with pytest.raises(checks.ShapeError, match="lengths"):
        MLADecodeGraph(q_nope, q_pe, cache, np.array([1, 2]), w_uk, w_uv)
    with pytest.raises(checks.ShapeError, match="q_nope"):
        MLADecodeGraph(q_nope[:0], q_pe[:0], cache[:0], np.zeros(0, np.int32), w_uk, w_uv)
    with pytest.raises(checks.DTypeError, match="latent_cache"):
        MLADecodeGraph(q_nope, q_pe, cache.astype(np.float64), lens, w_uk, w_uv)


@pytest.mark.device
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_runs_match_mla_decode_and_follow_buffers(dtype):
    from numba import cuda

    from mla.decode_graph import MLADecodeGraph
    from mla.oracle import mla_attend_absorbed
    from mla.pipeline import mla_decode

    q_nope, q_pe, cache, w_uk, w_uv = _case(1, dtype=dtype)
    r = SMALL_SHAPES[0].kv_rank
    d_lens = cuda.to_device(np.array([0, 7, 3], np.int32))
    g = MLADecodeGraph(q_nope, q_pe, cache, d_lens, w_uk, w_uv)
    g.run(sync=True)
    want = mla_decode(q_nope, q_pe, cache, np.array([0, 7, 3]), w_uk, w_uv, method="gemm")
    got = g.out.copy_to_host()
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(got[0], np.zeros_like(got[0])), "empty sequence: expected zeros"
    assert np.isneginf(g.lse.copy_to_host()[0]).all()

    # next step: new lengths and new queries, written into the same buffers
    lens2 = np.array([2, 8, 4], np.int32)
    q2 = (q_nope * 0.5 + 0.25).astype(np.float32)
    d_lens.copy_to_device(lens2)
    g.d_q_nope.copy_to_device(q2)
    # no synchronize: the replay stream is ordered after these default-stream
    # writes (attention.core.graph)
    g.run(sync=True)
    got2 = g.out.copy_to_host()
    rows = cache.astype(np.float32)
    for b in range(3):
        n = lens2[b]
        ref = mla_attend_absorbed(q2[b:b + 1], q_pe[b:b + 1], rows[b, :n, :r], rows[b, :n, r:],
                                  w_uk, w_uv)
        assert np.abs(got2[b] - ref[0]).max() < 1e-4, f"sequence {b} after the update"
    np.testing.assert_array_equal(
        got2, mla_decode(q2, q_pe, cache, lens2, w_uk, w_uv, method="gemm"))


@pytest.mark.device
def test_length_out_of_range_is_reported_not_clamped():
    """Positive control of the device-side length check: a length past
    max_seq attends nothing (zeros, LSE -inf) and ``check`` raises; the flag
    clears, and a good run after it passes."""
    from numba import cuda

    from mla.decode_graph import MLADecodeGraph

    q_nope, q_pe, cache, w_uk, w_uv = _case(2)
    d_lens = cuda.to_device(np.array([5, 6, 7], np.int32))
    g = MLADecodeGraph(q_nope, q_pe, cache, d_lens, w_uk, w_uv)
    g.run(sync=True)
    good = g.out.copy_to_host()
    # written on the default stream and replayed at once, with no synchronize:
    # the replay must wait for the copy (the H200 run of 11fe247, when the
    # replay stream was non-blocking, replayed before it had landed and saw
    # the old lengths)
    d_lens.copy_to_device(np.array([5, 9, 7], np.int32))
    with pytest.raises(checks.RangeError, match="lengths"):
        g.run(sync=True)
    bad = g.out.copy_to_host()
    assert np.array_equal(bad[1], np.zeros_like(bad[1]))
    np.testing.assert_array_equal(bad[[0, 2]], good[[0, 2]])
    d_lens.copy_to_device(np.array([5, 6, 7], np.int32))
    g.run(sync=True)  # the flag was cleared by the raise
    np.testing.assert_array_equal(g.out.copy_to_host(), good)


def _replay_is_plain(g):
    """The graph's replay output, after checking that a graph was built and
    that the plain launches give the same bits."""
    assert g.graph is not None, f"no graph: {g.graph_error}"
    g.run(sync=True)
    replay = g.out.copy_to_host()
    g.run_plain(sync=True)
    np.testing.assert_array_equal(g.out.copy_to_host(), replay)
    return replay


@pytest.mark.device
@pytest.mark.gpu
def test_graph_replay_matches_plain_launches():
    from mla.decode_graph import MLADecodeGraph

    assert MODE == "gpu" and not small()
    q_nope, q_pe, cache, w_uk, w_uv = _case(3, n_b=5, max_seq=300)
    lens = np.array([300, 0, 1, 129, 77], np.int32)
    _replay_is_plain(MLADecodeGraph(q_nope, q_pe, cache, lens, w_uk, w_uv))


@pytest.mark.device
@pytest.mark.gpu
def test_graph_replay_with_the_weight_gemms_k_split(monkeypatch):
    """More than 16 sequences and weight GEMMs whose grid is a few blocks: the
    absorb and decompress take the K split on the GPU (two launches each,
    through scratch allocated with the prepared call). The graph's replay
    gives the plain launches' bits, and both give the bits of the same decode
    with the split off (SM count 0)."""
    from attention.gemm import sgemm
    from mla.decode_graph import MLADecodeGraph
    from mla.dims import MlaDims

    assert MODE == "gpu" and not small()
    dims = MlaDims(n_head=4, d_nope=256, d_rope=8, d_v=32, kv_rank=256)
    nh, r, p_ = dims.n_head, dims.kv_rank, dims.d_rope
    rng = np.random.default_rng(17)
    n_b = 20
    q_nope = rng.standard_normal((n_b, nh, dims.d_nope)).astype(np.float32)
    q_pe = rng.standard_normal((n_b, nh, p_)).astype(np.float32)
    cache = rng.standard_normal((n_b, 200, r + p_)).astype(np.float32)
    w_uk = (rng.standard_normal((nh, dims.d_nope, r)) / np.sqrt(r)).astype(np.float32)
    w_uv = (rng.standard_normal((nh, dims.d_v, r)) / np.sqrt(r)).astype(np.float32)
    lens = rng.integers(0, 201, size=n_b).astype(np.int32)
    sms = sgemm.sm_count()
    assert sgemm.k_splits(n_b, r, dims.d_nope, nh, sms) == 4
    assert sgemm.k_splits(n_b, dims.d_v, r, nh, sms) == 4
    g = MLADecodeGraph(q_nope, q_pe, cache, lens, w_uk, w_uv)
    assert all(set(p["k_split"]) == {"absorb", "decompress"} for p in g._ps)
    assert g.workspace._k is not None  # the partials' buffer is the graph's workspace's
    replay = _replay_is_plain(g)
    monkeypatch.setattr(sgemm, "sm_count", lambda: 0)
    off = MLADecodeGraph(q_nope, q_pe, cache, lens, w_uk, w_uv)
    off.run_plain(sync=True)
    np.testing.assert_array_equal(off.out.copy_to_host(), replay)
