"""Falsification suite of the paged decode: the paged fast kernel, the paged
append and the batch-invariant plan.

Contract: ``validation/suite.py``. ``run_suite(None)`` passes; ``run_suite(d)``
fails for every planted defect ``d`` in ``DEFECTS``:

* the paged kernel's switches (``attention.decode.fast.PAGED_DEFECTS``,
  through ``DecodePlan(page_size=..., defect=d)``): "page_off_by_one" (another
  page's rows), "page_offset_stride" (a row addressed with the other layout's
  strides);
* the multi-token kernel's (``attention.decode.fast.MULTI_DEFECTS``):
  "causal_off_by_one" (query i of T sees one position past its causal end);
* the append's (``attention.cache.paged.APPEND_DEFECTS``): "append_page_off_by_one",
  "append_offset_stride", "append_behind" (a token written one position early,
  into the page of the last cached row: a page shared with another sequence);
* the plan's ``PLAN_DEFECTS``: "chunk_follows_batch" (a batch-invariant plan
  whose split length follows the batch).

Checks (each named ``<check>[<case>]``):

* ``out`` / ``lse``: the hostile fixture of ``validation.suite_decode_fast``
  (scores strictly increasing with position, NaN past every length, q and K
  distinct per head and group) laid out in pages (``fixtures.paged_from_pooled``:
  shuffled pages, NaN tails and spare pages, huge unused table entries), HND
  pages of 4 and NHD pages of 3, one split and a forced split count, against
  the float64 oracle under the derived budget (``suite_batched_decode.compare``);
* ``out`` / ``lse`` ``[<case>_t4_HND4]``: the same case as a 4-query decode
  (``fixtures.multi_token_case``: each sequence judged at one query whose
  causal end is the case's length, the query index varying over the batch),
  HND pages of 4, against the same oracle;
* ``append``: two new tokens a sequence appended through ``paged_append`` into
  HND pages of 4 where two sequences share a full prefix page: every element
  of the pages compared bit for bit with the expected pages (the written rows,
  and everything else unchanged: a canary), then the decode over the appended
  pages against the oracle;
* ``invariant chunk``: batch-invariant plans for 1, 2, 17 and 64 sequences at
  the production geometry (B 32 / H 32 / H_kv 8 / D 128 / L 4096, fp16) share
  one split length and split count, where the default plans differ (checked
  too: otherwise the check could not fail), for the fast kernel at T 1 and the
  tensor-core kernel at T 4. Plans only, no launch.
"""

from __future__ import annotations

import numpy as np

from attention.cache import paged as paged_cache
from attention.core.device import SIMULATOR, can_execute, to_device, to_host
from attention.decode import fast as decode_fast
from attention.decode.plan import PLAN_DEFECTS, DecodePlan
from attention.oracle import decode_attention_paged_ref, decode_attention_ref
from validation import fixtures
from validation.suite import Check
from validation.suite_batched_decode import build_caches, compare, q_values, slot_table_for
from validation.suite_decode_fast import cases_for

FAMILY = "decode_paged"
DEFECTS = (decode_fast.PAGED_DEFECTS + decode_fast.MULTI_DEFECTS + paged_cache.APPEND_DEFECTS
           + PLAN_DEFECTS)
T_Q = 4  # queries a sequence of the multi-token check
LAYOUTS = (("HND", 4), ("NHD", 3))  # (layout, page size): H_kv 2 and P > 1 expose the strides


def _kernel_defect(defect):
    return defect if defect in decode_fast.PAGED_DEFECTS + decode_fast.MULTI_DEFECTS else None


def _run(q, k_pages, v_pages, lens, table, page, layout, max_seq, defect=None, n_split=None):
    m, h, d = q.shape[0], q.shape[-2], q.shape[-1]
    t_q = q.shape[1] if q.ndim == 4 else 1
    n_kv = k_pages.shape[1] if layout == "HND" else k_pages.shape[2]
    pl = DecodePlan(m, h, n_kv, d, k_pages.shape[0], max_seq, cache_dtype=k_pages.dtype,
                    q_dtype=np.float32, page_size=page, layout=layout, n_split=n_split,
                    defect=defect, t_q=t_q)
    out = pl.run(to_device(q), to_device(k_pages), to_device(v_pages),
                 to_device(np.asarray(lens, np.int32)), page_table=to_device(table), sync=True)
    return np.asarray(to_host(out)), np.asarray(to_host(pl.lse))


