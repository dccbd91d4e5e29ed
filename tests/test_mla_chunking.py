"""The GEMM path's scratch budget: chunks of queries, not a slower path.

* plain process: ``mla.pipeline.plan_method``'s selection with the budget
  patched: "auto" keeps the GEMM path in chunks whenever one query's scratch
  fits (no warning, the plan records chunks and why), the fewest balanced
  chunks within the budget; the tiled path only when one query alone passes
  it (a ``FallbackWarning``, ``fallback`` recorded); explicit methods and
  flash-only options; bad ``workspace_limit`` raised before any copy; the
  ``mla`` package's exports;
* simulator / GPU (``device``): chunked runs equal the unchunked run bit for
  bit (``mla_decode`` for "gemm" and "gemm_fma", fp32 and fp16 caches, ragged
  lengths with an empty sequence; the tensor-core GEMMs in every chunk;
  ``mla_attend`` chunked over its queries; ``MLADecodeGraph`` chunked), one
  scratch of one chunk's size reused, and the plan returned by ``mla_decode``.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

from attention.core import checks
from attention.core.checks import FallbackWarning
from mla import attn_gemm as G
from mla import pipeline as P
from mla.dims import SMALL_SHAPES

BIG = 1 << 62  # a budget nothing passes: one launch set


@contextlib.contextmanager
def quiet():
    """A context in which a FallbackWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        yield


# ---------------------------------------------------------------------------
# the selection logic (plain)
# ---------------------------------------------------------------------------

def test_long_context_decode_is_chunked_not_flash():
    """B 64, 128 heads, width 576, L 32768: 1.02 GiB of scratch at once, past the
    default 1 GiB: two chunks of 32 sequences on the GEMM path, quietly."""
    with quiet():
        plan = P.plan_method("auto", 64, 128, 576, 32768)
    assert plan.method == "gemm" and not plan.fallback
    assert (plan.chunk, plan.n_chunks) == (32, 2)
    assert plan.scratch_bytes == G.workspace_bytes(32, 128, 576, 32768) <= P.GEMM_WORKSPACE_LIMIT
    assert plan.full_bytes == G.workspace_bytes(64, 128, 576, 32768) > P.GEMM_WORKSPACE_LIMIT
    assert "2 chunks" in plan.reason and "identical" in plan.reason
    # under the budget: one launch set
    with quiet():
        plan = P.plan_method("auto", 64, 128, 576, 4096)
    assert (plan.method, plan.chunk, plan.n_chunks) == ("gemm", 64, 1)
    assert "one launch set" in plan.reason


@pytest.mark.parametrize("limit_mib", [1, 7, 64, 300, 1024])
def test_auto_never_silently_takes_the_slow_path(limit_mib, monkeypatch):
    """The budget patched: over a sweep of batch sizes and lengths, "auto" takes
    the tiled path (11-27x slower) only when one query's scratch alone passes
    the budget, and then warns and records ``fallback``; otherwise the GEMM
    path with the fewest chunks that fit, balanced, each within the budget."""
    limit = limit_mib << 20
    monkeypatch.setattr(P, "GEMM_WORKSPACE_LIMIT", limit)
    for n_q in (1, 2, 7, 33, 64, 65, 256):
        for nh, width in ((128, 576), (4, 72), (3, 52)):
            for length in (0, 1, 100, 4096, 32768, 1 << 20):
                per = G.workspace_bytes(1, nh, width, length)
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    plan = P.plan_method("auto", n_q, nh, width, length)
                warned = [w for w in seen if issubclass(w.category, FallbackWarning)]
                label = f"n_q {n_q}, nh {nh}, width {width}, L {length}, limit {limit_mib} MiB"
                assert plan.limit == limit, label
                if per > limit:
                    assert plan.method == "flash" and plan.fallback, label
                    assert len(warned) == 1 and "one query" in str(warned[0].message), label
                    assert plan.reason == str(warned[0].message)
                    continue
                assert not warned, f"{label}: warned {warned[0].message}"
                assert plan.method == "gemm" and not plan.fallback, label
                assert plan.chunk * plan.n_chunks >= n_q > (plan.chunk - 1) * plan.n_chunks, \
                    f"{label}: unbalanced chunks {plan.chunk} x {plan.n_chunks}"
                assert plan.scratch_bytes == G.workspace_bytes(plan.chunk, nh, width, length)
                assert plan.scratch_bytes <= limit, label
                fit = max(c for c in range(1, n_q + 1)
                          if G.workspace_bytes(c, nh, width, length) <= limit)
                assert plan.n_chunks == math.ceil(n_q / fit), f"{label}: not the fewest chunks"


