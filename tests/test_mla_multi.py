"""Multi-token MLA decode (``s_q`` new queries a sequence, as in multi-token
prediction): ``mla_decode`` and ``MLADecodeGraph`` with q ``[B, s_q, nh, .]``.

The contract: query i of sequence b is position ``lengths[b] - s_q + i`` and
attends positions ``0 .. lengths[b] - s_q + i``; a length is 0 or at least
``s_q``. Every method reads a sequence's latent rows once for all its queries
(the ``s_q * nh`` (query, head) rows share the score / P.V GEMMs or the tiled
kernel's tiles), and each query's output and LSE are the bits of a one-query
decode over its prefix, where both calls run the same kernels:

* "flash", "gemm_fma" and "gemm" at few heads (``sgemm`` both times): always;
* "gemm" where ``s_q * nh`` rows reach the tensor-core GEMM (``tgemm.usable``:
  more rows than half its tile) but ``nh`` rows do not: the multi-token call
  runs tensor cores and the one-query call FMA GEMMs, other arithmetic, so
  only the oracle bound holds (``test_tensor_core_rows``); at 128 heads both
  run tensor cores and the bits are equal again (the ``gpu`` test).

Fixtures: the contiguous cache holds NaN past each length, the paged one is
``tests.test_mla_paged.build_pages``' (shuffled pages, a shared first page,
NaN tails, huge unused entries). Tolerances: ``validation.suite_mla.parity``
(2x the float32 numpy baseline's error against the float64 oracle, plus the
fp32 floor of ``mla.oracle.tolerance``), as in the other MLA tests.

Simulator time of this file: about 25-35 s in one process on the 2-core CI
machine (the tensor-core GEMM and the captured decode cost most).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla.dims import DEEPSEEK_V3, MlaDims
from mla.oracle import mla_attend_absorbed, mla_decode_ref
from tests.conftest import MODE, small
from tests.test_mla_paged import paged_case
from validation.suite_mla import parity

DIMS = MlaDims(n_head=2, d_nope=8, d_rope=4, d_v=8, kv_rank=12)  # rows of 16 words
SIM_TILE = 8 if small() else None


def multi_case(s_q, *, dims=DIMS, lengths=None, page_size=3, dtype=np.float32, seed=0):
    """Queries [B, s_q, nh, .], weights, a contiguous cache [B, cap, W] (NaN
    past each length) and the same rows in shuffled, shared pages
    (``tests.test_mla_paged.paged_case``)."""
    c = paged_case(page_size, dtype, dims=dims, seed=seed, s_q=s_q,
                   lengths=[0, s_q, s_q + 1, 13] if lengths is None else lengths)
    c["s_q"] = s_q
    return c


def decode(c, paged=False, **kw):
    from mla.pipeline import mla_decode

    if paged:
        kw.setdefault("page_table", c["table"])
    cache = c["pages"] if paged else c["cont"]
    return mla_decode(c["q_nope"], c["q_pe"], cache, c["lengths"], c["w_uk"], c["w_uv"],
                      return_lse=True, **kw)


def prefix_decode(c, **kw):
    """Every query as a one-query decode over its prefix, in one call: row
    ``b * s_q + i`` of a batch of B * s_q sequences is query i of sequence b
    over sequence b's rows, length ``lengths[b] - s_q + 1 + i`` (0 for an
    empty sequence). Returns (out [B, s_q, nh, d_v], lse [B, s_q, nh])."""
    from mla.pipeline import mla_decode

    s_q, lens = c["s_q"], c["lengths"]
    n_b, _, nh, _ = c["q_nope"].shape
    pl = np.array([n - s_q + 1 + i if n else 0 for n in lens for i in range(s_q)])
    q_nope = c["q_nope"].reshape((n_b * s_q, nh, -1))
    q_pe = c["q_pe"].reshape((n_b * s_q, nh, -1))
    out, lse = mla_decode(q_nope, q_pe, np.repeat(c["cont"], s_q, axis=0), pl, c["w_uk"],
                          c["w_uv"], return_lse=True, **kw)
    return out.reshape((n_b, s_q) + out.shape[1:]), lse.reshape((n_b, s_q, nh))


def assert_oracle(out, lse, c, label):
    """Each sequence's s_q queries against both float64 oracles (``parity``),
    the batched oracle, and the LSE against the oracle's."""
    r = c["dims"].kv_rank
    ref, ref_lse = mla_decode_ref(c["q_nope"], c["q_pe"], c["cont"], c["lengths"], c["w_uk"],
                                  c["w_uv"], return_lse=True)
    naive = mla_decode_ref(c["q_nope"], c["q_pe"], c["cont"], c["lengths"], c["w_uk"],
                           c["w_uv"], form="naive")
    assert np.abs(ref - naive).max() < 1e-12
    for b, n in enumerate(c["lengths"]):
        if n == 0:
            assert not out[b].any(), f"{label}: empty sequence {b}: expected zeros"
            assert np.isneginf(lse[b]).all()
            continue
        rows = c["cont"][b, :n].astype(np.float32)
        args = (c["q_nope"][b], c["q_pe"][b], rows[:, :r], rows[:, r:], c["w_uk"], c["w_uv"])
        p = parity(out[b], args)
        assert p["ok"], (f"{label}: sequence {b} (length {n}): err {p['err_naive']:.3e} > "
                         f"tol {p['tol']:.3e}")
        assert np.abs(out[b] - ref[b]).max() <= p["tol"]
        # LSE: each query's is a log-sum-exp of its own scaled scores; the
        # same rule, its baseline the float32 LSE of the same scores
        f = np.float32
        q_lat = np.einsum("hpl,thp->thl", c["w_uk"], c["q_nope"][b])
        scale = f(1.0 / np.sqrt(c["dims"].d_nope + c["dims"].d_rope))
        s = (np.einsum("thl,sl->ths", q_lat, rows[:, :r])
             + np.einsum("thd,sd->ths", c["q_pe"][b], rows[:, r:])) * scale
        vis = n - c["s_q"] + 1 + np.arange(c["s_q"])
        s = np.where(np.arange(n)[None, None, :] < vis[:, None, None], s, f(-np.inf))
        m = s.max(axis=2)
        base = m + np.log(np.exp(s - m[:, :, None]).sum(axis=2))
        base_err = float(np.abs(base - ref_lse[b]).max())
        tol = 2 * base_err + np.sqrt(rows.shape[1]) * np.finfo(f).eps * max(
            1.0, float(np.abs(ref_lse[b]).max()))
        assert np.abs(lse[b] - ref_lse[b]).max() <= tol, f"{label}: LSE of sequence {b}"