def check_layout(case, layout, page, defect=None):
    """The fast suite's case in pages of ``page`` (``layout``), vs the oracle."""
    tag = f"[{case.name}_{layout}{page}]"
    lengths = np.array(case.seq_lens, np.int32)
    slots = slot_table_for(case)
    k32, v32 = build_caches(case, lengths, slots)
    k, v = k32.astype(case.cache_dtype()), v32.astype(case.cache_dtype())
    q = q_values(case)
    rng = np.random.default_rng(case.seed + page)
    kp, vp, table = fixtures.paged_from_pooled(k, v, lengths, slots, page, layout, rng)
    out, lse = _run(q, kp, vp, lengths, table, page, layout, case.max_seq,
                    _kernel_defect(defect), case.n_split)
    ref, ref_lse = decode_attention_ref(q, k, v, lengths, slots)
    base, base_lse = decode_attention_ref(q, k, v, lengths, slots, dtype=np.float32)
    return [compare("out" + tag, out, ref, base), compare("lse" + tag, lse, ref_lse, base_lse)]


def check_multi(case, defect=None):
    """The fast suite's case as a 4-query decode in HND pages of 4
    (``fixtures.multi_token_case``: each sequence judged at one query, whose
    causal end is the case's length, the index varying over the batch), vs
    the oracle. A query that sees a position past its causal end reads the
    case's NaN rows."""
    tag = f"[{case.name}_t{T_Q}_HND4]"
    lengths = np.array(case.seq_lens, np.int32)
    slots = slot_table_for(case)
    k32, v32 = build_caches(case, lengths, slots)
    k, v = k32.astype(case.cache_dtype()), v32.astype(case.cache_dtype())
    q = q_values(case)
    q_multi, lens, pick = fixtures.multi_token_case(q, lengths, case.max_seq, T_Q)
    rng = np.random.default_rng(case.seed + T_Q)
    kp, vp, table = fixtures.paged_from_pooled(k, v, lens, slots, 4, "HND", rng)
    out, lse = _run(q_multi, kp, vp, lens, table, 4, "HND", case.max_seq,
                    _kernel_defect(defect), case.n_split)
    rows = np.arange(len(lengths))
    ref, ref_lse = decode_attention_ref(q, k, v, lengths, slots)
    base, base_lse = decode_attention_ref(q, k, v, lengths, slots, dtype=np.float32)
    return [compare("out" + tag, out[rows, pick], ref, base),
            compare("lse" + tag, lse[rows, pick], ref_lse, base_lse)]


