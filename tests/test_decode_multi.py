"""Multi-token decode (``DecodePlan(t_q=T)``): T new queries a sequence, causal among themselves.

q is ``[M, T, H, D]``; query i of sequence m attends positions
``0 .. seq_lens[m] - T + i`` (the length counts the T new tokens). Checked
here, on the simulator and on a GPU:

* against the float64 oracle (``attention.oracle.decode_attention_multi_ref``)
  under the validation rule with the fast kernel's baseline order, for
  pooled and paged caches (HND and NHD, a page size that is not a power of
  two), fp32 / fp16 / bf16, one split and several, lengths 0, T, T + 1 and
  the capacity, NaN past every length (a read past a query's causal end
  shows up as NaN);
* bit for bit: query i of a T-query plan equals a one-query plan with the
  same split length over the first ``len - T + 1 + i`` positions (the kernel
  is the one-query kernel with the block's length shortened);
* a length in 1 .. T - 1 is flagged on the device and ``check()`` names
  ``seq_lens`` and T; ``t_q`` outside 1 .. 16 is refused when the plan is made;
* the planted ``causal_off_by_one`` (query i sees one position more) fails
  the oracle check: the check can fail;
* compile-only: the T = 4 kernels compile for sm_90 with nothing spilled.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from tests.conftest import storage_dtype
from tests.test_decode_paged import paged_case


def _pooled(rng, lens, cap, n_kv, d, dt):
    """A pooled cache [M, H_kv, cap, D] with NaN past each length."""
    k = np.full((len(lens), n_kv, cap, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for m, n in enumerate(lens):
        k[m, :, :n] = rng.standard_normal((n_kv, n, d))
        v[m, :, :n] = rng.standard_normal((n_kv, n, d))
    return k.astype(dt), v.astype(dt)


def run_multi(q, k, v, lens, dt, *, table=None, page=None, layout="HND", **kw):
    """(out [M, T, H, D], lse [M, T, H], plan) of a multi-token plan."""
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan

    m, t_q, h, d = q.shape
    if page is None:
        n_kv, cap, slots = k.shape[1], k.shape[2], k.shape[0]
        tbl = {}
    else:
        n_kv = k.shape[1] if layout == "HND" else k.shape[2]
        cap, slots = table.shape[1] * page, k.shape[0]
        kw.update(page_size=page, layout=layout)
        tbl = {"page_table": to_device(table)}
    pl = DecodePlan(m, h, n_kv, d, slots, cap, cache_dtype=dt, q_dtype=np.float32, t_q=t_q,
                    **kw)
    out = pl.run(to_device(q), to_device(k), to_device(v), to_device(np.asarray(lens, np.int32)),
                 sync=True, **tbl)
    return np.asarray(to_host(out)), np.asarray(to_host(pl.lse)), pl


def judge_multi(q, k_rows, v_rows, lens, out, lse, dt, what):
    """Each query against the oracle and the fp32 baseline of its causal prefix
    (``k_rows`` / ``v_rows``: the pooled rows [M, H_kv, L, D])."""
    from attention.oracle import decode_attention_multi_ref
    from validation import baselines, growth
    from validation.tolerance import assert_matches

    t_q = q.shape[1]
    ref_o, ref_l = decode_attention_multi_ref(q, k_rows, v_rows, lens)
    for i in range(t_q):
        seen = [0 if n == 0 else n - t_q + 1 + i for n in lens]
        label = growth.baseline_order("fast_decode", {"q": q[:, i]}, dt)
        base_o, base_l = baselines.decode_order(q[:, i], k_rows, v_rows, seen,
                                                np.arange(len(lens)), label)
        assert_matches(out[:, i], ref_o[:, i], base_o, what=f"out {what} query {i}")
        assert_matches(lse[:, i], ref_l[:, i], base_l, what=f"lse {what} query {i}")


@pytest.mark.device
@pytest.mark.parametrize("dtype,n_split", [("float32", 1), ("float16", 2), ("bfloat16", 3)])
def test_pooled_multi_token_matches_the_oracle(dtype, n_split):
    dt = storage_dtype(dtype)
    rng = np.random.default_rng(n_split)
    t_q, h, n_kv, d, cap = 4, 4, 2, 32, 45
    lens = np.array([cap, 0, t_q, t_q + 1], np.int32)
    k, v = _pooled(rng, lens, cap, n_kv, d, dt)
    q = rng.standard_normal((len(lens), t_q, h, d)).astype(np.float32)
    out, lse, pl = run_multi(q, k, v, lens, dt, n_split=n_split)
    assert out.shape == (4, t_q, h, d) and lse.shape == (4, t_q, h) and pl.t_q == t_q
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)  # an empty sequence
    assert np.isfinite(out).all()  # no NaN row past a causal end was read
    kr = np.nan_to_num(k.astype(np.float32))
    vr = np.nan_to_num(v.astype(np.float32))
    judge_multi(q, kr, vr, lens, out, lse, dt, f"pooled {dtype} splits {n_split}")


@pytest.mark.device
@pytest.mark.parametrize("layout,page", [("HND", 3), ("NHD", 4)])
def test_paged_multi_token_matches_the_oracle(layout, page):
    from attention.oracle import paged_rows

    dt = np.float16
    rng = np.random.default_rng(page)
    t_q, h, n_kv, d = 3, 4, 2, 32
    lens = np.array([4 * page + 1, t_q, 2 * page, 0], np.int32)
    k, v, table = paged_case(rng, lens, page, n_kv, d, dt, layout)
    q = rng.standard_normal((len(lens), t_q, h, d)).astype(np.float32)
    out, lse, pl = run_multi(q, k, v, lens, dt, table=table, page=page, layout=layout,
                             n_split=2)
    longest = int(lens.max())
    kr = np.zeros((len(lens), n_kv, longest, d), np.float32)
    vr = np.zeros_like(kr)
    for m, n in enumerate(lens):
        kr[m, :, :n] = paged_rows(k, table, m, n, layout)
        vr[m, :, :n] = paged_rows(v, table, m, n, layout)
    judge_multi(q, kr, vr, lens, out, lse, dt, f"paged {layout} P={page}")


@pytest.mark.device
def test_each_query_is_the_one_query_plan_on_its_prefix():
    """Query i of T = 4 is bit for bit the one-query plan (same split length)
    over the first len - 3 + i positions: outputs and LSE compared with ``==``."""
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan

    dt = np.float16
    rng = np.random.default_rng(11)
    t_q, h, n_kv, d, cap = 4, 4, 1, 32, 40
    lens = np.array([cap, 9, 4], np.int32)
    k, v = _pooled(rng, lens, cap, n_kv, d, dt)
    q = rng.standard_normal((3, t_q, h, d)).astype(dt)
    pl = DecodePlan(3, h, n_kv, d, 3, cap, cache_dtype=dt, t_q=t_q, n_split=2, method="fast")
    pl.run(to_device(q), to_device(k), to_device(v), to_device(lens), sync=True)
    out, lse = np.asarray(to_host(pl.out)), np.asarray(to_host(pl.lse))
    one = DecodePlan(3, h, n_kv, d, 3, cap, cache_dtype=dt, n_split=2)
    assert one.fast_plan["chunk"] == pl.fast_plan["chunk"]
    for i in range(t_q):
        seen = (lens - t_q + 1 + i).astype(np.int32)
        one.run(to_device(np.ascontiguousarray(q[:, i])), to_device(k), to_device(v),
                to_device(seen), sync=True)
        assert np.array_equal(out[:, i], np.asarray(to_host(one.out))), f"query {i}"
        assert np.array_equal(lse[:, i], np.asarray(to_host(one.lse))), f"query {i}"


@pytest.mark.device
def test_length_shorter_than_t_q_is_flagged():
    dt = np.float32
    rng = np.random.default_rng(2)
    lens = np.array([8, 2], np.int32)  # sequence 1 cannot hold 4 new tokens
    k, v = _pooled(rng, lens, 8, 1, 16, dt)
    q = rng.standard_normal((2, 4, 2, 16)).astype(np.float32)
    with pytest.raises(checks.RangeError, match=r"seq_lens: sequence 1 has length 2, fewer "
                                                r"than the t_q=4"):
        run_multi(q, np.nan_to_num(k), np.nan_to_num(v), lens, dt)


def test_t_q_range_is_checked_when_the_plan_is_made():
    from attention.decode.plan import DecodePlan

    for bad in (0, 17):
        with pytest.raises(checks.RangeError, match="t_q"):
            DecodePlan(2, 4, 2, 32, 2, 64, t_q=bad)
    with pytest.raises(checks.RangeError, match="t_q"):
        DecodePlan(2, 4, 2, 32, 2, 3, t_q=4)  # more new tokens than the capacity


@pytest.mark.device
def test_causal_off_by_one_is_caught():
    """Positive control: query i seeing one position past its causal end
    fails the oracle check (the test above can fail)."""
    dt = np.float32
    rng = np.random.default_rng(4)
    t_q, h, n_kv, d, cap = 4, 2, 1, 16, 24
    lens = np.array([cap, 10], np.int32)
    k, v = _pooled(rng, lens, cap, n_kv, d, dt)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    q = rng.standard_normal((2, t_q, h, d)).astype(np.float32)
    out, lse, _ = run_multi(q, k, v, lens, dt, defect="causal_off_by_one")
    with pytest.raises(AssertionError):
        judge_multi(q, k, v, lens, out, lse, dt, "causal_off_by_one")
    assert np.array_equal(out[:, t_q - 1], run_multi(q, k, v, lens, dt)[0][:, t_q - 1])


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["f16", "f32"])
def test_multi_token_kernels_compile(kind):
    from numba import cuda, types

    from attention.decode import fast as F

    elem = {"f32": types.float32, "f16": types.float16}[kind]
    pl = F.plan(2, 32, 8, 128, 4096, kind, t_q=4)
    assert pl["kernel"].py_func.__name__.endswith("_t4") and pl["grid"][1] == 8 * 4
    cache = types.Array(elem, 4, "C")
    f32 = types.float32
    sig = (types.Array(f32, 3, "C"), cache, cache, types.int32[::1], types.int32[::1], f32,
           types.int32, types.Array(f32, 3, "C"), types.Array(f32, 2, "C"),
           types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.int32[::1])
    ptx, _ = cuda.compile_ptx(pl["kernel"].py_func, sig, cc=(9, 0), fastmath=True)
    assert "ld.local" not in ptx, "per-lane state spilled to local memory"