def test_one_query_over_budget_falls_back_loudly(monkeypatch):
    """Positive control of the only fallback left: one query's scratch past
    the budget. Explicit "gemm" then runs one query a chunk (asked for), quietly."""
    monkeypatch.setattr(P, "GEMM_WORKSPACE_LIMIT", 1 << 20)
    with pytest.warns(FallbackWarning, match=r"'flash'.*one query.*workspace_limit"):
        plan = P.plan_method("auto", 4, 128, 576, 4096)  # 2.4 MiB a query
    assert plan.method == "flash" and plan.fallback and plan.scratch_bytes == 0
    with quiet():
        plan = P.plan_method("gemm", 4, 128, 576, 4096)
        assert (plan.method, plan.chunk, plan.n_chunks) == ("gemm", 1, 4)
        assert "asked for" in plan.reason
        # the limit argument overrides the module's budget
        plan = P.plan_method("auto", 4, 128, 576, 4096, limit=BIG)
        assert (plan.method, plan.n_chunks) == ("gemm", 1)


def test_explicit_methods_and_flash_options_are_quiet():
    with quiet():
        plan = P.plan_method("flash", 64, 128, 576, 1 << 20)
        assert plan.method == "flash" and not plan.fallback and "asked for" in plan.reason
        plan = P.plan_method("auto", 64, 128, 576, 1 << 20, tile=32)
        assert plan.method == "flash" and not plan.fallback and "tile" in plan.reason
        plan = P.plan_method("gemm_fma", 64, 128, 576, 32768)
        assert (plan.method, plan.n_chunks) == ("gemm_fma", 2)
        plan = P.plan_method("auto", 0, 128, 576, 0)
        assert (plan.method, plan.n_chunks, plan.scratch_bytes) == ("gemm", 0, 0)
    with pytest.raises(ValueError, match="method"):
        P.plan_method("gemm", 4, 4, 72, 9, tile=8)
    with pytest.raises(ValueError, match="method"):
        P.plan_method("cublas", 4, 4, 72, 9)


def test_choose_method_is_the_unsplit_rule():
    """``choose_method`` (one launch set that cannot be split) keeps its rule:
    over the budget "auto" falls back to "flash", warned."""
    with pytest.warns(FallbackWarning, match=r"'flash'.*GEMM_WORKSPACE_LIMIT.*method='gemm'"):
        assert P.choose_method("auto", 64, 128, 576, 40_000) == "flash"
    with quiet():
        assert P.choose_method("auto", 64, 128, 576, 4096) == "gemm"
        assert P.choose_method("gemm", 64, 128, 576, 40_000) == "gemm"


def test_chunk_bounds_and_workspace_bytes():
    assert G.chunk_bounds(5, None) == [(0, 5)]
    assert G.chunk_bounds(5, 5) == [(0, 5)]
    assert G.chunk_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert G.chunk_bounds(0, 3) == [(0, 0)]
    with pytest.raises(ValueError, match="chunk"):
        G.chunk_bounds(5, 0)
    # qc padded to QC_PAD_WORDS, S rows to 4 words
    assert G.workspace_bytes(1, 3, 7, 5) == 4 * (G.QC_PAD_WORDS + 3 * 8)
    assert G.workspace_bytes(64, 128, 576, 4096) == 4 * 64 * 128 * (576 + 4096)


def _decode_args(n_b=5, max_seq=9, dtype=np.float32, dims=SMALL_SHAPES[0], seed=3):
    nh, r, p_ = dims.n_head, dims.kv_rank, dims.d_rope
    rng = np.random.default_rng(seed)
    q_nope = rng.standard_normal((n_b, nh, dims.d_nope)).astype(np.float32)
    q_pe = rng.standard_normal((n_b, nh, p_)).astype(np.float32)
    cache = rng.standard_normal((n_b, max_seq, r + p_)).astype(dtype)
    w_uk = (rng.standard_normal((nh, dims.d_nope, r)) / np.sqrt(r)).astype(np.float32)
    w_uv = (rng.standard_normal((nh, dims.d_v, r)) / np.sqrt(r)).astype(np.float32)
    return q_nope, q_pe, cache, w_uk, w_uv


