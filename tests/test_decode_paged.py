"""Paged KV caches and batch-invariant plans for the fast decode (``DecodePlan``).

A paged plan (``page_size=P``, ``layout="HND"`` or ``"NHD"``) reads each
position through a page table. Checked here, on the simulator and on a GPU:

* against the float64 oracle over the rows gathered through the table
  (``attention.oracle.decode_attention_paged_ref``), under the validation rule
  with the fast kernel's baseline order, on hostile fixtures: NaN in unused
  pages and in the tail of each last page, shuffled page tables (asserted not
  the identity) with a prefix page shared by two sequences, unused entries set
  to a huge index (the simulator raises on an out-of-bounds read), lengths 0,
  1, a multiple of P, a multiple plus one and the capacity, page sizes 1, 3
  (not a power of two), 4 and 16;
* bit for bit against the pooled plan on the same rows: the paged kernel sums
  in the same order, only its row addresses differ;
* a page index out of range among a sequence's used pages is flagged on the
  device and raised by ``check()`` naming ``page_table``;
* compile-only: the paged kernels compile for sm_90 with the vector loads and
  the cp.async ring of the pooled ones and nothing spilled.

Batch invariance (``batch_invariant=True``): one sequence decoded alone and
inside batches of 2, 17 and 64 with other lengths gives ``==`` outputs and LSE.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from tests.conftest import MODE, storage_dtype

HUGE = 2 ** 30  # unused page-table entries: never to be read



def _dtype(name):
    return storage_dtype(name)


def paged_case(rng, lens, page, n_kv, head_dim, dtype, layout, spare=3, share=True,
               max_pages=None):
    """(k_pages, v_pages, page_table) for ``lens``: pages in a shuffled order,
    sequence 0's first page shared by every sequence whose length covers a
    whole page (the same rows: a common prefix), NaN in every row no sequence
    uses (unused pages and the tails of last pages), ``HUGE`` in unused entries."""
    lens = [int(x) for x in lens]
    need = [-(-n // page) for n in lens]
    max_pages = max(need + [1]) if max_pages is None else max_pages
    owned = sum(need) + spare
    order = rng.permutation(owned)
    assert not np.array_equal(order, np.arange(owned))
    table = np.full((len(lens), max_pages), HUGE, np.int32)
    at = 0
    for m, n in enumerate(need):
        table[m, :n] = order[at:at + n]
        at += n
    prefix = int(table[0, 0]) if lens and lens[0] >= page else None
    if share and prefix is not None:
        for m in range(1, len(lens)):
            if lens[m] >= page:  # a full first page: the shared prefix
                table[m, 0] = prefix
    shape = (owned, n_kv, page, head_dim) if layout == "HND" else (owned, page, n_kv, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    for m, n in enumerate(lens):
        for p in range(n):
            pg, off = table[m, p // page], p % page
            idx = (pg, slice(None), off) if layout == "HND" else (pg, off)
            if np.isnan(k[idx]).all():
                k[idx] = rng.standard_normal((n_kv, head_dim))
                v[idx] = rng.standard_normal((n_kv, head_dim))
    return k.astype(dtype), v.astype(dtype), table


def run_plan(q, k, v, lens, table, dtype, page=None, layout="HND", **kw):
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan

    m, h, d = q.shape
    if page is None:
        n_kv, cap = k.shape[1], k.shape[2]
        pl = DecodePlan(m, h, n_kv, d, k.shape[0], cap, cache_dtype=dtype,
                        q_dtype=np.float32, **kw)
        tbl = {"slot_table": None if table is None else to_device(table)}
    else:
        n_kv = k.shape[1] if layout == "HND" else k.shape[2]
        pl = DecodePlan(m, h, n_kv, d, k.shape[0], table.shape[1] * page,
                        cache_dtype=dtype, q_dtype=np.float32, page_size=page,
                        layout=layout, **kw)
        tbl = {"page_table": to_device(table)}
    d_lse = to_device(np.zeros((m, h), np.float32))
    out = pl.run(to_device(q), to_device(k), to_device(v), to_device(np.asarray(lens, np.int32)),
                 lse=d_lse, sync=True, **tbl)
    return np.asarray(to_host(out)), np.asarray(to_host(d_lse)), pl


def judge(q, k, v, lens, table, layout, out, lse, dtype, what):
    from attention.oracle import decode_attention_paged_ref, paged_rows
    from validation import baselines, growth
    from validation.tolerance import assert_matches

    ref_o, ref_l = decode_attention_paged_ref(q, k, v, table, lens, layout)
    n_kv = k.shape[1] if layout == "HND" else k.shape[2]
    longest = max([int(x) for x in lens] + [1])
    kc = np.zeros((len(lens), n_kv, longest, q.shape[2]), np.float32)
    vc = np.zeros_like(kc)
    for m, n in enumerate(lens):
        kc[m, :, :n] = paged_rows(k, table, m, n, layout)
        vc[m, :, :n] = paged_rows(v, table, m, n, layout)
    label = growth.baseline_order("fast_decode", {"q": q}, dtype)
    base_o, base_l = baselines.decode_order(q, kc, vc, lens, np.arange(len(lens)), label)
    assert_matches(out, ref_o, base_o, what=f"out {what}")
    assert_matches(lse, ref_l, base_l, what=f"lse {what}")


# -- paged against the oracle, and against the pooled plan ---------------------

@pytest.mark.device
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page", [1, 3, 4, 16])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_matches_the_oracle_and_the_pooled_plan(layout, page, dtype):
    dt = _dtype(dtype)
    rng = np.random.default_rng(page * 7 + len(layout))
    cap = 4 * page + 1  # lengths up to the capacity
    lens = np.array([cap, 0, 1, 2 * page, 2 * page + 1], np.int32)
    h, n_kv, d = 4, 2, 32
    k, v, table = paged_case(rng, lens, page, n_kv, d, dt, layout)
    q = rng.standard_normal((len(lens), h, d)).astype(np.float32)
    out, lse, pl = run_plan(q, k, v, lens, table, dt, page, layout)
    assert pl.paged and pl.max_pages == table.shape[1]
    judge(q, k, v, lens, table, layout, out, lse, dt, f"{layout} P={page} {dtype}")
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)  # length 0
    # the same rows as a pooled cache: bit for bit the same result
    from attention.oracle import paged_rows

    pooled_k = np.full((len(lens), n_kv, table.shape[1] * page, d), np.nan, np.float32)
    pooled_v = np.full_like(pooled_k, np.nan)
    for m, n in enumerate(lens):
        pooled_k[m, :, :n] = paged_rows(k, table, m, n, layout).astype(np.float32)
        pooled_v[m, :, :n] = paged_rows(v, table, m, n, layout).astype(np.float32)
    p_out, p_lse, pooled = run_plan(q, pooled_k.astype(dt), pooled_v.astype(dt), lens, None, dt)
    assert pooled.n_split == pl.n_split and pooled.fast_plan["chunk"] == pl.fast_plan["chunk"]
    assert np.array_equal(out, p_out) and np.array_equal(lse, p_lse)


@pytest.mark.device
# a step in one page (16: one entry a step) and a row a page (1, the other layout); two
# cases, not the four layouts x pages: each is about 4 s of simulator time in CI
@pytest.mark.parametrize("layout,page", [("HND", 16), ("NHD", 1)])
def test_long_chunks_stream_the_page_table_through_the_ring(layout, page):
    """The 16-bit ring: a warp loads the page-table entries of its first S - 1
    steps before issuing them, then each turn those of the step after the one it
    issues (``fetch_pages``). The cases above are too short for that turn to
    run: here one split streams more than 2 (S - 1) + 1 steps a warp (the planted
    check: an in-loop fetch of the wrong step's entries fails this test on the
    simulator)."""
    dt = np.float16
    rng = np.random.default_rng(31 + page)
    lens = np.array([1033], np.int32)  # one sequence: the simulator's time is its rows
    h, n_kv, d = 2, 1, 128  # vector rows: the ring
    k, v, table = paged_case(rng, lens, page, n_kv, d, dt, layout)
    q = rng.standard_normal((len(lens), h, d)).astype(np.float32)
    out, lse, pl = run_plan(q, k, v, lens, table, dt, page, layout, n_split=1)
    fp = pl.fast_plan
    step = fp["block"] // fp["lanes"] * fp["unroll"]  # positions a block covers a step
    steps_a_warp = -(-int(lens[0]) // step)
    assert fp["stages"] >= 3 and steps_a_warp > 2 * (fp["stages"] - 1) + 1, (fp, steps_a_warp)
    judge(q, k, v, lens, table, layout, out, lse, dt, f"{layout} P={page} long")


@pytest.mark.device
def test_split_plans_read_pages_across_chunks():
    """Several splits a sequence (chunks end inside pages, P = 5): still the
    oracle's result."""
    rng = np.random.default_rng(5)
    lens = np.array([97, 40], np.int32)
    k, v, table = paged_case(rng, lens, 5, 1, 16, np.float32, "HND")
    q = rng.standard_normal((2, 2, 16)).astype(np.float32)
    out, lse, pl = run_plan(q, k, v, lens, table, np.float32, 5, n_split=3)
    assert pl.n_split == 3 and pl.fast_plan["chunk"] % 5
    judge(q, k, v, lens, table, "HND", out, lse, np.float32, "3 splits")


