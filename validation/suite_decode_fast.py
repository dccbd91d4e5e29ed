"""Falsification suite of the fast decode (``attention.decode.fast``): kernel and combine.

Contract: ``validation/suite.py``. ``run_suite(None)`` passes; ``run_suite(d)``
fails for every planted defect ``d`` in ``DEFECTS``
(``attention.decode.fast.GROSS_DEFECTS``), reached through the public
``batched_decode_attention_fast(..., defect=d)``. The precision mutants of
the module (``PRECISION_MUTANTS``) are for precision tests, not this suite.

Fixture: the hostile pooled cache of ``validation.suite_batched_decode``
(scores strictly increase with position, spanning more than 4 on the longest
sequence; q distinct per (sequence, head), K per (sequence, kv group);
lengths differ; KV_SLOTS > M with a shuffled slot table; NaN in unused slots
and past every length), checked as part of the assertion (``fixture`` check:
on the float32 values, and on the copy stored in the cache dtype, whose
scores must still never decrease and span more than 4). Each case runs with
one split (the main kernel writes the output) and with a forced split count
whose last split holds positions of the longest sequence (the combine merges;
also part of the ``fixture`` check), so every defect has a place to act:

* ``gqa_mod``: GQA 2 or 4 with H_kv 2: a block of the second kv group reads
  the first group's rows;
* ``slot_off_by_one``: slot + 1 is an unused slot (NaN) or another sequence's;
* ``one_short``: the last position, the largest score, is dropped;
* ``combine_drops_split``: the last split holds the longest sequence's last
  positions (its largest scores).

Checks (each named ``<check>[<case>]``): ``out`` and ``lse`` against the
float64 oracle ``attention.oracle.decode_attention_ref`` under
``validation.tolerance.budget`` (baseline: the same oracle in float32, on the
stored cache values: every cache dtype is upcast exactly, the kernel's
arithmetic is float32), with NaN / inf where the oracle has them.

Cases (``small``: simulator sizes, every CUDA thread a Python thread):
fp32 with scalar rows (D 40, GQA 2), fp16 with vector rows through the
pipelined reduce-scatter kernel and its cp.async ring (D 64, GQA 4); bf16 as
fp16 where not on the simulator (it has no bf16). Full size: D 128, GQA 4,
lengths up to 1500, the default split count, one split and 5, every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention.decode import fast as decode_fast
from attention.core.device import BFLOAT16, SIMULATOR, can_execute
from attention.oracle import decode_attention_ref, kv_head_of
from validation.suite import Check
from validation.suite_batched_decode import (
    MIN_SCORE_SPAN,
    build_caches,
    compare,
    fixture_problems,
    q_values,
    slot_table_for,
)

FAMILY = "decode_fast"
DEFECTS = decode_fast.GROSS_DEFECTS


@dataclass(frozen=True)
class Case:
    """One fixture geometry (the attributes ``suite_batched_decode``'s fixture
    reads) with a cache dtype and a forced split count. ``growth``: K grows by
    this factor per position (the scores' slope); ``n_split``: the forced
    count (its last split must hold positions; None: the plan's default)."""

    dtype: str
    head_dim: int
    n_heads: int
    n_kv: int
    max_seq: int
    seq_lens: tuple
    kv_slots: int
    growth: float
    n_split: int | None
    seed: int = 0

    @property
    def name(self):
        return (f"{self.dtype}_D{self.head_dim}_H{self.n_heads}_Hkv{self.n_kv}"
                f"_L{max(self.seq_lens)}_split{self.n_split or 'auto'}")

    def cache_dtype(self):
        return BFLOAT16 if self.dtype == "bfloat16" else np.dtype(self.dtype)


def _small_cases():
    """fp32: D 40 (scalar, predicated rows; 32 lanes a row, steps of 16
    positions), GQA 2; lengths 37 / 20 / 9, with 3 splits of 16 the last holds
    positions 32..36. fp16: D 64 (vector rows, 16 lanes a row), GQA 4 (one
    score a lane, rows by the cp.async ring), lengths 70 / 45 / 20, with 2
    splits of 64 the last holds 64..69. Growth makes the longest span > 4."""
    out = []
    for n_split in (1, 3):
        out.append(Case("float32", 40, 4, 2, 48, (37, 20, 9), 6, 0.5, n_split, seed=1))
    dtypes = ("float16",) if SIMULATOR else ("float16", "bfloat16")
    for dt in dtypes:
        for n_split in (1, 2):
            out.append(Case(dt, 64, 8, 2, 80, (70, 45, 20), 6, 0.25, n_split, seed=2))
    return tuple(out)


def _full_cases():
    """D 128, H 16, H_kv 4 (GQA 4), lengths 1500 / 777 / 95 in 2048, KV_SLOTS
    8: the plan's default split count, one split and 5 splits, every dtype."""
    dtypes = ("float32", "float16") + (("bfloat16",) if BFLOAT16 is not None else ())
    return tuple(Case(dt, 128, 16, 4, 2048, (1500, 777, 95), 8, 0.01, n_split, seed=3)
                 for dt in dtypes for n_split in (None, 1, 5))


def cases_for(small):
    return _small_cases() if small else _full_cases()


def stored_problems(case, q, k, slots, lengths):
    """Why the cache as stored (16-bit rounding can make neighbouring K rows
    equal: bf16 keeps 8 bits) would hide the longest sequence's last positions
    ([] when it does not): its scores must not decrease with position and must
    span more than ``MIN_SCORE_SPAN``."""
    problems = []
    scale = 1.0 / np.sqrt(case.head_dim)
    m = int(np.argmax(lengths))
    for h in range(case.n_heads):
        g = kv_head_of(h, case.n_heads, case.n_kv)
        keys = np.asarray(k[slots[m], g, :lengths[m]], np.float64)  # [L, D]
        s = (keys @ q[m, h].astype(np.float64)) * scale  # [L]
        if np.any(np.diff(s) < 0) or s[-1] - s[0] <= MIN_SCORE_SPAN:
            problems.append(f"stored scores of sequence {m} head {h} decrease or span "
                            f"{s[-1] - s[0]:.2f} <= {MIN_SCORE_SPAN}")
    return problems


def split_problems(case, pl):
    """Why the plan's split count would leave the combine's switches inert
    ([] when it is not): a forced count must be the plan's, and its last split
    must hold positions of the longest sequence."""
    if case.n_split is None or case.n_split == 1:
        return []
    longest = max(case.seq_lens)
    if pl["n_split"] != case.n_split:
        return [f"plan has {pl['n_split']} splits, the case asks for {case.n_split}"]
    if (pl["n_split"] - 1) * pl["chunk"] >= longest:
        return [f"the last of {pl['n_split']} splits of {pl['chunk']} positions is empty "
                f"(longest length {longest})"]
    return []


def check_case(case, defect=None):
    """Attention over the hostile fixture in the case's dtype, vs the oracle."""
    tag = f"[{case.name}]"
    lengths = np.array(case.seq_lens, np.int32)
    slots = slot_table_for(case)
    k32, v32 = build_caches(case, lengths, slots)
    k, v = k32.astype(case.cache_dtype()), v32.astype(case.cache_dtype())
    q = q_values(case)  # [M, H, D] float32
    # the design on the float32 values, then what the stored copy keeps of it
    problems = fixture_problems(case, q, k32, slots, lengths)
    problems += stored_problems(case, q, k, slots, lengths)
    kind = decode_fast.dtype_kind(k.dtype)
    pl = decode_fast.plan(len(lengths), case.n_heads, case.n_kv, case.head_dim,
                          int(lengths.max()), kind, n_split=case.n_split)
    problems += split_problems(case, pl)
    checks = [Check("fixture" + tag, not problems, "; ".join(problems) or
                    "scores strictly increase (span > 4 on the longest; stored: never "
                    "decrease), q/K distinct, lengths differ; the last split holds positions")]
    out, lse = decode_fast.batched_decode_attention_fast(
        q, k, v, lengths, slots, return_lse=True, n_split=case.n_split, defect=defect)
    ref, ref_lse = decode_attention_ref(q, k, v, lengths, slots)
    base, base_lse = decode_attention_ref(q, k, v, lengths, slots, dtype=np.float32)
    checks.append(compare("out" + tag, out, ref, base))
    checks.append(compare("lse" + tag, lse, ref_lse, base_lse))
    return checks


def run_suite(defect=None, *, small=True):
    """Every case's checks (``cases_for(small)``)."""
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("decode_fast suite: no GPU and the CUDA simulator is not enabled")
    results = []
    for case in cases_for(small):
        results += check_case(case, defect)
    return results
