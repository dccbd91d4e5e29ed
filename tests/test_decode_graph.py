"""The prebuilt decode step (attention.decode.graph.DecodeStep).

A step scatters each sequence's new K/V row, sets seq_lens = positions + 1,
advances positions and runs the fast attention. Checked against a numpy
scatter plus the float64 oracle over several steps (tolerance as in
test_decode_fast: 2x the float32 numpy baseline's error + 1e-6). On the
simulator (and where no graph can be built) ``step()`` runs the plain path;
on a GPU it replays the captured graph. Capacity overflow and path records:
tests/test_fallbacks.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.core.device import gpu_available
from attention.oracle import decode_attention_ref


def run_steps(n_steps, dtype=np.float32, m=2, h=4, kv=2, d=32, cap=12, use_graph=True):
    from attention.decode.graph import DecodeStep

    rng = np.random.default_rng(5)
    slots = np.array([2, 0][:m], np.int32)
    k = rng.standard_normal((3, kv, cap, d)).astype(dtype)
    v = rng.standard_normal((3, kv, cap, d)).astype(dtype)
    q = rng.standard_normal((m, h, d)).astype(np.float32)
    kn = rng.standard_normal((m, kv, d)).astype(dtype)
    vn = rng.standard_normal((m, kv, d)).astype(dtype)
    pos = np.array([3, 0][:m], np.int32)
    step = DecodeStep(q, kn, vn, k, v, pos, slots, graph=use_graph)
    k_ref, v_ref, p = k.copy(), v.copy(), pos.copy()
    for _ in range(n_steps):
        step.step(sync=True)
        for i in range(m):
            k_ref[slots[i], :, p[i]] = kn[i]
            v_ref[slots[i], :, p[i]] = vn[i]
        p += 1
    step.check()  # every step stayed within the capacity: no flag raised
    lens = p  # after the last step: lengths = last position + 1
    out = step.out.copy_to_host()
    assert np.array_equal(step.d_lens.copy_to_host(), lens)
    assert np.array_equal(step.d_pos.copy_to_host(), p)
    ref, _ = decode_attention_ref(q, k_ref, v_ref, lens, slots)
    return out, ref, step


@pytest.mark.device
def test_steps_match_scatter_plus_oracle():
    from tests.test_decode_fast import FLOOR

    out, ref, _ = run_steps(2)
    # a float32 rounding of the oracle's output is the same-precision baseline here
    # (the step's inputs are the float32 values the oracle reads)
    base = np.abs(ref.astype(np.float32) - ref).max()
    assert np.abs(out - ref).max() <= 2 * base + FLOOR


@pytest.mark.device
def test_positive_control_without_scatter_fails():
    """If the step did not scatter, the output would differ: compare against the
    oracle over the unmodified cache."""
    out, ref, _ = run_steps(1)
    assert np.abs(out - ref).max() < 1e-5
    rng = np.random.default_rng(5)
    k = rng.standard_normal((3, 2, 12, 32)).astype(np.float32)
    v = rng.standard_normal((3, 2, 12, 32)).astype(np.float32)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    stale, _ = decode_attention_ref(q, k, v, [4, 1], [2, 0])
    assert np.abs(out - stale).max() > 1e-3


@pytest.mark.gpu
def test_gpu_graph_is_built_and_replays():
    out, ref, step = run_steps(3, dtype=np.float16, m=2, h=8, kv=2, d=128, cap=64)
    assert step.graph is not None, step.graph_error
    assert step.path == "graph" and step.fallback_reason is None
    assert np.abs(out - ref).max() < 1e-5


def test_bad_positions_raise_before_launch():
    from attention.decode.graph import DecodeStep

    q = np.zeros((2, 4, 32), np.float32)
    k = np.zeros((2, 2, 8, 32), np.float32)
    rows = np.zeros((2, 2, 32), np.float32)
    with pytest.raises(checks.RangeError):
        DecodeStep(q, rows, rows, k, k, np.array([0, 8], np.int32))
    with pytest.raises(checks.RangeError):
        DecodeStep(q, rows, rows, k, k, np.array([0, 1], np.int32), np.array([1, 1], np.int32))
    with pytest.raises(checks.DTypeError):
        DecodeStep(q, rows.astype(np.float16), rows, k, k, np.array([0, 1], np.int32))
