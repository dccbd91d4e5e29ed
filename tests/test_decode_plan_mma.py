"""``DecodePlan(method=...)``: the tensor-core decode behind the plan/run API.

* **Routing** (host only): ``method="auto"`` (the default) takes the
  tensor-core kernel (``attention.decode.mma``) for multi-token plans it can
  take (16-bit cache, q in its dtype, D 32 / 64 / 128, H / H_kv x T <= 16, no
  planted defect) and for fp8 caches with q float16 at any T, and the
  CUDA-core one otherwise; ``method="mma"`` on a plan
  it cannot take raises naming the reason.
* **Bits** (simulator and GPU): a tensor-core plan's run gives
  ``mma.mma_decode``'s bits for the same split plan (the same kernel and
  chunks), on a pooled cache with a permuted slot table and NaN past every
  length and on a paged HND cache with shuffled and shared pages; so the
  oracle tests of that kernel (``tests/test_decode_mma.py``) cover the plan,
  and the outputs are also judged here against the oracle with the rounded-P
  baseline.
* **The device range check** (in the kernel's blocks: the checked form of
  ``mma.mma_decode_kernel``): a length outside ``[0, limit]`` or in ``1 .. T -
  1``, a slot outside the pool and a page entry outside the pages below a
  length are each attended as empty (zeros, LSE -inf) while the other
  sequences keep their bits, and ``check()`` raises ``RangeError`` naming
  ``seq_lens``, ``slot_table`` or ``page_table``; the checked kernel compiles
  with no local memory and its block-wide OR (plain process).
* **Batch invariance** (``batch_invariant=True``): the chunk is
  ``mma.invariant_chunk``'s, so sequence 0 alone and in batches of 2, 17 and 64
  (the simulator: 1 and 2) gets the same bits, pooled and paged; on the host,
  the plan's planted ``chunk_follows_batch`` moves the chunk at B 17 / L 4096.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.decode import mma
from attention.decode.plan import DecodePlan
from tests.test_decode_mma import check_case, gathered, pooled_case, queries
from tests.test_decode_paged import HUGE, paged_case

F16 = np.dtype(np.float16)


FP8_Q16 = dict(cache_dtype=np.uint8, q_dtype=np.float16)
# (plan arguments over a 2-sequence, 8-head, H_kv 2, D 64, T 4, fp16 plan; the method
# it must take). One case a test: on a GPU each plan compiles its kernels (about
# 10 s), and 20 plans in one test outran the suite's 150-s test timeout.
ROUTES = [
    ({}, "mma"),
    ({"cache_dtype": "bfloat16"}, "mma"),
    ({"t_q": 1}, "fast"),  # one query: the CUDA-core kernel is the faster
    ({"cache_dtype": np.float32}, "fast"),
    ({"q_dtype": np.float32}, "fast"),
    ({"head_dim": 40}, "fast"),
    ({"n_heads": 16, "n_kv_heads": 2}, "fast"),  # 8 heads x 4 queries > 16 rows
    ({"batch_invariant": True}, "mma"),  # a fixed chunk (mma.invariant_chunk)
    ({"defect": "one_short"}, "fast"),
    ({"page_size": 16, "layout": "NHD", "kv_slots": 9}, "mma"),
    ({"method": "fast"}, "fast"),
    ({"t_q": 1, "method": "mma"}, "mma"),
    # fp8 with q float16 (either scale mode): the tensor-core kernel at any T (the
    # faster at T 1 too on the H200, notes/bench.md); other q dtypes the CUDA-core one
    (FP8_Q16, "mma"),
    ({**FP8_Q16, "t_q": 1}, "mma"),
    ({**FP8_Q16, "t_q": 1, "fp8_scales": "token_head"}, "mma"),
    ({**FP8_Q16, "t_q": 1, "method": "fast"}, "fast"),
    ({"cache_dtype": np.uint8, "t_q": 1}, "fast"),  # q float32 (the default)
    ({"cache_dtype": np.uint8, "q_dtype": "bfloat16"}, "fast"),
    ({**FP8_Q16, "head_dim": 96}, "fast"),
    ({**FP8_Q16, "defect": "fp8_scale_twice"}, "fast"),
]


@pytest.mark.parametrize("kw,want", ROUTES,
                         ids=[",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in kw.items())
                              or "default" for kw, _ in ROUTES])
def test_auto_takes_the_tensor_core_kernel_where_it_can(kw, want):
    args = dict(m=2, n_heads=8, n_kv_heads=2, head_dim=64, kv_slots=2, max_seq=64,
                cache_dtype=np.float16, t_q=4)
    args.update(kw)
    assert DecodePlan(**args).method == want


def test_mma_method_names_what_it_cannot_take():
    base = dict(m=2, n_heads=8, n_kv_heads=2, head_dim=64, kv_slots=2, max_seq=64, t_q=4,
                method="mma")
    for kw, why in (({"cache_dtype": np.float32}, "float16, bfloat16 or fp8"),
                    ({"cache_dtype": np.uint8, "q_dtype": np.float32}, "q in float16"),
                    ({"cache_dtype": np.uint8, "q_dtype": np.float16,
                      "fp8_scales": "token_head", "head_dim": 96}, "head_dim 96"),
                    ({"cache_dtype": np.float16, "q_dtype": np.float32}, "q_dtype"),
                    ({"cache_dtype": np.float16, "head_dim": 96}, "head_dim 96"),
                    ({"cache_dtype": np.float16, "n_heads": 32}, "16 query rows"),
                    ({"cache_dtype": np.float16, "defect": "one_short"}, "one_short")):
        with pytest.raises(checks.AttentionInputError, match=f"method.*{why}"):
            DecodePlan(**dict(base, **kw))
    with pytest.raises(checks.AttentionInputError, match="method: expected one of"):
        DecodePlan(**dict(base, method="tensor"))
    with pytest.raises(checks.AttentionInputError, match="give method='mma'"):
        DecodePlan(**dict(base, cache_dtype=np.float16, method="fast",
                          defect="causal_tile_edge"))


def _device(*xs):
    from numba import cuda

    return [cuda.to_device(np.ascontiguousarray(x)) for x in xs]


def _run(pl, q, k, v, lens, table=None, **kw):
    d_q, d_k, d_v, d_lens = _device(q, k, v, np.asarray(lens, np.int32))
    d_table = None if table is None else _device(np.asarray(table, np.int32))[0]
    key = "page_table" if pl.paged else "slot_table"
    out = pl.run(d_q, d_k, d_v, d_lens, **{key: d_table}, **kw)
    return np.asarray(out.copy_to_host()), pl.lse.copy_to_host()


POOLED_LENS = [0, 19, 77]  # T 4: empty, query 0 ending on the tile edge at 16, two splits


def _pooled():
    rng = np.random.default_rng(5)
    k, v, slots, k_rows, v_rows = pooled_case(rng, POOLED_LENS, 1, 32, F16, cap=80)
    q = queries(rng, 3, 4, 4, 32, F16)  # GQA 4 x T 4: one 16-row tile
    pl = DecodePlan(3, 4, 1, 32, k.shape[0], 80, cache_dtype=np.float16, t_q=4, n_split=2)
    return pl, q, k, v, slots, k_rows, v_rows


@pytest.mark.device
def test_pooled_run_gives_mma_decode_bits():
    pl, q, k, v, slots, k_rows, v_rows = _pooled()
    assert pl.method == "mma" and pl.n_split == 2 and pl.fast_plan is None
    got = _run(pl, q, k, v, POOLED_LENS, slots, sync=True)
    want = mma.mma_decode(q, k, v, np.asarray(POOLED_LENS, np.int32), slot_table=slots,
                          n_split=2)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    check_case(q, k_rows, v_rows, POOLED_LENS, got, F16, "DecodePlan(method='mma') pooled")


@pytest.mark.device
def test_paged_run_gives_mma_decode_bits():
    rng = np.random.default_rng(6)
    lens = [21, 0, 40]
    k, v, table = paged_case(rng, lens, 16, 1, 32, F16, "HND")
    q = queries(rng, 3, 2, 4, 32, F16)
    pl = DecodePlan(3, 4, 1, 32, k.shape[0], table.shape[1] * 16, cache_dtype=np.float16,
                    t_q=2, page_size=16)
    assert pl.method == "mma"
    got = _run(pl, q, k, v, lens, table, sync=True)
    want = mma.mma_decode(q, k, v, np.asarray(lens, np.int32), page_table=table,
                          n_split=pl.n_split)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    k_rows, v_rows = gathered(k, table, lens, "HND"), gathered(v, table, lens, "HND")
    check_case(q, k_rows, v_rows, lens, got, F16, "DecodePlan(method='mma') paged")


@pytest.mark.device
def test_bad_lengths_slots_and_pages_are_flagged_and_attended_as_empty():
    pl, q, k, v, slots, k_rows, v_rows = _pooled()
    assert pl.method == "mma"
    good = _run(pl, q, k, v, POOLED_LENS, slots)
    pl.check()
    check_case(q, k_rows, v_rows, POOLED_LENS, good, F16, "DecodePlan(method='mma') clean run")
    # lengths 1 .. T - 1 and past the plan's limit (80); then a slot outside the pool
    for lens, table, name, bad in (([2, 19, 81], slots, "seq_lens", [0, 2]),
                                   (POOLED_LENS, [slots[0], slots[1], k.shape[0]],
                                    "slot_table", [2])):
        got = _run(pl, q, k, v, lens, table)
        with pytest.raises(checks.RangeError, match=name):
            pl.check()
        assert np.all(got[0][bad] == 0) and np.all(got[1][bad] == -np.inf), name
        keep = [i for i in range(3) if i not in bad]
        np.testing.assert_array_equal(got[0][keep], good[0][keep])
        pl.check()  # the flag was cleared
    rng = np.random.default_rng(7)
    lens = [21, 40]
    kp, vp, table = paged_case(rng, lens, 16, 1, 32, F16, "HND")
    qp = queries(rng, 2, 2, 4, 32, F16)
    pp = DecodePlan(2, 4, 1, 32, kp.shape[0], table.shape[1] * 16, cache_dtype=np.float16,
                    t_q=2, page_size=16)
    table = table.copy()
    table[1, 2] = HUGE  # the last page below sequence 1's length
    got = _run(pp, qp, kp, vp, lens, table)
    with pytest.raises(checks.RangeError, match="page_table"):
        pp.check()
    assert np.all(got[0][1] == 0) and np.all(got[1][1] == -np.inf)


@pytest.mark.compile
@pytest.mark.parametrize("paging", [None, "HND"])
def test_checked_kernel_compiles_with_its_range_check(paging):
    from numba import cuda, types

    from tests.test_decode_mma import _signature

    kern = mma.mma_decode_kernel("f16", 128, 4, 4, paging=paging, checked=True)
    sig = _signature() + (types.int32, types.Array(types.int32, 1, "C"))
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), fastmath=True)
    assert ".local" not in ptx and "atom.global.add" in ptx
    assert ("bar.red.or" in ptx) == (paging is not None)  # the page entries' OR
    assert ptx.count("mma.sync.aligned.m16n8k16") == 128 // 16 * 2 + 128 // 8


# -- batch invariance on the tensor-core plan ------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("paged", [False, True])
def test_batch_invariant_mma_plans_give_a_sequence_the_same_bits(paged):
    """``DecodePlan(method="mma", batch_invariant=True)``, T 2: sequence 0 alone
    and inside batches of 2, 17 and 64 with other lengths (the simulator: 1 and
    2, a short capacity and one kv head, for the code path) gives ``==`` outputs
    and LSE. The
    chunk is ``mma.invariant_chunk``'s (the lone sequence's), so on a GPU the
    default plan of 17 or 64 sequences would split otherwise."""
    from attention.core.device import to_device, to_host
    from attention.decode import mma as MMA
    from attention.decode.plan import DecodePlan
    from tests.conftest import MODE
    from tests.test_decode_paged import paged_case

    sim = MODE == "sim"
    h, n_kv, d, t_q, f16 = (2, 1, 32, 2, np.float16) if sim else (4, 2, 32, 2, np.float16)
    cap = 300 if sim else 4096
    page = 16 if paged else None
    first = cap - 23
    k1 = np.random.default_rng(3).standard_normal((n_kv, cap, d)).astype(f16)
    v1 = np.random.default_rng(4).standard_normal((n_kv, cap, d)).astype(f16)
    q1 = np.random.default_rng(5).standard_normal((t_q, h, d)).astype(f16)
    rng = np.random.default_rng(12)
    results = []
    for batch in (1, 2) if sim else (1, 2, 17, 64):
        lens = np.concatenate([[first], rng.integers(t_q, cap + 1, batch - 1)]).astype(np.int32)
        q = rng.standard_normal((batch, t_q, h, d)).astype(f16)
        q[0] = q1
        if paged:
            k, v, table = paged_case(rng, lens, page, n_kv, d, f16, "HND", share=False,
                                     max_pages=-(-cap // page))
            for p in range(first):  # sequence 0's rows are the same in every batch
                pg, off = table[0, p // page], p % page
                k[pg, :, off], v[pg, :, off] = k1[:, p], v1[:, p]
            extra, tbl = {"page_size": page}, {"page_table": to_device(table)}
        else:
            k = rng.standard_normal((batch, n_kv, cap, d)).astype(f16)
            v = rng.standard_normal((batch, n_kv, cap, d)).astype(f16)
            k[0], v[0] = k1, v1
            extra, tbl = {}, {}
        pl = DecodePlan(batch, h, n_kv, d, k.shape[0], cap, cache_dtype=f16, q_dtype=f16,
                        t_q=t_q, batch_invariant=True, **extra)
        assert pl.method == "mma" and pl.batch_invariant and pl.n_split > 1
        assert pl.kernel_plan["chunk"] == MMA.invariant_chunk(h, n_kv, d, cap, "f16", t_q=t_q)
        d_lse = to_device(np.zeros((batch, t_q, h), np.float32))
        out = pl.run(to_device(q), to_device(k), to_device(v), to_device(lens), lse=d_lse,
                     sync=True, **tbl)
        results.append((np.asarray(to_host(out))[0].copy(), np.asarray(to_host(d_lse))[0]))
    for out, lse in results[1:]:
        assert np.array_equal(out.view(np.uint32), results[0][0].view(np.uint32))
        assert np.array_equal(lse.view(np.uint32), results[0][1].view(np.uint32))


def test_mma_invariant_chunk_ignores_the_batch_and_the_planted_switch_does_not():
    """At B 17 / L 4096 the default tensor-core plan splits otherwise than a lone
    sequence's plan; a batch-invariant plan keeps the lone sequence's chunk, and
    the plan's planted ``chunk_follows_batch`` takes the batch's (its positive
    control: the chunk moves, so the bits could)."""
    from attention.decode import mma as MMA

    args = (17, 32, 8, 128, 4096)
    lone = MMA.invariant_chunk(32, 8, 128, 4096, "f16")
    batch_chunk = MMA.plan(*args, "f16")["chunk"]
    assert lone != batch_chunk
    kw = dict(m=17, n_heads=32, n_kv_heads=8, head_dim=128, kv_slots=17, max_seq=4096,
              cache_dtype=np.float16, q_dtype=np.float16, method="mma", batch_invariant=True)
    assert DecodePlan(**kw).kernel_plan["chunk"] == lone
    assert DecodePlan(**kw, defect="chunk_follows_batch").kernel_plan["chunk"] == batch_chunk
