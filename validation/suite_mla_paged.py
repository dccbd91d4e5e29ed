"""Falsification suite of the paged latent cache and the multi-token MLA decode
(``mla.paged``; ``mla.pipeline.mla_decode`` with ``page_table`` and ``s_q``).

Contract: ``validation/suite.py``. ``run_suite(None)`` returns only passing
checks; ``run_suite(d)`` returns at least one failing check for each planted
defect ``d`` in ``DEFECTS`` (compile-time switches of the kernels the paths
run, ``defect=``):

    page_off_by_one         the decode reads page ``table[b, j] + 1`` for
                            ``table[b, j]`` (``mla.paged.READ_DEFECTS``)
    append_page_off_by_one  ``paged_append_latent`` writes into page
                            ``table[b, j] + 1`` (``mla.paged.APPEND_DEFECTS``):
                            another sequence's page, or the shared prefix page
    mla_causal_off_by_one   query i of s_q sees one position past its causal
                            end (``mla.kernels.MULTI_DEFECTS``)
    mla_chunk_follows_batch a batch-invariant tensor-core plan takes the
                            chunk of the batch's default plan
                            (``mla.mma.PLAN_DEFECTS``)

Checks (named ``<check>[<case>]``):

* ``out[paged_P<P>_<method>]``: the decode over
  ``validation.fixtures.mla_paged_case`` (shuffled pages, checked not to be in
  order; every sequence that covers a whole page shares the longest one's first
  page; NaN in every unused row; ``MLA_HUGE_ENTRY`` in every unused table
  entry; lengths 0, 1, P, P + 1 and 2P), each sequence's output against the
  float64 oracles with the validation rule's max bound against the float32
  baseline in the path's order (``suite_mla.parity(method=...)``); pages of 3
  and 16; the empty sequence must give zeros.
* ``out[multi_s2_P3_<method>]``: the same fixture with 2 queries a sequence
  (lengths 0, 2, 3 and 13), each sequence's queries against the oracles, the
  later query seeing one more position.
* ``invariant chunk``: the batch-invariant tensor-core plans
  (``mla.mma.capacity_plan``, what ``mla_decode(batch_invariant=True)`` runs)
  of 1, 2, 17 and 64 sequences at DeepSeek's geometry (128 heads, r 512,
  d_rope 64, capacity 4096, paged and not) share one chunk and split count,
  where the default plans differ (checked too: otherwise the check could not
  fail). Plans only, no launch.
* ``append``: ``paged_append_latent`` of 1 to 3 rows a sequence into pages of
  3 (``fixtures.mla_append_case``: appends that start, fill and cross pages,
  two sequences sharing a full prefix page, a cache of random bytes): every
  byte of the cache against the expected one (the new rows bit for bit,
  everything else unchanged: the canary).

``small=True`` (the simulator) runs the flash path with attention tiles of 8
rows (so the pages of 3 split tiles and the pages of 16 hold two); ``small=False``
also runs the "gemm_fma" path at the same small dims (its attention GEMMs read
the pages through gathered rows) and the flash path with its default tiles.
"""

from __future__ import annotations

import numpy as np

from mla.dims import MlaDims
from validation import fixtures
from validation.suite import Check
from validation.suite_mla import parity

FAMILY = "mla_paged"
DEFECTS = ("page_off_by_one", "append_page_off_by_one", "mla_causal_off_by_one",
           "mla_chunk_follows_batch")
DIMS = MlaDims(n_head=2, d_nope=8, d_rope=4, d_v=8, kv_rank=12)  # rows of 16 words


def _paths(small):
    """(method, tile) pairs: the flash path (tiles of 8 on the simulator)."""
    if small:
        return (("flash", 8),)
    return (("flash", None), ("gemm_fma", None))