@pytest.mark.device
@pytest.mark.parametrize("where", ["negative", "past the pages"])
@pytest.mark.parametrize("dtype,page", [("float32", 4), ("float16", 4), ("float16", 16)])
def test_bad_page_index_is_flagged_not_read(where, dtype, page):
    """A page index outside [0, num_pages) among a sequence's used pages: not
    read (the simulator would raise on the read), flagged, and ``check()``
    raises naming page_table; entries past a length are never looked at. fp32
    checks a chunk's entries before its loads; fp16 (the cp.async ring) as it
    streams them, one entry a row (P 4) or a warp step (P 16), and discards
    the chunk: its sequence comes out empty."""
    from attention.core.device import to_device, to_host

    dt = np.dtype(dtype)
    rng = np.random.default_rng(9)
    lens = np.array([2 * page + 1, page + 2], np.int32)
    k, v, table = paged_case(rng, lens, page, 1, 64, dt, "HND", share=False)
    table[1, 1] = -1 if where == "negative" else k.shape[0]
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    with pytest.raises(checks.RangeError, match=rf"page_table: sequence 1 \(length {page + 2}\)"):
        run_plan(q, k, v, lens, table, dt, page)
    # the good sequence is still attended, the bad one is empty
    from attention.decode.plan import DecodePlan

    pl = DecodePlan(2, 2, 1, 64, k.shape[0], table.shape[1] * page, cache_dtype=dt,
                    q_dtype=np.float32, page_size=page)
    out = pl.run(to_device(q), to_device(k), to_device(v), to_device(lens),
                 page_table=to_device(table))
    out = np.asarray(to_host(out))
    assert np.all(out[1] == 0) and np.isfinite(out[0]).all() and np.any(out[0] != 0)
    with pytest.raises(checks.RangeError, match="page_table"):
        pl.check()


