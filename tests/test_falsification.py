"""The online-softmax falsification suite of batched decode (validation/suite_batched_decode.py).

1. numerics at the production shape (D 128, H 12, H_kv 2, max_seq 2048, M 3,
   seq_lens 17/11/5) on both paths, after asserting the fixture is not inert;
2. the decode-step wiring (KV_SLOTS 8 > M 3, one step, then one with a
   finished sequence);
3. every planted defect makes the suite fail, on both paths, and the correct
   kernels pass;
4. the PTX property (tests/test_ptx_check.py; here through run_suite in the
   plain process).

Simulator: (1) at the full production shape (about 10 s per path), (2)-(3) at
the reduced shape of ``REDUCED`` (same properties). GPU: everything at full shape.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.reference.warp_decode import KERNEL_DEFECTS
from attention.reference.split_decode import decode
from tests.conftest import MODE, small
from validation import suite_batched_decode as suite
from validation.suite import caught
from validation.tolerance import assert_matches

METHODS = suite.METHODS
PTX_METHODS = ("warp", "split")  # the kernels that carry the online-softmax defect switch
# The fast path is another kernel source without defect switches: it is held to every
# clean check and to the scatter/state defects, not to the kernel defects.
DEFECT_CASES = [(d, m) for m in METHODS for d in suite.DEFECTS
                if not (m == "fast" and d in KERNEL_DEFECTS)]


def test_suite_contract():
    assert suite.FAMILY == "batched_decode"
    assert set(suite.DEFECTS) == {
        "stuck_rescale", "gqa_mod", "slot_off_by_one", "batch_max_len",
        "scatter_pos_plus_one", "length_not_advanced", "done_slot_read"}
    with pytest.raises(ValueError, match="defect"):
        suite.run_suite("no_such_defect")


@pytest.mark.parametrize("shape", [suite.PRODUCTION, suite.REDUCED], ids=["production", "reduced"])
def test_fixture_is_not_inert(shape):
    lengths = np.array(shape.seq_lens)
    slots = suite.slot_table_for(shape)
    k, _ = suite.build_caches(shape, lengths, slots)
    q = suite.q_values(shape)
    assert suite.fixture_problems(shape, q, k, slots, lengths) == []
    # the slot table is hostile: shuffled, every sequence away from its index
    assert not np.any(slots == np.arange(len(slots))) and len(set(slots)) == len(slots)


def test_inert_fixture_is_reported():
    """Positive control of the fixture check: flat scores must be flagged."""
    flat = suite.Shape(**{**suite.REDUCED.__dict__, "growth": 0.0})
    lengths = np.array(flat.seq_lens)
    slots = suite.slot_table_for(flat)
    k, _ = suite.build_caches(flat, lengths, slots)
    problems = suite.fixture_problems(flat, suite.q_values(flat), k, slots, lengths)
    assert any("strictly increase" in p for p in problems)
    assert any("span" in p for p in problems)


@pytest.mark.device
@pytest.mark.parametrize("method", METHODS)
def test_production_shape_numerics(method):
    """Check 1 at the full production shape, every (sequence, head, dim) vs the oracle."""
    shape = suite.PRODUCTION
    lengths = np.array(shape.seq_lens, np.int32)
    slots = suite.slot_table_for(shape)
    k, v = suite.build_caches(shape, lengths, slots)  # NaN outside the live positions
    q = suite.q_values(shape)
    assert suite.fixture_problems(shape, q, k, slots, lengths) == [], "fixture is inert"
    out, lse = decode(q, k, v, lengths, slots, method=method, return_lse=True,
                      **({"chunk": shape.chunk} if method == "split" else {}))
    (ref, ref_lse), (base, base_lse) = suite.oracle_pair(q, k, v, lengths, slots)
    assert_matches(out, ref, base, what=f"out [{method}]")
    assert_matches(lse, ref_lse, base_lse, what=f"lse [{method}]")


@pytest.mark.device
@pytest.mark.parametrize("method", METHODS)
def test_suite_passes_on_correct_kernels(method):
    results = suite.run_suite(None, small=small(), method=method)
    failed = [f"{c.name}: {c.detail}" for c in results if not c.passed]
    assert not failed, failed
    names = {c.name.split("[")[0] for c in results}
    assert {"fixture", "numerics", "wiring_out", "wiring_cache", "wiring_lengths",
            "done_out", "done_cache"} <= names


@pytest.mark.device
@pytest.mark.parametrize("defect,method", DEFECT_CASES)
def test_suite_catches_planted_defect(defect, method):
    results = suite.run_suite(defect, small=small(), method=method)
    assert caught(results), (
        f"planted defect {defect!r} on the {method} path passed every check: "
        + "; ".join(c.name for c in results))


@pytest.mark.compile
@pytest.mark.parametrize("method", PTX_METHODS)
def test_suite_ptx_check_in_plain_process(method):
    """Without a GPU or the simulator, run_suite still asserts the PTX property."""
    good = suite.run_suite(None, method=method)
    assert [c.name for c in good if c.name.startswith("ptx")] == [f"ptx_rescale[{method}]"]
    assert all(c.passed for c in good if c.name.startswith("ptx"))
    bad = suite.run_suite("stuck_rescale", method=method)
    assert not next(c for c in bad if c.name.startswith("ptx")).passed


@pytest.mark.gpu
@pytest.mark.parametrize("defect,method", [(None, m) for m in METHODS] + DEFECT_CASES)
def test_suite_at_production_shape_on_gpu(defect, method):
    results = suite.run_suite(defect, small=False, method=method)
    if defect is None:
        assert not [c for c in results if not c.passed], [c for c in results if not c.passed]
    else:
        assert caught(results)
    assert MODE == "gpu"