def _judge(out, c, method, multi):
    """(passed, detail) of each sequence's output against the oracles."""
    r = c["dims"].kv_rank
    worst = (0.0, "")
    for b, n in enumerate(c["lengths"]):
        n = int(n)
        if n == 0:
            if np.asarray(out[b]).any():
                return False, f"sequence {b} (empty): expected zeros"
            continue
        rows = c["cont"][b, :n].astype(np.float32)
        q = (c["q_nope"][b], c["q_pe"][b]) if multi else (c["q_nope"][b:b + 1],
                                                          c["q_pe"][b:b + 1])
        p = parity(out[b] if multi else out[b:b + 1],
                   q + (rows[:, :r], rows[:, r:], c["w_uk"], c["w_uv"]), method=method)
        ratio = p["err_naive"] / p["tol"] if p["tol"] else np.inf
        if not p["ok"]:
            return False, (f"sequence {b} (length {n}): err {p['err_naive']:.3e} > bound "
                           f"{p['tol']:.3e}")
        if ratio >= worst[0]:
            worst = (ratio, f"worst err/bound {ratio:.3f} (sequence {b})")
    return True, worst[1]


def _decode_check(page, method, tile, defect):
    from mla.pipeline import mla_decode

    name = f"out[paged_P{page}_{method}]"
    c = fixtures.mla_paged_case(page, np.float32, dims=DIMS, seed=40 + page)
    why = fixtures.mla_paged_hostile(c)
    if why is not None:
        return Check(name, False, f"fixture: {why}")
    out = mla_decode(c["q_nope"], c["q_pe"], c["pages"], c["lengths"], c["w_uk"], c["w_uv"],
                     page_table=c["table"], method=method, tile=tile,
                     defect=defect if defect == "page_off_by_one" else None)
    return Check(name, *_judge(out, c, method, False))


def _multi_check(method, tile, defect):
    """s_q 2 over pages of 3; the causal switch applies here, the page one too."""
    from mla.pipeline import mla_decode

    name = f"out[multi_s2_P3_{method}]"
    c = fixtures.mla_paged_case(3, np.float32, dims=DIMS, seed=49, s_q=2,
                                lengths=[0, 2, 3, 13])
    why = fixtures.mla_paged_hostile(c)
    if why is not None:
        return Check(name, False, f"fixture: {why}")
    kernel_defect = defect if defect in ("page_off_by_one", "mla_causal_off_by_one") else None
    out = mla_decode(c["q_nope"], c["q_pe"], c["pages"], c["lengths"], c["w_uk"], c["w_uv"],
                     page_table=c["table"], method=method, tile=tile, defect=kernel_defect)
    return Check(name, *_judge(out, c, method, True))


def _invariant_check(defect):
    """Batch-invariant tensor-core plans of 1..64 sequences share one chunk and
    split count (module docstring)."""
    from mla import mma as MM

    checks = []
    for paged in (False, True):
        seen, default = set(), set()
        for n_seq in (1, 2, 17, 64):
            pl = MM.capacity_plan(n_seq, 128, 512, 64, 4096, "f16", paged=paged,
                                  defect=defect if defect in MM.PLAN_DEFECTS else None)
            seen.add((pl["chunk"], pl["n_split"]))
            default.add(MM.plan(n_seq, 128, 512, 64, 4096, "f16", paged=paged)["n_split"])
        ok = len(seen) == 1 and len(default) > 1
        case = "paged" if paged else "contiguous"
        checks.append(Check(f"invariant chunk[mla_nh128_r512_L4096_{case}]", ok,
                            f"(chunk, n_split) over B 1/2/17/64: {sorted(seen)}; default "
                            f"split counts {sorted(default)}"))
    return checks


def _append_check(defect):
    from mla.paged import paged_append_latent

    cache, new_rows, table, lengths, n_new, want = fixtures.mla_append_case(np.float16, seed=11)
    if np.array_equal(cache.view(np.uint8), want.view(np.uint8)):
        return Check("append", False, "fixture: the append would change nothing")
    paged_append_latent(new_rows, cache, table, lengths, n_new=n_new,
                        defect=defect if defect == "append_page_off_by_one" else None)
    bad = cache.view(np.uint8).reshape(cache.shape[0], -1) != want.view(np.uint8).reshape(
        cache.shape[0], -1)
    if bad.any():
        pages = sorted(set(np.nonzero(bad)[0].tolist()))
        return Check("append", False, f"bytes differ from the expected cache in pages {pages}")
    return Check("append", True, f"{int(n_new.sum())} rows, every byte as expected")


def run_suite(defect=None, *, small=True):
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    out = []
    for method, tile in _paths(small):
        for page in (3, 16):
            out.append(_decode_check(page, method, tile, defect))
        out.append(_multi_check(method, tile, defect))
    out.append(_append_check(defect))
    out += _invariant_check(defect)
    return out
