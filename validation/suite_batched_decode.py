"""Falsification suite of batched decode: the warp kernel and its split-KV sibling.

Contract: ``validation/suite.py``. ``run_suite(None)`` passes; ``run_suite(d)``
fails for every planted defect ``d`` in ``DEFECTS``, on either attention path
(``method="warp"`` or ``"split"``; default: both).

Checks (each named ``<check>[<method>]``):

1. ``fixture`` / ``numerics``: attention at the production shape that exposed
   the stuck-rescale defect (D 128, H 12, H_kv 2, max_seq 2048, M 3,
   seq_lens 17/11/5; ``small`` keeps every property at a simulator size). The
   fixture is part of the assertion: scores strictly increase with position
   (a stuck rescale is visible), Q differs per (sequence, head) and K/V per
   (sequence, kv group) (head-map and slot-stride errors are visible), lengths
   differ (a single batch length is visible). Caches are hostile: KV_SLOTS > M
   with a shuffled slot table, NaN in unused slots and past every length.
   Every (sequence, head, dim) is compared with the float64 oracle under the
   derived budget of ``validation.tolerance``.
2. ``wiring``: a ``DecodeState`` (``attention.decode.step``, on the path's
   kernel, in its default mode: a replayed graph on a GPU, eager launches on
   the simulator) with KV_SLOTS 8 > M 3 and 17/11/5 positions cached takes one
   step: the new rows land at 17/11/5 (and nowhere else:
   the whole cache is compared bit for bit, NaN included), attention covers
   18/12/6 positions, lengths advance to 18/12/6, no NaN leaks.
3. ``done``: a second step after ``finish(1)``: sequence 1 gives zeros and
   LSE -inf, its slot is untouched, the others advance and match the oracle.
4. ``ptx_rescale``: the PTX property of ``validation.ptx_check`` on the
   path's online-softmax kernel (only where ``compile_ptx`` exists, i.e. not
   under the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention.cache.scatter import SCATTER_DEFECTS
from attention.core.device import SIMULATOR, can_execute
import attention.reference.decode_step  # noqa: F401, E402  (registers "warp" / "split")
from attention.decode.step import STATE_DEFECTS, DecodeState
from attention.reference.warp_decode import KERNEL_DEFECTS
from attention.reference.split_decode import decode
from attention.oracle import decode_attention_ref, kv_head_of
from validation import tolerance
from validation.suite import Check

FAMILY = "batched_decode"
# the reference kernels' switches, the scatter's and the decode state's own
DEFECTS = KERNEL_DEFECTS + SCATTER_DEFECTS + STATE_DEFECTS
METHODS = ("warp", "split", "fast")  # fast: the reference kernels' switches are not planted in it


@dataclass(frozen=True)
class Shape:
    """One fixture geometry. ``growth``: K grows by this factor per position
    (the scores' slope); ``chunk``: split-KV chunk, small enough that every
    sequence spans several chunks and some chunks are empty."""

    head_dim: int
    n_heads: int
    n_kv: int
    max_seq: int
    seq_lens: tuple
    kv_slots: int
    growth: float
    chunk: int
    seed: int = 0


PRODUCTION = Shape(head_dim=128, n_heads=12, n_kv=2, max_seq=2048, seq_lens=(17, 11, 5),
                   kv_slots=8, growth=0.6, chunk=8)
# Simulator size, the same properties: GQA 2:1 (H_kv divides H, a head-map
# error reads the other group), M 3 (odd, != H_kv), lengths differ, D 40 (not
# a multiple of 32: tail lanes), a steeper growth so the longest sequence's
# scores still span more than 4, KV_SLOTS 8 > M, chunks of 3 (empty chunks).
REDUCED = Shape(head_dim=40, n_heads=4, n_kv=2, max_seq=12, seq_lens=(6, 4, 3),
                kv_slots=8, growth=3.0, chunk=3)

MIN_SCORE_SPAN = 4.0  # last - first score of the longest sequence, in nats


def shape_for(small):
    return REDUCED if small else PRODUCTION


# -- the fixture ---------------------------------------------------------------

def q_values(shape):
    """q [M, H, D]: positive, distinct for every (sequence, head)."""
    m_count, h, d = len(shape.seq_lens), shape.n_heads, shape.head_dim
    mi, hi, di = np.meshgrid(np.arange(m_count), np.arange(h), np.arange(d), indexing="ij")
    return (0.5 + 0.01 * ((mi * 5 + hi * 3 + di) % 7) + 0.002 * (mi * h + hi)).astype(np.float32)


def k_values(shape, m, positions):
    """K rows [H_kv, len(positions), D] of sequence m: a positive base per
    (sequence, kv group, dim) times ``1 + growth * pos``, so every score
    q . k grows strictly with position."""
    g, d = np.meshgrid(np.arange(shape.n_kv), np.arange(shape.head_dim), indexing="ij")
    base = 0.02 * (1 + (m * 3 + g * 5 + d) % 11) + 0.001 * (m * shape.n_kv + g)  # [H_kv, D]
    pos = np.asarray(positions, np.float64)
    return (base[:, None, :] * (1.0 + shape.growth * pos)[None, :, None]).astype(np.float32)


def v_values(shape, m, positions):
    """V rows [H_kv, len(positions), D]: distinct per position, dim, sequence, group."""
    g, d = np.meshgrid(np.arange(shape.n_kv), np.arange(shape.head_dim), indexing="ij")
    pos = np.asarray(positions, np.float64)
    v = (pos[None, :, None] + 1.0) + 0.01 * d[:, None, :] + 0.5 * m + 0.25 * g[:, None, :]
    return v.astype(np.float32)


def slot_table_for(shape):
    """A shuffled table: sequence m lives in a slot that is not m, the rest unused."""
    rng = np.random.default_rng(shape.seed + 17)
    slots = rng.permutation(shape.kv_slots)[:len(shape.seq_lens)]
    if np.any(slots == np.arange(len(slots))):
        slots = (slots + 1) % shape.kv_slots
    return slots.astype(np.int32)


def build_caches(shape, lengths, slots):
    """NaN-filled pooled caches with positions 0..lengths[m]-1 of slot slots[m] set."""
    cache_shape = (shape.kv_slots, shape.n_kv, shape.max_seq, shape.head_dim)
    k = np.full(cache_shape, np.nan, np.float32)
    v = np.full(cache_shape, np.nan, np.float32)
    for m, (slot, length) in enumerate(zip(slots, lengths)):
        k[slot, :, :length] = k_values(shape, m, np.arange(length))
        v[slot, :, :length] = v_values(shape, m, np.arange(length))
    return k, v


def fixture_problems(shape, q, k, slots, lengths):
    """Why the fixture would be inert ([] when it is not)."""
    problems = []
    scale = 1.0 / np.sqrt(shape.head_dim)
    lengths = list(lengths)
    for m, (slot, length) in enumerate(zip(slots, lengths)):
        for h in range(shape.n_heads):
            g = kv_head_of(h, shape.n_heads, shape.n_kv)
            s = (k[slot, g, :length].astype(np.float64) @ q[m, h].astype(np.float64)) * scale
            if length > 1 and not np.all(np.diff(s) > 0):
                problems.append(f"scores of sequence {m} head {h} do not strictly increase")
            if length == max(lengths) and s[-1] - s[0] <= MIN_SCORE_SPAN:
                problems.append(f"scores of sequence {m} head {h} span {s[-1] - s[0]:.2f} "
                                f"<= {MIN_SCORE_SPAN}: a stuck rescale would be invisible")
    q_rows = q.reshape(-1, shape.head_dim)
    if len(np.unique(q_rows, axis=0)) != q_rows.shape[0]:
        problems.append("q is not distinct per (sequence, head)")
    k_rows = np.stack([k[slot, g, 0] for slot in slots for g in range(shape.n_kv)])
    if len(np.unique(k_rows, axis=0)) != k_rows.shape[0]:
        problems.append("K is not distinct per (sequence, kv group)")
    if len(set(lengths)) != len(lengths):
        problems.append("lengths do not differ per sequence")
    return problems


def compare(name, got, ref, base, extra=""):
    """A Check: ``got`` within the derived budget of the oracle, same non-finite placement."""
    got = np.asarray(got)
    if got.shape != ref.shape:
        return Check(name, False, f"shape {got.shape} != oracle {ref.shape}")
    if not tolerance.same_nonfinite(got, ref):
        return Check(name, False, f"NaN/inf placement differs from the oracle "
                                  f"({int(np.isnan(got).sum())} NaN in the output){extra}")
    err, allowed = tolerance.max_abs_error(got, ref), tolerance.budget(ref, base)
    if err > allowed:
        both = np.isfinite(ref) & np.isfinite(got)
        diff = np.where(both, np.abs(got.astype(np.float64) - ref), 0.0)
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        return Check(name, False, f"max abs error {err:.3e} > budget {allowed:.3e} at "
                                  f"{tuple(int(i) for i in worst)}: kernel {got[worst]!r}, "
                                  f"oracle {ref[worst]!r}{extra}")
    return Check(name, True, f"max abs error {err:.3e} <= budget {allowed:.3e}{extra}")


def oracle_pair(q, k, v, lengths, slots):
    ref = decode_attention_ref(q, k, v, lengths, slots)
    base = decode_attention_ref(q, k, v, lengths, slots, dtype=np.float32)
    return ref, base


# -- the checks ----------------------------------------------------------------

def _kernel_defect(defect):
    return defect if defect in KERNEL_DEFECTS else None


def _split_kwargs(method, shape):
    return {"chunk": shape.chunk} if method == "split" else {}


def check_numerics(shape, method, defect=None):
    """Check 1: attention over the hostile pooled fixture vs the oracle."""
    tag = f"[{method}]"
    lengths = np.array(shape.seq_lens, np.int32)
    slots = slot_table_for(shape)
    k, v = build_caches(shape, lengths, slots)
    q = q_values(shape)
    problems = fixture_problems(shape, q, k, slots, lengths)
    checks = [Check("fixture" + tag, not problems, "; ".join(problems) or
                    "scores strictly increase (span > 4 on the longest), q/K distinct, "
                    "lengths differ")]
    out, lse = decode(q, k, v, lengths, slots, method=method, return_lse=True,
                      defect=_kernel_defect(defect), **_split_kwargs(method, shape))
    (ref, ref_lse), (base, base_lse) = oracle_pair(q, k, v, lengths, slots)
    checks.append(compare("numerics" + tag, out, ref, base))
    checks.append(compare("numerics_lse" + tag, lse, ref_lse, base_lse))
    return checks


def check_decode_steps(shape, method, defect=None):
    """Checks 2 and 3: one step of a DecodeState, then one with a finished sequence."""
    tag = f"[{method}]"
    prior = np.array(shape.seq_lens, np.int32)
    m_count = len(prior)
    slots = slot_table_for(shape)
    k0, v0 = build_caches(shape, prior, slots)
    batch = DecodeState(m_count, shape.n_heads, shape.n_kv, shape.head_dim, shape.max_seq,
                        kv_slots=shape.kv_slots, slot_table=slots, kernel=method,
                        fill=np.nan, defect=defect,
                        split_chunk=shape.chunk if method == "split" else None)
    batch.load(k0, v0, prior)
    q = q_values(shape)
    checks = []

    # -- step 1: every sequence live --
    k_new = np.stack([k_values(shape, m, [prior[m]])[:, 0] for m in range(m_count)])
    v_new = np.stack([v_values(shape, m, [prior[m]])[:, 0] for m in range(m_count)])
    out, lse = batch.step(q, k_new, v_new, return_lse=True)
    k1, v1 = k0.copy(), v0.copy()  # what the cache must hold now
    for m in range(m_count):
        k1[slots[m], :, prior[m]] = k_new[m]
        v1[slots[m], :, prior[m]] = v_new[m]
    (ref, ref_lse), (base, _) = oracle_pair(q, k1, v1, prior + 1, slots)
    checks.append(compare("wiring_out" + tag, out, ref, base,
                          f" (attending {list(prior + 1)} positions)"))
    checks.append(Check("wiring_lse" + tag, tolerance.same_nonfinite(lse, ref_lse)
                        and np.all(np.isfinite(lse)), "lse finite where the oracle's is"))
    lengths = batch.lengths
    checks.append(Check("wiring_lengths" + tag, np.array_equal(lengths, prior + 1),
                        f"lengths {list(lengths)}, expected {list(prior + 1)}"))
    got_k, got_v = batch.k_cache.copy_to_host(), batch.v_cache.copy_to_host()
    same = _bit_equal(got_k, k1) and _bit_equal(got_v, v1)
    checks.append(Check("wiring_cache" + tag, same,
                        "cache holds the new rows at 17/11/5-style positions and nothing "
                        "else changed (NaN padding intact)" if same else
                        f"cache differs from the expected scatter at "
                        f"{_first_difference(got_k, k1) or _first_difference(got_v, v1)}"))

    # -- step 2: sequence 1 finished: neither read nor written, zeros / -inf --
    batch.finish(1)
    lengths1 = np.array(batch.lengths)
    k_new2 = np.stack([k_values(shape, m, [prior[m] + 1])[:, 0] for m in range(m_count)])
    v_new2 = np.stack([v_values(shape, m, [prior[m] + 1])[:, 0] for m in range(m_count)])
    out2, lse2 = batch.step(q, k_new2, v_new2, return_lse=True)
    k2, v2 = k1.copy(), v1.copy()
    expect_lens = prior + 1
    for m in (0, 2):
        k2[slots[m], :, prior[m] + 1] = k_new2[m]
        v2[slots[m], :, prior[m] + 1] = v_new2[m]
        expect_lens[m] += 1
    kernel_lens = expect_lens.copy()
    kernel_lens[1] = 0
    (ref2, ref_lse2), (base2, _) = oracle_pair(q, k2, v2, kernel_lens, slots)
    checks.append(compare("done_out" + tag, out2, ref2, base2, " (sequence 1 finished)"))
    checks.append(Check("done_lse" + tag, bool(np.all(np.isneginf(lse2[1])))
                        and bool(np.all(np.isfinite(lse2[[0, 2]]))),
                        f"finished sequence's LSE {lse2[1][:3]}..., expected -inf"))
    got_k2, got_v2 = batch.k_cache.copy_to_host(), batch.v_cache.copy_to_host()
    same2 = _bit_equal(got_k2, k2) and _bit_equal(got_v2, v2)
    checks.append(Check("done_cache" + tag, same2,
                        "finished slot untouched, live slots got their rows" if same2 else
                        f"cache differs at {_first_difference(got_k2, k2)}"))
    want_lens = np.array([expect_lens[0], lengths1[1], expect_lens[2]])
    lengths2 = batch.lengths
    checks.append(Check("done_lengths" + tag, np.array_equal(lengths2, want_lens),
                        f"lengths {list(lengths2)}, expected {list(want_lens)}"))
    return checks


def check_ptx(method, defect=None):
    """Check 4: the online-softmax PTX property of the path's kernel."""
    from validation.ptx_check import check_rescale, kernel_ptx

    kind = "batched_decode" if method == "warp" else "flash_decode_chunk"
    result = check_rescale(kernel_ptx(kind, _kernel_defect(defect)))
    return [Check(f"ptx_rescale[{method}]", result.passed, result.detail)]


def _bit_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _first_difference(a, b):
    diff = a.view(np.uint32) != b.view(np.uint32)
    if not diff.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(diff)[0])
    return f"[slot, kv head, pos, d] = {idx}: got {a[idx]!r}, expected {b[idx]!r}"


def run_suite(defect=None, *, small=True, method=None):
    """All checks on the given path(s) ("warp", "split"; None: both)."""
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    methods = METHODS if method is None else (method,)
    shape = shape_for(small)
    results = []
    for meth in methods:
        if meth == "fast" and defect in KERNEL_DEFECTS:
            continue  # another kernel source: its own switches are suite_decode_fast's
        if not SIMULATOR and meth != "fast":
            results += check_ptx(meth, defect)
        if can_execute():
            results += check_numerics(shape, meth, defect)
            results += check_decode_steps(shape, meth, defect)
    return results