def test_paged_plan_arguments_are_named():
    from attention.decode.plan import DecodePlan

    with pytest.raises(checks.RangeError, match="page_size"):
        DecodePlan(2, 4, 2, 32, 8, 64, page_size=0)
    with pytest.raises(checks.LayoutError, match="layout"):
        DecodePlan(2, 4, 2, 32, 8, 64, page_size=16, layout="HDN")
    with pytest.raises(checks.AttentionInputError, match="n_split"):
        DecodePlan(2, 4, 2, 32, 8, 64, n_split=2, batch_invariant=True)


@pytest.mark.device
def test_paged_run_needs_a_page_table_and_a_pooled_plan_refuses_one():
    from attention.core.device import to_device
    from attention.decode.plan import DecodePlan

    paged = DecodePlan(1, 2, 1, 16, 4, 8, cache_dtype=np.float32, page_size=4)
    pooled = DecodePlan(1, 2, 1, 16, 1, 8, cache_dtype=np.float32)
    q = to_device(np.zeros((1, 2, 16), np.float32))
    lens = to_device(np.ones(1, np.int32))
    pages = to_device(np.zeros((4, 1, 4, 16), np.float32))
    with pytest.raises(checks.ShapeError, match="page_table: a paged plan needs"):
        paged.run(q, pages, pages, lens)
    cache = to_device(np.zeros((1, 1, 8, 16), np.float32))
    with pytest.raises(checks.AttentionInputError, match="page_table: this plan reads a pooled"):
        pooled.run(q, cache, cache, lens, page_table=to_device(np.zeros((1, 2), np.int32)))
    with pytest.raises(checks.ShapeError, match="page_table"):  # the wrong table shape
        paged.run(q, pages, pages, lens, page_table=to_device(np.zeros((1, 3), np.int32)))