# ---------------------------------------------------------------------------
# plain process: oracle, bad input
# ---------------------------------------------------------------------------

def test_oracle_multi_is_the_prefix_decode():
    """The batched oracle: query i equals the one-query oracle over its prefix;
    rank-3 queries are s_q = 1; the paged oracle gathers the same rows."""
    c = multi_case(3)
    r = DIMS.kv_rank
    out, lse = mla_decode_ref(c["q_nope"], c["q_pe"], c["cont"], c["lengths"], c["w_uk"],
                              c["w_uv"], return_lse=True)
    assert out.shape == (4, 3, 2, 8) and lse.shape == (4, 3, 2)
    for b, n in enumerate(c["lengths"]):
        for i in range(3):
            if n == 0:
                assert not out[b, i].any() and np.isneginf(lse[b, i]).all()
                continue
            rows = c["cont"][b, :n - 2 + i].astype(np.float64)
            o, ls = mla_attend_absorbed(c["q_nope"][b, i:i + 1], c["q_pe"][b, i:i + 1],
                                        rows[:, :r], rows[:, r:], c["w_uk"], c["w_uv"],
                                        return_lse=True)
            np.testing.assert_allclose(out[b, i], o[0], rtol=0, atol=1e-13)
            np.testing.assert_allclose(lse[b, i], ls[0], rtol=0, atol=1e-13)
    paged = mla_decode_ref(c["q_nope"], c["q_pe"], c["pages"], c["lengths"], c["w_uk"],
                           c["w_uv"], page_table=c["table"])
    np.testing.assert_array_equal(paged, out)
    one = mla_decode_ref(c["q_nope"][:, 0], c["q_pe"][:, 0], c["cont"], c["lengths"],
                         c["w_uk"], c["w_uv"])
    assert one.shape == (4, 2, 8)
    with pytest.raises(ValueError, match="lengths"):
        mla_decode_ref(c["q_nope"], c["q_pe"], c["cont"], [0, 2, 4, 13], c["w_uk"], c["w_uv"])


def _args(c, **kw):
    args = {"q_nope": c["q_nope"], "q_pe": c["q_pe"], "latent_cache": c["cont"],
            "lengths": c["lengths"], "w_uk": c["w_uk"], "w_uv": c["w_uv"]}
    args.update(kw)
    return args


