"""DecodeBatch: pooled caches, per-sequence lengths, a done mask, one step at a time."""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.decode.state import DecodeBatch
from attention.oracle import decode_attention_ref
from validation.tolerance import assert_matches


def _rows(rng, m, n_kv, d):
    return (rng.standard_normal((m, n_kv, d)).astype(np.float32),
            rng.standard_normal((m, n_kv, d)).astype(np.float32))


@pytest.mark.device
@pytest.mark.parametrize("method", ["warp", "split"])
def test_steps_track_a_host_model(method):
    """Prefill 2 / 0 positions, two steps, a finish and a restart, against a host copy."""
    rng = np.random.default_rng(21)
    m, h, n_kv, d, max_seq = 2, 2, 1, 33, 5
    slots = np.array([3, 1], np.int32)
    batch = DecodeBatch(m, h, n_kv, d, max_seq, kv_slots=4, slot_table=slots, fill=np.nan,
                        method=method, split_chunk=2)
    k = np.full(batch.cache_shape, np.nan, np.float32)
    v = k.copy()
    pre_k, pre_v = (rng.standard_normal((m, n_kv, 2, d)).astype(np.float32) for _ in "kv")
    batch.prefill(pre_k, pre_v, [2, 0])
    k[3, :, :2], v[3, :, :2] = pre_k[0], pre_v[0]
    lengths = np.array([2, 0])
    for step in range(2):
        if step == 1:
            batch.finish(0)
        q = rng.standard_normal((m, h, d)).astype(np.float32)
        k_new, v_new = _rows(rng, m, n_kv, d)
        out, lse = batch.step(q, k_new, v_new, return_lse=True)
        live = ~batch.done
        for i in np.flatnonzero(live):
            k[slots[i], :, lengths[i]], v[slots[i], :, lengths[i]] = k_new[i], v_new[i]
            lengths[i] += 1
        seen = np.where(live, lengths, 0)
        ref = decode_attention_ref(q, k, v, seen, slots)
        base = decode_attention_ref(q, k, v, seen, slots, dtype=np.float32)
        assert_matches(out, ref[0], base[0], what=f"step {step}")
        assert_matches(lse, ref[1], base[1], what=f"lse step {step}")
        np.testing.assert_array_equal(batch.lengths, lengths)
        np.testing.assert_array_equal(batch.k_cache.copy_to_host(), k)  # NaN == NaN here
        np.testing.assert_array_equal(batch.v_cache.copy_to_host(), v)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    batch.restart(0, length=0)
    assert not batch.done[0] and batch.lengths[0] == 0


@pytest.mark.device
def test_overflow_raises_before_anything_is_written():
    rng = np.random.default_rng(22)
    batch = DecodeBatch(2, 2, 1, 8, 3, fill=np.nan)
    k = rng.standard_normal(batch.cache_shape).astype(np.float32)
    batch.load(k, k, [3, 1])  # sequence 0 is full
    before = batch.k_cache.copy_to_host()
    k_new, v_new = _rows(rng, 2, 1, 8)
    with pytest.raises(checks.RangeError, match="sequence 0"):
        batch.step(np.zeros((2, 2, 8), np.float32), k_new, v_new)
    np.testing.assert_array_equal(batch.k_cache.copy_to_host(), before)
    np.testing.assert_array_equal(batch.lengths, [3, 1])
    batch.finish(0)  # a finished full sequence no longer blocks the batch
    batch.step(np.zeros((2, 2, 8), np.float32), k_new, v_new)
    np.testing.assert_array_equal(batch.lengths, [3, 2])


def test_bad_arguments_are_named():
    with pytest.raises(checks.RangeError, match="kv_slots"):
        DecodeBatch(3, 2, 1, 8, 4, kv_slots=2)
    with pytest.raises(checks.RangeError, match="slot_table"):
        DecodeBatch(2, 2, 1, 8, 4, kv_slots=3, slot_table=[1, 1])
    with pytest.raises(checks.RangeError, match="n_kv_heads"):
        DecodeBatch(2, 3, 2, 8, 4)
    with pytest.raises(checks.DTypeError, match="dtype"):
        DecodeBatch(2, 2, 1, 8, 4, dtype=np.float64)
    with pytest.raises(ValueError, match="defect"):
        DecodeBatch(2, 2, 1, 8, 4, defect="nope")


@pytest.mark.device
def test_bad_step_input_leaves_state_alone():
    batch = DecodeBatch(2, 2, 1, 8, 4)
    k_new = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(checks.ShapeError, match="q"):
        batch.step(np.zeros((2, 2, 7), np.float32), k_new, k_new)
    with pytest.raises(checks.DTypeError, match="v_new"):
        batch.step(np.zeros((2, 2, 8), np.float32), k_new, k_new.astype(np.float16))
    with pytest.raises(checks.RangeError, match="lengths"):
        batch.load(np.zeros(batch.cache_shape, np.float32),
                   np.zeros(batch.cache_shape, np.float32), [5, 0])
    np.testing.assert_array_equal(batch.lengths, [0, 0])