def test_bad_workspace_limit_raises_before_any_copy():
    from mla.decode_graph import MLADecodeGraph
    from mla.pipeline import mla_decode

    q_nope, q_pe, cache, w_uk, w_uv = _decode_args()
    lens = np.array([1, 2, 3, 4, 5], np.int32)
    for bad in (0, -5, 1.5, True, "1GiB"):
        with pytest.raises(checks.RangeError, match="workspace_limit"):
            mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, workspace_limit=bad)
    with pytest.raises(checks.RangeError, match="workspace_limit"):
        MLADecodeGraph(q_nope, q_pe, cache, lens, w_uk, w_uv, workspace_limit=0)


def test_package_exports():
    """``mla.__all__`` names the public entry points, all resolvable, and
    ``import mla`` alone loads no kernels (nor numba)."""
    import mla

    for name in ("mla_decode", "mla_attend", "mla_attend_cached", "mla_decode_step",
                 "MLADecodeGraph", "LatentCache", "append_latent", "MlaDims", "MicroMlaModel",
                 "plan_method", "MethodPlan", "Workspace"):
        assert name in mla.__all__, name
    for name in mla.__all__:
        assert getattr(mla, name) is not None, name
    from mla.pipeline import mla_decode

    assert mla.mla_decode is mla_decode
    with pytest.raises(AttributeError):
        mla.not_a_name  # noqa: B018
    code = "import sys, mla, mla.dims; print('numba' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert res.stdout.strip() == "False", res.stdout + res.stderr


# ---------------------------------------------------------------------------
# chunked = unchunked, bit for bit (simulator / GPU)
# ---------------------------------------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("method,dtype", [("gemm", np.float32), ("gemm", np.float16),
                                          ("gemm_fma", np.float32)])
def test_chunked_decode_equals_unchunked(method, dtype):
    """Five ragged sequences (one empty) in chunks of 2, 2, 1 (a tiny budget)
    against one launch set: the same bits for every sequence; one scratch of
    one chunk's size, reused; the plan returned says so. Each sequence alone
    gives its bits too (its work is independent of the others')."""
    from mla.pipeline import mla_decode

    dims = SMALL_SHAPES[0]
    q_nope, q_pe, cache, w_uk, w_uv = _decode_args(dtype=dtype)
    lens = np.array([9, 0, 4, 7, 1], np.int32)
    width = dims.kv_rank + dims.d_rope
    limit = G.workspace_bytes(2, dims.n_head, width, 9)
    with quiet():
        whole, p1 = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method=method,
                               workspace_limit=BIG, return_plan=True)
        ws = G.Workspace()
        got, p2 = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method=method,
                             workspace=ws, workspace_limit=limit, return_plan=True)
    assert (p1.method, p1.n_chunks) == (method, 1)
    assert (p2.method, p2.chunk, p2.n_chunks) == (method, 2, 3), p2
    assert ws.nbytes == p2.scratch_bytes == limit < p1.scratch_bytes
    for b in range(len(lens)):
        np.testing.assert_array_equal(got[b], whole[b], err_msg=f"sequence {b}")
    assert not got[1].any(), "empty sequence: expected zeros"
    # each sequence alone (padded to the batch's longest, as in the batch)
    for b in (0, 3):
        alone = mla_decode(q_nope[b:b + 1], q_pe[b:b + 1], cache[b:b + 1], lens[b:b + 1],
                           w_uk, w_uv, method=method)
        np.testing.assert_array_equal(alone[0], whole[b], err_msg=f"sequence {b} alone")


@pytest.mark.device
def test_auto_chunks_with_the_budget_patched(monkeypatch):
    """The module budget patched below the batch's scratch: "auto" runs the
    GEMM path in chunks (quietly) with the bits of the unchunked run, and
    returns a plan saying why; the tiled path's output differs (a real
    alternative, not the same code)."""
    from mla.pipeline import mla_decode

    dims = SMALL_SHAPES[1]
    q_nope, q_pe, cache, w_uk, w_uv = _decode_args(n_b=4, max_seq=6, dims=dims, seed=5)
    lens = np.array([6, 3, 5, 2], np.int32)
    whole = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method="gemm")
    monkeypatch.setattr(P, "GEMM_WORKSPACE_LIMIT",
                        G.workspace_bytes(3, dims.n_head, dims.kv_rank + dims.d_rope, 6))
    with quiet():
        got, plan = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, return_plan=True)
    assert (plan.method, plan.chunk, plan.n_chunks, plan.fallback) == ("gemm", 2, 2, False)
    assert "2 chunks" in plan.reason
    np.testing.assert_array_equal(got, whole)
    flash = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method="flash")
    assert np.abs(flash - whole).max() < 1e-4 and not np.array_equal(flash, whole)