@pytest.mark.parametrize("change,error,match", [
    (lambda c: {"lengths": np.array([0, 2, 4, 13])}, checks.RangeError,
     r"lengths: expected 0 or at least s_q=3.*lengths\[1\]=2"),
    (lambda c: {"lengths": np.array([0, 1, 4, 13]), "page_table": c["table"],
                "latent_cache": c["pages"]}, checks.RangeError, "s_q=3"),
    (lambda c: {"q_pe": c["q_pe"][:, :2]}, checks.ShapeError, "q_pe"),
    (lambda c: {"q_nope": np.zeros((4, 17, 2, 8), np.float32),
                "q_pe": np.zeros((4, 17, 2, 4), np.float32)}, checks.RangeError, "s_q"),
    (lambda c: {"q_nope": np.zeros((4, 0, 2, 8), np.float32),
                "q_pe": np.zeros((4, 0, 2, 4), np.float32)}, checks.RangeError, "s_q"),
    (lambda c: {"q_nope": c["q_nope"].astype(np.float64)}, checks.DTypeError, "q_nope"),
    (lambda c: {"latent_cache": c["cont"][:3]}, checks.ShapeError, "latent_cache"),
])
def test_bad_input_raises_before_any_launch(change, error, match):
    from mla.pipeline import mla_decode

    c = multi_case(3)
    with pytest.raises(error, match=match):
        mla_decode(**_args(c, **change(c)))


def test_graph_and_defect_bad_input():
    from mla.decode_graph import MLADecodeGraph
    from mla.pipeline import mla_decode

    c = multi_case(3)
    with pytest.raises(checks.RangeError, match="s_q=3"):
        MLADecodeGraph(c["q_nope"], c["q_pe"], c["cont"], np.array([0, 2, 4, 13]), c["w_uk"],
                       c["w_uv"])
    # the multi-token defect needs s_q > 1 (one query a sequence cannot show it)
    with pytest.raises(ValueError, match="defect"):
        mla_decode(**_args(c, q_nope=np.ascontiguousarray(c["q_nope"][:, 0]),
                           q_pe=np.ascontiguousarray(c["q_pe"][:, 0]),
                           defect="mla_causal_off_by_one"))


# ---------------------------------------------------------------------------
# compile-only (plain process, no GPU)
# ---------------------------------------------------------------------------

def _arr(t, n):
    from numba import types

    return types.Array(t, n, "C")


@pytest.mark.compile
@pytest.mark.parametrize("page_size", [0, 64])
def test_compile_flash_multi(page_size):
    """The tiled kernel at DeepSeek's widths with s_q = 2: registers only, warp
    shuffles; its name says s_q, the one-query kernel's does not."""
    from numba import cuda, types

    from mla import kernels as K

    d = DEEPSEEK_V3
    tile, hg = K.plan_blocks(d.n_head, d.latent_width)
    f32, i32 = types.float32, types.int32
    kern = K.attn_absorbed_kernel(d.kv_rank, d.d_rope, tile, hg, None, page_size, 2)
    ptx, _ = cuda.compile_ptx(
        kern.py_func, (_arr(f32, 3), _arr(f32, 3), _arr(types.float16, 3),
                       _arr(i32, 2 if page_size else 1), _arr(i32, 1), _arr(i32, 1), f32,
                       _arr(f32, 3), _arr(f32, 2)), cc=(9, 0))
    assert ".local" not in ptx and "shfl.sync.bfly.b32" in ptx
    assert kern.__name__.endswith("_sq2") if not page_size else "_paged64_sq2" in kern.__name__
    assert "_sq" not in K.attn_absorbed_kernel(d.kv_rank, d.d_rope, tile, hg).__name__


