"""Split-KV flash-decoding: chunk kernel + LSE combine, the split plan, the heuristic.

Simulator shapes are tiny; chunks are made small so sequences span several
chunks and some chunks are empty (past a sequence's end, or a zero-length
sequence): those must merge with factor 0, never NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.reference.split_decode import (
    MIN_CHUNK,
    choose_decode_method,
    decode,
    flash_decode_attention,
    split_plan,
)
from tests.test_batched_decode import KERNEL_OF, expect, make_case
from validation.tolerance import assert_matches


@pytest.mark.device
@pytest.mark.parametrize("plan", [{"chunk": 2}, {"num_splits": 4}, {"chunk": 7}],
                         ids=["chunk2", "splits4", "one_chunk"])
def test_split_matches_oracle_with_empty_chunks(plan):
    """Lengths 7 / 0 / 2 over chunks of 2: 4 splits, sequence 2 leaves 3 empty."""
    rng = np.random.default_rng(5)
    q, k, v, lens, slots = make_case(rng, 3, 2, 1, 40, 7, [7, 0, 2])
    out, lse = flash_decode_attention(q, k, v, lens, slots, return_lse=True, **plan)
    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots, "flash_decode")
    assert_matches(out, ref, base)
    assert_matches(lse, ref_lse, base_lse, what="lse")
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


@pytest.mark.device
def test_all_sequences_empty_gives_zeros_not_nan():
    rng = np.random.default_rng(6)
    q, k, v, lens, slots = make_case(rng, 2, 2, 2, 8, 4, [0, 0])
    out, lse = flash_decode_attention(q, k, v, lens, slots, return_lse=True, num_splits=3)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.device
def test_dispatcher_methods_agree():
    rng = np.random.default_rng(7)
    q, k, v, lens, slots = make_case(rng, 2, 2, 1, 32, 6, [6, 3])
    for method in ("warp", "split", "auto"):
        (ref, _), (base, _) = expect(q, k, v, lens, slots, KERNEL_OF[method])
        assert_matches(decode(q, k, v, lens, slots, method=method, chunk=4), ref, base,
                       what=method)


def test_split_plan():
    assert split_plan(17, 3, 12, chunk=8) == (3, 8)
    assert split_plan(17, 3, 12, num_splits=2) == (2, 9)
    assert split_plan(0, 3, 12, chunk=8) == (1, 8)  # never a zero-sized grid
    assert split_plan(17, 3, 12, num_splits=3, chunk=6) == (3, 6)
    # default: chunks of at least MIN_CHUNK, about TARGET_WARPS warps
    n, c = split_plan(8192, 1, 8)
    assert c >= MIN_CHUNK and n * c >= 8192 and n > 1
    assert split_plan(100, 64, 32) == (1, 100)  # plenty of warps: no split
    with pytest.raises(checks.RangeError, match="num_splits"):
        split_plan(17, 3, 12, num_splits=2, chunk=4)
    with pytest.raises(checks.RangeError, match="chunk"):
        split_plan(17, 3, 12, chunk=0)


def test_choose_decode_method():
    assert choose_decode_method(1, 8, 8192) == "split"  # few sequences, long context
    assert choose_decode_method(3, 2, 2048) == "split"
    assert choose_decode_method(64, 8, 8192) == "warp"  # enough (sequence, group) streams
    assert choose_decode_method(1, 8, 64) == "warp"  # too short to split
    assert choose_decode_method(32, 8, 8192, n_sms=512) == "split"


def test_bad_input_raises_before_launch():
    q = np.zeros((2, 4, 8), np.float32)
    k = np.zeros((3, 2, 5, 8), np.float32)
    with pytest.raises(checks.RangeError, match="seq_lens"):
        flash_decode_attention(q, k, k, [6, 1])
    with pytest.raises(checks.ShapeError, match="v_cache"):
        flash_decode_attention(q, k, k[:, :, :4], [1, 1])
    with pytest.raises(checks.ShapeError, match="out"):
        flash_decode_attention(q, k, k, [1, 1], out=np.zeros((2, 4, 7), np.float32))
    with pytest.raises(checks.AttentionInputError, match="method"):
        decode(q, k, k, [1, 1], method="bogus")


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [1, 40, 128, 256])
def test_split_kernels_compile(head_dim):
    from numba import cuda, float32

    from attention.reference.warp_decode import n_chunks
    from attention.reference.split_decode import flash_decode_combine_kernel
    from validation.ptx_check import kernel_ptx

    chunk_ptx = kernel_ptx("flash_decode_chunk", head_dim=head_dim)
    assert "shfl.sync.down.b32" in chunk_ptx and "ex2.approx" in chunk_ptx
    assert ".local" not in chunk_ptx
    combine = flash_decode_combine_kernel(n_chunks(head_dim))
    ptx, _ = cuda.compile_ptx(combine.py_func, (
        float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, ::1],
        float32[:, ::1]), cc=(9, 0))
    assert ".local" not in ptx and "shfl" not in ptx


@pytest.mark.gpu
def test_stream_only_enqueues():
    from numba import cuda

    rng = np.random.default_rng(8)
    q, k, v, lens, slots = make_case(rng, 3, 12, 2, 128, 4096, [4096, 1000, 0])
    stream = cuda.stream()
    d_out, d_lse = flash_decode_attention(cuda.to_device(q), cuda.to_device(k),
                                          cuda.to_device(v), lens, slots, stream=stream,
                                          return_lse=True)
    stream.synchronize()
    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots, "flash_decode")
    assert_matches(d_out.copy_to_host(), ref, base)
    assert_matches(d_lse.copy_to_host(), ref_lse, base_lse, what="lse")