def check_append(defect=None, small=True):
    """Two tokens a sequence appended into shared-prefix pages, then attended."""
    rng = np.random.default_rng(23)
    page, n_kv, h, d, t_new = 4, 2, 4, 16 if small else 128, 2
    lens = np.array([9, 4, 6], np.int32)  # sequence 1's only page is sequence 0's first
    max_seq = 16
    width = max_seq // page
    table = np.full((3, width), fixtures.HUGE_PAGE, np.int32)
    table[0, :3] = [5, 2, 7]
    table[1, :2] = [5, 0]  # the shared prefix page 5, then its own page for the append
    table[2, :2] = [3, 6]
    shape = (9, n_kv, page, d)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    for m, n in enumerate(lens):
        for p in range(n):
            pg, off = table[m, p // page], p % page
            if m == 1:  # the shared page holds sequence 0's rows
                continue
            k_pages[pg, :, off] = rng.standard_normal((n_kv, d))
            v_pages[pg, :, off] = rng.standard_normal((n_kv, d))
    k_new = rng.standard_normal((3, t_new, n_kv, d)).astype(np.float32)
    v_new = rng.standard_normal((3, t_new, n_kv, d)).astype(np.float32)
    want_k, want_v = k_pages.copy(), v_pages.copy()
    for m, n in enumerate(lens):
        for i in range(t_new):
            p = n + i
            pg, off = table[m, p // page], p % page
            want_k[pg, :, off], want_v[pg, :, off] = k_new[m, i], v_new[m, i]
    d_k, d_v = to_device(k_pages), to_device(v_pages)
    append_defect = defect if defect in paged_cache.APPEND_DEFECTS else None
    paged_cache.paged_append(k_new, v_new, d_k, d_v, table, lens, defect=append_defect)
    got_k, got_v = np.asarray(to_host(d_k)), np.asarray(to_host(d_v))
    same = (np.array_equal(got_k.view(np.uint32), want_k.view(np.uint32))
            and np.array_equal(got_v.view(np.uint32), want_v.view(np.uint32)))
    changed = int(np.sum(got_k.view(np.uint32) != want_k.view(np.uint32))
                  + np.sum(got_v.view(np.uint32) != want_v.view(np.uint32)))
    checks = [Check("append[HND4_shared_prefix]", same,
                    "every element as expected (written rows, the rest untouched)" if same
                    else f"{changed} elements differ from the expected pages")]
    new_lens = lens + t_new
    q = rng.standard_normal((3, h, d)).astype(np.float32)
    out, lse = _run(q, got_k, got_v, new_lens, table, page, "HND", max_seq,
                    _kernel_defect(defect))
    ref, ref_lse = decode_attention_paged_ref(q, want_k, want_v, table, new_lens, "HND")
    base, base_lse = decode_attention_paged_ref(q, want_k, want_v, table, new_lens, "HND",
                                                dtype=np.float32)
    checks.append(compare("out[after append]", out, ref, base))
    checks.append(compare("lse[after append]", lse, ref_lse, base_lse))
    return checks


def check_invariant_chunk(defect=None):
    """Batch-invariant plans of 1..64 sequences share one chunk and split count:
    the fast kernel's (T 1) and the tensor-core kernel's (T 4, ``method="mma"``)."""
    from attention.decode import mma as decode_mma

    geometry = (32, 8, 128, 4096)  # H, H_kv, D, capacity: fp16, the production shape
    plan_defect = defect if defect in PLAN_DEFECTS else None
    checks = []
    for t_q, method in ((1, "fast"), (4, "mma")):
        seen, default = set(), set()
        for m in (1, 2, 17, 64):
            pl = DecodePlan(m, *geometry[:3], m, geometry[3], cache_dtype=np.float16,
                            q_dtype=np.float16, t_q=t_q, batch_invariant=True,
                            defect=plan_defect, method=method)
            seen.add((pl.method, pl.kernel_plan["chunk"], pl.n_split))
            default.add(decode_fast.plan(m, *geometry, "f16")["n_split"] if method == "fast"
                        else decode_mma.plan(m, *geometry, "f16", t_q=t_q)["n_split"])
        ok = len(seen) == 1 and next(iter(seen))[0] == method and len(default) > 1
        checks.append(Check(f"invariant chunk[H32_Hkv8_D128_L4096_fp16_T{t_q}]", ok,
                            f"(kernel, chunk, n_split) over M 1/2/17/64: {sorted(seen)}; "
                            f"default split counts {sorted(default)}"))
    return checks


def run_suite(defect=None, *, small=True):
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("decode_paged suite: no GPU and the CUDA simulator is not enabled")
    results = []
    cases = cases_for(small)
    if small and SIMULATOR:  # one fp32 and one fp16 case, each with its forced splits
        cases = [c for c in cases if c.n_split not in (None, 1)]
    for case in cases:
        for layout, page in LAYOUTS:
            results += check_layout(case, layout, page, defect)
        results += check_multi(case, defect)
    results += check_append(defect, small)
    results += check_invariant_chunk(defect)
    return results