@pytest.mark.compile
def test_compile_multi_softmax_and_checks():
    from numba import cuda, types

    from mla import attn_gemm as G
    from mla import decode_graph as DG
    from mla import paged as PG

    f32, i32 = types.float32, types.int32
    sm = (_arr(f32, 3), _arr(i32, 1), _arr(f32, 2))
    for kern in (G.softmax_resident_kernel(32, None, 256, 4), G.softmax_rows_kernel(None, 4),
                 G.softmax_rows_kernel("mla_causal_off_by_one", 4)):
        ptx, _ = cuda.compile_ptx(kern.py_func, sm, cc=(9, 0))
        assert ".local" not in ptx and "_sq4" in ptx
    ptx, _ = cuda.compile_ptx(DG.lengths_check_kernel(2).py_func,
                              (_arr(i32, 1), _arr(i32, 1), i32, _arr(i32, 1)), cc=(9, 0))
    assert "mla_lengths_check_sq2" in ptx
    ptx, _ = cuda.compile_ptx(PG.page_check_kernel(2).py_func,
                              (_arr(i32, 1), _arr(i32, 2), i32, i32, _arr(i32, 1),
                               _arr(i32, 1)), cc=(9, 0))
    assert "mla_page_check_sq2" in ptx
    assert DG.lengths_check_kernel().__name__ == "mla_lengths_check"
    assert PG.page_check_kernel().__name__ == "mla_page_check"


# ---------------------------------------------------------------------------
# device (simulator at these shapes, or a GPU)
# ---------------------------------------------------------------------------

# "gemm" at 2 heads: s_q * nh rows stay under half a tensor-core tile, so both
# it and the one-query call run sgemm (the tensor-core rows: test_tensor_core_rows)
METHODS = [("flash", 3), ("gemm_fma", 2), ("gemm", 2)]


@pytest.mark.device
@pytest.mark.parametrize("method,s_q", METHODS, ids=[m for m, _ in METHODS])
def test_multi_token_decode(method, s_q):
    """Against the float64 oracles; query i bit-equal to a one-query decode of
    its prefix (output and LSE); the paged cache bit-equal to the contiguous
    (for "gemm_fma" also run in chunks of two sequences under a small
    scratch budget: the same bits)."""
    from mla import attn_gemm as G

    # flash: 3 warps a block over 2 heads, so each block holds rows of two queries
    tile = {"tile": SIM_TILE, "heads_per_block": 3} if method == "flash" else {}
    c = multi_case(s_q, page_size=3 if method != "gemm_fma" else 16, seed=len(method))
    out, lse = decode(c, method=method, **tile)
    assert out.shape == (4, s_q, 2, 8) and lse.shape == (4, s_q, 2)
    assert_oracle(out, lse, c, method)
    want, want_lse = prefix_decode(c, method=method, **tile)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    kw = {}
    if method == "gemm_fma":  # paged rows gathered for sgemm: 2 sequences a chunk
        kw["workspace_limit"] = G.workspace_bytes(2, s_q * DIMS.n_head, DIMS.latent_width,
                                                  int(c["lengths"].max()),
                                                  DIMS.latent_width * 4)
    got, got_lse, plan = decode(c, True, method=method, return_plan=True, **tile, **kw)
    assert plan.n_chunks == (2 if kw else 1) and plan.chunk == (2 if kw else plan.chunk)
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(got_lse, lse)


@pytest.mark.device
def test_auto_and_rank4_single_query():
    """method="auto" takes the GEMM path and plans sequences of s_q queries;
    q [B, 1, nh, .] gives the rank-3 call's bits with rank-4 shapes."""
    from mla.pipeline import mla_decode

    c = multi_case(2, lengths=[5, 0, 2])
    out, lse, plan = decode(c, return_plan=True)
    assert plan.method == "gemm" and "3 sequences x 2 queries" in plan.reason
    assert_oracle(out, lse, c, "auto")
    c1 = multi_case(1, lengths=[5, 0, 2])
    out1 = mla_decode(c1["q_nope"], c1["q_pe"], c1["cont"], c1["lengths"], c1["w_uk"],
                      c1["w_uv"])
    assert out1.shape == (3, 1, 2, 8)
    np.testing.assert_array_equal(
        out1[:, 0], mla_decode(np.ascontiguousarray(c1["q_nope"][:, 0]),
                               np.ascontiguousarray(c1["q_pe"][:, 0]), c1["cont"],
                               c1["lengths"], c1["w_uk"], c1["w_uv"]))