@pytest.mark.device
@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_chunks_keep_the_tensor_core_gemms(cache_dtype, monkeypatch):
    """Heads past half a ``tgemm`` tile: every chunk's score and P.V GEMMs go
    to tensor cores (two calls a chunk), and the bits are the unchunked ones."""
    from attention.gemm import tgemm
    from mla.dims import MlaDims
    from mla.pipeline import mla_decode

    nh = tgemm.tile_shape()[0] // 2 + 4
    dims = MlaDims(n_head=nh, d_nope=8, d_rope=4, d_v=8, kv_rank=28)
    q_nope, q_pe, cache, w_uk, w_uv = _decode_args(n_b=3, max_seq=12, dims=dims, seed=9,
                                                   dtype=cache_dtype)
    lens = np.array([9, 5, 12], np.int32)
    calls, real = [], tgemm.launch

    def spy(*args, **kw):
        calls.append(kw["b_order"])
        return real(*args, **kw)

    monkeypatch.setattr(tgemm, "launch", spy)
    whole = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method="gemm",
                       workspace_limit=BIG)
    assert sorted(calls) == ["zkn", "znk"]
    calls.clear()
    got, plan = mla_decode(q_nope, q_pe, cache, lens, w_uk, w_uv, method="gemm",
                           workspace_limit=G.workspace_bytes(1, nh, 32, 12), return_plan=True)
    assert plan.n_chunks == 3 and sorted(calls) == ["zkn"] * 3 + ["znk"] * 3, calls
    np.testing.assert_array_equal(got, whole)


@pytest.mark.device
def test_attend_chunks_its_queries(monkeypatch):
    """``mla_attend`` (t_q queries of one sequence, causal) under a budget of
    two queries: chunked over its queries, the unchunked bits."""
    from mla.pipeline import mla_attend
    from validation.suite_mla import make_case

    dims = SMALL_SHAPES[0]
    args = make_case(dims, 5, 11, seed=7)
    whole = mla_attend(*args, method="gemm")
    monkeypatch.setattr(P, "GEMM_WORKSPACE_LIMIT",
                        G.workspace_bytes(2, dims.n_head, dims.kv_rank + dims.d_rope, 11))
    calls, real = [], G.prepare

    def spy(*a, **kw):
        calls.append(int(a[0].shape[0]))
        return real(*a, **kw)

    monkeypatch.setattr(G, "prepare", spy)
    with quiet():
        got = mla_attend(*args)
    assert calls == [2, 2, 1], calls
    np.testing.assert_array_equal(got, whole)


@pytest.mark.device
def test_decode_graph_chunked_equals_mla_decode():
    """``MLADecodeGraph`` with a budget of two sequences at full capacity: three
    chunks recorded in ``plan``, runs give ``mla_decode``'s bits, and lengths
    changed in place are followed by every chunk."""
    from numba import cuda

    from mla.decode_graph import MLADecodeGraph
    from mla.pipeline import mla_decode

    dims = SMALL_SHAPES[0]
    q_nope, q_pe, cache, w_uk, w_uv = _decode_args(n_b=5, max_seq=8, seed=11)
    d_lens = cuda.to_device(np.array([8, 0, 3, 5, 1], np.int32))
    limit = G.workspace_bytes(2, dims.n_head, dims.kv_rank + dims.d_rope, 8)
    with quiet():
        g = MLADecodeGraph(q_nope, q_pe, cache, d_lens, w_uk, w_uv, workspace_limit=limit)
    assert (g.plan.method, g.plan.chunk, g.plan.n_chunks) == ("gemm", 2, 3)
    assert g.workspace.nbytes == limit
    g.run(sync=True)
    want = mla_decode(q_nope, q_pe, cache, np.array([8, 0, 3, 5, 1]), w_uk, w_uv,
                      method="gemm", workspace_limit=BIG)
    np.testing.assert_array_equal(g.out.copy_to_host(), want)
    lens2 = np.array([2, 7, 8, 0, 4], np.int32)
    d_lens.copy_to_device(lens2)
    g.run(sync=True)
    np.testing.assert_array_equal(
        g.out.copy_to_host(),
        mla_decode(q_nope, q_pe, cache, lens2, w_uk, w_uv, method="gemm", workspace_limit=BIG))