# -- batch invariance ------------------------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("paged", [False, True])
def test_batch_invariant_plans_give_a_sequence_the_same_bits(paged):
    """Sequence 0 alone, and inside batches of 2, 17 and 64 with other lengths
    (the simulator, deterministic anyway and slow, runs batches of 1 and 3 for
    the code path): ``==`` outputs and LSE under ``batch_invariant=True`` (the
    split length is fixed by the capacity, not by the batch, and the splits
    merge in a fixed order). Every plan has the same capacity: the split
    length follows it."""
    rng = np.random.default_rng(11)
    # the simulator runs a block's threads in Python: a shorter capacity
    # there (still several splits: MIN_CHUNK positions each)
    sim = MODE == "sim"
    h, n_kv, d, cap = 2, 1, 16, (300 if sim else 600)
    page = 16 if paged else None
    first = cap - 23  # several splits
    results = []
    for batch in (1, 3) if sim else (1, 2, 17, 64):
        lens = np.concatenate([[first], rng.integers(0, cap + 1, batch - 1)]).astype(np.int32)
        lens[-1] = cap if batch > 1 else lens[-1]
        q = rng.standard_normal((batch, h, d)).astype(np.float32)
        k1 = np.random.default_rng(3).standard_normal((n_kv, cap, d)).astype(np.float32)
        v1 = np.random.default_rng(4).standard_normal((n_kv, cap, d)).astype(np.float32)
        q[0] = np.random.default_rng(5).standard_normal((h, d))
        if paged:
            k, v, table = paged_case(rng, lens, page, n_kv, d, np.float32, "HND", share=False,
                                     max_pages=-(-cap // page))  # the same capacity
            for p in range(first):  # sequence 0's rows are the same in every batch
                pg, off = table[0, p // page], p % page
                k[pg, :, off], v[pg, :, off] = k1[:, p], v1[:, p]
        else:
            k = rng.standard_normal((batch, n_kv, cap, d)).astype(np.float32)
            v = rng.standard_normal((batch, n_kv, cap, d)).astype(np.float32)
            k[0], v[0], table = k1, v1, None
        out, lse, pl = run_plan(q, k, v, lens, table, np.float32, page,
                                batch_invariant=True)
        assert pl.batch_invariant and pl.n_split > 1
        results.append((out[0].copy(), lse[0].copy()))
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


@pytest.mark.device
def test_batch_invariant_plan_is_the_same_eager_graph_and_run_to_run():
    """A batch-invariant paged plan (several splits and the combine): three eager
    runs and, on a GPU, the same run captured as a CUDA graph and replayed
    (``attention.core.graph.CapturedLaunches``) give ``==`` outputs and LSE. The
    simulator cannot capture: it checks the runs against each other."""
    from attention.core.device import SIMULATOR, to_device, to_host
    from attention.core.graph import CapturedLaunches
    from attention.decode.plan import DecodePlan

    rng = np.random.default_rng(13)
    cap, page, h, n_kv, d = (300 if MODE == "sim" else 600), 16, 4, 2, 32
    lens = np.array([cap - 5, 40, 0], np.int32)
    k, v, table = paged_case(rng, lens, page, n_kv, d, np.float16, "HND",
                             max_pages=-(-cap // page))
    q = rng.standard_normal((3, h, d)).astype(np.float16)
    pl = DecodePlan(3, h, n_kv, d, k.shape[0], cap, cache_dtype=np.float16, page_size=page,
                    batch_invariant=True)
    assert pl.n_split > 1
    args = (to_device(q), to_device(k), to_device(v), to_device(lens))
    d_table = to_device(table)
    runs = []
    for _ in range(3):
        pl.run(*args, page_table=d_table, sync=True)
        runs.append((np.asarray(to_host(pl.out)).copy(), np.asarray(to_host(pl.lse)).copy()))
    if not SIMULATOR:
        graph = CapturedLaunches(lambda st: pl.run(*args, page_table=d_table, stream=st),
                                 lambda: pl.run(*args, page_table=d_table, sync=True))
        assert graph.path == "graph", graph.fallback_reason
        for buf in (pl.out, pl.lse):  # the replay must write them again
            buf.copy_to_device(np.full(buf.shape, np.nan, np.float32))
        graph.launch(sync=True)
        pl.check()
        runs.append((np.asarray(to_host(pl.out)).copy(), np.asarray(to_host(pl.lse)).copy()))
    for out, lse in runs[1:]:
        assert np.array_equal(out, runs[0][0]) and np.array_equal(lse, runs[0][1])
    assert np.isfinite(runs[0][0]).all() and np.any(runs[0][0] != 0)


def test_invariant_chunk_does_not_follow_the_batch():
    from attention.decode import fast

    chunks = {fast.plan(m, 32, 8, 128, 4096, "f16",
                        chunk=fast.invariant_chunk(32, 8, 128, 4096, "f16"))["chunk"]
              for m in (1, 2, 17, 64)}
    assert len(chunks) == 1
    # the default plans do follow it (why the option exists)
    assert len({fast.plan(m, 32, 8, 128, 4096, "f16")["n_split"] for m in (1, 64)}) == 2


# -- compile-only -------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kind,want", [("f16", "cp.async.cg.shared.global"),
                                       ("f32", "ld.global.v4.f32")])
def test_paged_kernels_compile(layout, kind, want):
    """The paged kernels compile for sm_90 with the pooled kernels' loads (the
    16-bit ring's cp.async, fp32's 16-byte loads) and nothing spilled."""
    from numba import cuda, types

    from attention.decode import fast as F

    elem = {"f32": types.float32, "f16": types.float16}[kind]
    pl = F.plan(2, 8, 2, 128, 1024, kind, paging=layout)
    assert pl["kernel"].py_func.__name__.endswith("_paged" + layout)
    cache = types.Array(elem, 4, "C")
    f32 = types.float32
    sig = (types.Array(f32, 3, "C"), cache, cache, types.int32[::1],
           types.Array(types.int32, 2, "C"), f32, types.int32, types.Array(f32, 3, "C"),
           types.Array(f32, 2, "C"), types.Array(f32, 4, "C"), types.Array(f32, 4, "C"),
           types.int32[::1])
    ptx, _ = cuda.compile_ptx(pl["kernel"].py_func, sig, cc=(9, 0), fastmath=True)
    assert want in ptx
    assert "ld.local" not in ptx, "per-lane state spilled to local memory"
    assert "bar.red.or" in ptx or "vote" in ptx or "bar.sync" in ptx  # the page check's OR


# -- the falsification suite (validation.suite_decode_paged) ---------------------

@pytest.mark.device
# the whole small suite in one test, most of it kernel compiles: 140 s on the H100
# at 504265b and past gpu_all's 150 s per-test limit at 27a94bd (suite part 0 of 2,
# 12 workers); the limit is a hang guard, so this test gets a longer one
@pytest.mark.timeout(600)
def test_paged_suite_clean_passes():
    from validation import suite_decode_paged as S

    checks = S.run_suite(None, small=True)
    assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]


@pytest.mark.device
@pytest.mark.parametrize("defect", ["page_off_by_one", "page_offset_stride",
                                    "causal_off_by_one", "append_page_off_by_one",
                                    "append_offset_stride", "append_behind",
                                    "chunk_follows_batch"])
def test_paged_suite_catches_each_defect(defect):
    """Each planted defect fails the suite's check that is built for it (the
    whole suite runs every check for every defect in the validation run)."""
    from attention.cache.paged import APPEND_DEFECTS
    from attention.decode.fast import PAGED_DEFECTS
    from validation import suite_decode_paged as S
    from validation.suite import caught
    from validation.suite_decode_fast import cases_for

    assert set(S.DEFECTS) == {"page_off_by_one", "page_offset_stride", "causal_off_by_one",
                              "append_page_off_by_one", "append_offset_stride", "append_behind",
                              "chunk_follows_batch"}
    if defect in PAGED_DEFECTS:
        case = [c for c in cases_for(True) if c.dtype == "float32" and c.n_split == 3][0]
        checks = [c for layout, page in S.LAYOUTS
                  for c in S.check_layout(case, layout, page, defect)]
    elif defect == "causal_off_by_one":
        case = [c for c in cases_for(True) if c.dtype == "float32" and c.n_split == 3][0]
        checks = S.check_multi(case, defect)
    elif defect in APPEND_DEFECTS:
        checks = S.check_append(defect)
    else:
        checks = S.check_invariant_chunk(defect)
    assert caught(checks), f"{defect} escaped: " + "; ".join(
        f"{c.name}: {c.detail}" for c in checks)