@pytest.mark.device
def test_tensor_core_rows(monkeypatch):
    """5 heads, s_q 2: the 10 rows of a sequence pass half a tensor-core tile
    (the simulator's tile is 16 rows), so "gemm" runs the score and P.V GEMMs
    on tensor cores, the paged cache through their own page look-ups. Against
    the oracle, and paged == contiguous bit for bit. (The one-query call has 5
    rows and runs sgemm: other arithmetic, no bit equality to it here.)"""
    from attention.gemm import tgemm

    if MODE != "sim":  # the GPU's tile is 128 rows at small shapes too (gpu-small)
        pytest.skip("at GPU tiles (128 rows) 10 rows stay on sgemm: the gpu test covers it")
    dims = MlaDims(n_head=5, d_nope=8, d_rope=4, d_v=8, kv_rank=12)
    c = multi_case(2, dims=dims, lengths=[9, 2], seed=4)
    calls, real = [], tgemm.launch

    def spy(*args, **kw):
        calls.append(kw.get("page_size", 0))
        return real(*args, **kw)

    monkeypatch.setattr(tgemm, "launch", spy)
    out, lse = decode(c, method="gemm")
    assert calls == [0, 0], calls
    assert_oracle(out, lse, c, "gemm (tensor cores)")
    got, got_lse = decode(c, True, method="gemm")
    assert calls[2:] == [3, 3], calls
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(got_lse, lse)


@pytest.mark.device
def test_graph_equals_eager_and_flags_a_short_length():
    """``MLADecodeGraph`` with q [B, s_q, nh, .]: the eager call's bits; a
    device length in 1..s_q-1 attends nothing and ``check`` names lengths and
    s_q; the other sequences keep their bits."""
    from numba import cuda

    from mla.decode_graph import MLADecodeGraph

    c = multi_case(3, lengths=[8, 0, 3], seed=7)
    want, want_lse = decode(c, method="gemm_fma")
    d_lens = cuda.to_device(c["lengths"].astype(np.int32))
    g = MLADecodeGraph(c["q_nope"], c["q_pe"], c["cont"], d_lens, c["w_uk"], c["w_uv"],
                       tensor=False)
    g.run(sync=True)
    assert g.out.shape == (3, 3, 2, 8) and g.lse.shape == (3, 3, 2)
    np.testing.assert_array_equal(g.out.copy_to_host(), want)
    np.testing.assert_array_equal(g.lse.copy_to_host(), want_lse)
    d_lens.copy_to_device(np.array([8, 0, 2], np.int32))
    with pytest.raises(checks.RangeError, match=r"lengths: expected lengths 0 or in \[s_q=3"):
        g.run(sync=True)
    bad = g.out.copy_to_host()
    assert not bad[2].any() and np.isneginf(g.lse.copy_to_host()[2]).all()
    np.testing.assert_array_equal(bad[[0, 1]], want[[0, 1]])


@pytest.mark.device
def test_paged_graph_flags_a_short_length():
    """The paged graph (device table and lengths): the eager paged bits, and a
    short length flagged by the device page check."""
    from numba import cuda

    from mla.decode_graph import MLADecodeGraph

    c = multi_case(2, lengths=[9, 2, 0], page_size=4, seed=8)
    want, _ = decode(c, True, method="gemm_fma")
    d_lens = cuda.to_device(c["lengths"].astype(np.int32))
    g = MLADecodeGraph(c["q_nope"], c["q_pe"], c["pages"], d_lens, c["w_uk"], c["w_uv"],
                       tensor=False, page_table=cuda.to_device(c["table"]))
    g.run(sync=True)
    np.testing.assert_array_equal(g.out.copy_to_host(), want)
    d_lens.copy_to_device(np.array([9, 1, 0], np.int32))
    with pytest.raises(checks.RangeError, match="s_q=2"):
        g.run(sync=True)
    assert not g.out.copy_to_host()[1].any()


@pytest.mark.device
@pytest.mark.parametrize("method", ["flash", "gemm_fma"])
def test_causal_off_by_one_is_caught(method):
    """The planted defect (query i sees one position past its end) fails the
    oracle check; the defect-free run of the same case passes it."""
    tile = SIM_TILE if method == "flash" else None
    c = multi_case(2, lengths=[6, 3], seed=9)
    out, lse = decode(c, method=method, tile=tile, defect="mla_causal_off_by_one")
    r = DIMS.kv_rank
    caught = False
    for b, n in enumerate(c["lengths"]):
        rows = c["cont"][b, :n].astype(np.float32)
        p = parity(out[b], (c["q_nope"][b], c["q_pe"][b], rows[:, :r], rows[:, r:],
                            c["w_uk"], c["w_uv"]))
        caught |= not p["ok"]
    assert caught, f"{method}: mla_causal_off_by_one not caught"


# ---------------------------------------------------------------------------
# GPU, full shape
# ---------------------------------------------------------------------------

