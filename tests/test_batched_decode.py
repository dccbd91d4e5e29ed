"""Batched warp-per-head decode over pooled caches and per-slot pointer tables.

Hostile fixtures: NaN in unused slots and past every length, shuffled slot
tables, lengths 0 and max_seq. Tolerances: ``validation.tolerance`` (kernel
error <= 2 x the float32 baseline's error against the float64 oracle + a
floor of a few float32 roundings).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.reference.warp_decode import batched_decode_attention
from attention.oracle import decode_attention_ref
from tests.conftest import MODE
from validation.tolerance import assert_matches


def make_case(rng, m_count, n_heads, n_kv, head_dim, max_seq, lengths, *, kv_slots=None):
    """Random q and NaN-padded pooled caches; sequence m in a shuffled slot."""
    kv_slots = kv_slots or m_count + 2
    slots = rng.permutation(kv_slots)[:m_count].astype(np.int32)
    q = rng.standard_normal((m_count, n_heads, head_dim)).astype(np.float32)
    shape = (kv_slots, n_kv, max_seq, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    lengths = np.asarray(lengths, np.int32)
    for m, (slot, length) in enumerate(zip(slots, lengths)):
        k[slot, :, :length] = rng.standard_normal((n_kv, length, head_dim))
        v[slot, :, :length] = rng.standard_normal((n_kv, length, head_dim))
    return q, k, v, lengths, slots


KERNEL_OF = {"warp": "batched_decode", "split": "flash_decode", "auto": "batched_decode"}


def expect(q, k, v, lengths, slots, kernel="batched_decode"):
    """(float64 oracle, same-precision baseline): the baseline in the order the
    registry names for ``kernel`` (``validation.baselines``), as the sweep judges it;
    each a pair (out, lse)."""
    from validation import baselines
    from validation.registry import KERNELS_BY_NAME

    ref = decode_attention_ref(q, k, v, lengths, slots)
    label = baselines.resolve(KERNELS_BY_NAME[kernel].baseline, {"q": q}, np.asarray(k).dtype)
    base = baselines.decode_order(q, k, v, lengths, slots, label)
    return ref, base


@pytest.mark.device
def test_hostile_pool_matches_oracle():
    """GQA 2:1, D 40 (tail lanes), lengths 0 / 1 / max_seq, shuffled slots, NaN padding."""
    rng = np.random.default_rng(11)
    q, k, v, lens, slots = make_case(rng, 3, 4, 2, 40, 5, [5, 0, 1])
    out, lse = batched_decode_attention(q, k, v, lens, slots, return_lse=True)
    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots)
    assert_matches(out, ref, base)
    assert_matches(lse, ref_lse, base_lse, what="lse")
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


@pytest.mark.device
def test_device_arrays_and_stream():
    from numba import cuda

    rng = np.random.default_rng(12)
    q, k, v, lens, slots = make_case(rng, 2, 2, 1, 33, 4, [3, 4])
    stream = cuda.stream()
    d_out = batched_decode_attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v),
                                     cuda.to_device(lens), cuda.to_device(slots), stream=stream)
    stream.synchronize()
    (ref, _), (base, _) = expect(q, k, v, lens, slots)
    assert_matches(d_out.copy_to_host(), ref, base)


def test_pointer_list_validated_before_launch():
    ok = [np.zeros((2, 4, 8), np.float32) for _ in range(3)]
    q = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(checks.ShapeError, match=r"v_cache\[1\]"):
        bad = list(ok)
        bad[1] = np.zeros((2, 5, 8), np.float32)
        batched_decode_attention(q, ok, bad, [1, 1])
    with pytest.raises(checks.DTypeError, match=r"k_cache\[0\]"):
        batched_decode_attention(q, [x.astype(np.float64) for x in ok], ok, [1, 1])
    with pytest.raises(checks.LayoutError, match="v_cache"):
        batched_decode_attention(q, ok, np.zeros((3, 2, 4, 8), np.float32), [1, 1])
    with pytest.raises(checks.ShapeError, match="KV_SLOTS"):
        batched_decode_attention(q, ok[:1], ok[:1], [1, 1])


@pytest.mark.device
def test_pointer_list_needs_a_gpu():
    """Under the simulator a per-slot list is refused with a clear error."""
    from attention.core.pointers import PointerTableUnavailable

    if MODE != "sim":
        pytest.skip("the GPU reads pointer tables (test_pointer_tables_match_pool)")
    from numba import cuda

    caches = [cuda.to_device(np.zeros((1, 4, 8), np.float32)) for _ in range(2)]
    with pytest.raises(PointerTableUnavailable, match="simulator"):
        batched_decode_attention(np.zeros((2, 2, 8), np.float32), caches, caches, [1, 1])


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [40, 128, 256])
@pytest.mark.parametrize("kind", ["batched_decode", "flash_decode_chunk"])
def test_pointer_table_kernels_compile(kind, head_dim):
    from validation.ptx_check import kernel_ptx

    ptx = kernel_ptx(kind, head_dim=head_dim, pointers=True)
    assert "ld.global.f32" in ptx and "ld.global.u64" in ptx, "pointer table not read"
    assert ".local" not in ptx


# -- GPU: full sizes -------------------------------------------------------------

GPU_CASES = [
    # (D, H, H_kv, M, max_seq, lengths kind)
    (64, 8, 8, 5, 1024, "mixed"),      # GQA 1:1
    (96, 16, 4, 17, 2048, "mixed"),    # 4:1
    (128, 12, 2, 64, 2048, "mixed"),   # 6:1, M 64
    (256, 28, 4, 3, 8192, "long"),     # 7:1, lengths up to 8192
    (128, 28, 4, 9, 8192, "long"),
]


def _gpu_lengths(rng, kind, m_count, max_seq):
    if kind == "long":
        lens = rng.integers(max_seq // 2, max_seq + 1, m_count)
        lens[0] = max_seq
    else:
        lens = rng.integers(0, max_seq + 1, m_count)
        lens[: min(3, m_count)] = [0, 1, max_seq][: min(3, m_count)]
    return lens.astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["warp", "split"])
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"D{c[0]}-H{c[1]}-Hkv{c[2]}-M{c[3]}-S{c[4]}")
def test_gpu_sweep(case, method):
    from attention.reference.split_decode import decode

    head_dim, n_heads, n_kv, m_count, max_seq, kind = case
    rng = np.random.default_rng(head_dim * 1000 + m_count)
    lens = _gpu_lengths(rng, kind, m_count, max_seq)
    q, k, v, lens, slots = make_case(rng, m_count, n_heads, n_kv, head_dim, max_seq, lens)
    out, lse = decode(q, k, v, lens, slots, method=method, return_lse=True)
    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots, KERNEL_OF[method])
    assert_matches(out, ref, base, what=f"out {case} {method}")
    assert_matches(lse, ref_lse, base_lse, what=f"lse {case} {method}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["warp", "split"])
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 4, 4), (128, 12, 2), (256, 14, 2)])
def test_pointer_tables_match_pool(method, head_dim, n_heads, n_kv):
    """Per-slot allocations read through uint64 pointer tables give the pooled result."""
    from numba import cuda

    from attention.reference.split_decode import decode

    rng = np.random.default_rng(head_dim)
    max_seq = 2048
    lens = np.array([17, 11, 5, 0, 2048], np.int32)
    q, k, v, lens, slots = make_case(rng, 5, n_heads, n_kv, head_dim, max_seq, lens, kv_slots=8)
    k_list = [cuda.to_device(np.ascontiguousarray(k[s])) for s in range(k.shape[0])]
    v_list = [cuda.to_device(np.ascontiguousarray(v[s])) for s in range(v.shape[0])]
    pooled = decode(q, k, v, lens, slots, method=method)
    listed, lse = decode(q, k_list, v_list, lens, slots, method=method, return_lse=True)
    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots, KERNEL_OF[method])
    assert_matches(listed, ref, base, what="pointer-table out")
    assert_matches(lse, ref_lse, base_lse, what="pointer-table lse")
    assert_matches(listed, ref, base, what="pointer-table vs oracle")
    assert_matches(pooled, ref, base, what="pooled vs oracle")


@pytest.mark.gpu
@pytest.mark.parametrize("defect", ["stuck_rescale", "gqa_mod", "slot_off_by_one",
                                    "batch_max_len"])
def test_pointer_tables_planted_defects_are_visible(defect):
    from numba import cuda

    from validation import suite_batched_decode as suite

    shape = suite.PRODUCTION
    lens = np.array(shape.seq_lens, np.int32)
    slots = suite.slot_table_for(shape)
    k, v = suite.build_caches(shape, lens, slots)
    q = suite.q_values(shape)
    k_list = [cuda.to_device(np.ascontiguousarray(x)) for x in k]
    v_list = [cuda.to_device(np.ascontiguousarray(x)) for x in v]
    (ref, _), (base, _) = suite.oracle_pair(q, k, v, lens, slots)
    good = batched_decode_attention(q, k_list, v_list, lens, slots)
    assert suite.compare("good", good, ref, base).passed
    bad = batched_decode_attention(q, k_list, v_list, lens, slots, defect=defect)
    assert not suite.compare("bad", bad, ref, base).passed