@pytest.mark.device
@pytest.mark.gpu
def test_full_shape_every_method():
    """B 64, 128 heads, r 512, d_rope 64, L 4096, s_q 2, fp16 cache (lengths
    varied up to 4096): every method against the absorbed oracle (8 sequences
    checked), query i bit-equal to the one-query prefix decode (at 128 heads
    both calls run the same GEMM kernels), page 64 bit-equal to contiguous."""
    from numba import cuda

    assert MODE == "gpu"
    d = DEEPSEEK_V3
    rng = np.random.default_rng(11)
    n_b, s_q, seq = 64, 2, 4096
    lengths = rng.integers(s_q, seq + 1, n_b)
    lengths[0], lengths[1] = seq, s_q
    c = multi_case(s_q, dims=d, lengths=lengths, page_size=64, dtype=np.float16, seed=11)
    for method in ("gemm", "gemm_fma", "flash", "auto"):
        out, lse = decode(c, method=method)
        cuda.synchronize()
        r = d.kv_rank
        for b in range(8):
            n = int(c["lengths"][b])
            rows = c["cont"][b, :n].astype(np.float32)
            p = parity(out[b], (c["q_nope"][b], c["q_pe"][b], rows[:, :r], rows[:, r:],
                                c["w_uk"], c["w_uv"]), naive=False)
            assert p["ok"], f"{method}: sequence {b}: err {p['err_absorbed']:.3e} > {p['tol']:.3e}"
        want, want_lse = prefix_decode(c, method=method)
        np.testing.assert_array_equal(out, want, err_msg=f"{method}: prefix bits")
        np.testing.assert_array_equal(lse, want_lse, err_msg=f"{method}: prefix LSE")
        got, _ = decode(c, True, method=method)
        np.testing.assert_array_equal(got, out, err_msg=f"{method}: paged bits")


# ---------------------------------------------------------------------------
# the benchmark's rows (bench/mla_multi.py)
# ---------------------------------------------------------------------------

def test_bench_bad_names():
    from bench import mla_multi as MM

    with pytest.raises(ValueError, match="paths"):
        MM.bench_mla_multi(object(), paths=("cublas",))
    with pytest.raises(ValueError, match="s_qs"):
        MM.bench_mla_multi(object(), s_qs=(2, 4))


class _OneCall:
    """A stand-in for ``bench.gpu.Timer``: runs ``fn`` once, reports 2 ms."""

    def time(self, fn, reps=1, warmup=0, host=False):
        fn()
        return 2.0


@pytest.mark.device
def test_bench_rows_at_a_tiny_shape(monkeypatch, capsys):
    """At a tiny shape with a stand-in timer: a row a s_q and the paged row,
    their ratios, the last query's bits equal to the one-query row's, the
    paged row's to the contiguous one's, errors within the oracle bound's
    order, and nothing printed."""
    from numba import cuda

    from bench import gpu
    from bench import mla_multi as MM

    rng = np.random.default_rng(0)

    def random_array(shape, dtype, seed):
        return cuda.to_device((rng.random(shape) - 0.5).astype(dtype))

    monkeypatch.setattr(gpu, "random_array", random_array)
    tiny = dict(batch=2, heads=2, latent=12, rope=4, nope=8, v_dim=8, seq=8)
    rows = MM.bench_mla_multi(_OneCall(), dtypes=("float16",), paths=("mla_decode",),
                              s_qs=(1, 2), page=4, shape=tiny, check_seqs=1)
    assert capsys.readouterr().out == ""
    by = {r["kernel"]: r for r in rows}
    assert set(by) == {"mla_decode_sq1", "mla_decode_sq2", "mla_decode_paged4"}
    assert all(set(r) == set(MM.COLUMNS) for r in rows)
    assert by["mla_decode_sq2"]["vs_sq1"] == 1.0 and by["mla_decode_paged4"]["vs_contiguous"] == 1.0
    assert by["mla_decode_sq2"]["max_abs_diff"] == 0.0
    assert by["mla_decode_paged4"]["max_abs_diff"] == 0.0
    assert by["mla_decode_sq2"]["flop"] == 2 * by["mla_decode_sq1"]["flop"]
    assert by["mla_decode_sq2"]["bytes"] == 2 * 8 * 16 * 2
    for r in (by["mla_decode_sq1"], by["mla_decode_sq2"]):
        assert r["max_err"] <= 4 * r["numpy_fp32_err"] + 1e-6
    assert "| mla_decode_paged4 | float16 | 1 | 4 |" in "\n".join(MM.summary_lines(rows))
