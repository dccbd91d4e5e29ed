"""kv_scatter: one position's K or V written into a head-first cache, bit-exact.

Canaries: the cache starts filled with a bit pattern no row uses (a NaN payload
for float caches), so any stray write, or a write to the wrong position, head
or offset, changes bytes the test compares. The rows carry values that are not
exactly representable in fewer bits, so a conversion on the way shows up too.
"""

import numpy as np
import pytest

from attention.core import checks
from attention.cache.scatter import kv_scatter
from tests.conftest import MODE

CANARY = np.uint32(0x7FC0DEAD)  # a quiet NaN with a payload no kernel produces


def canary_cache(n_kv, max_seq, head_dim, dtype=np.float32):
    if dtype == np.float32:
        return np.full((n_kv, max_seq, head_dim), CANARY, np.uint32).view(np.float32)
    return np.full((n_kv, max_seq, head_dim), np.uint16(0x7E5A), np.uint16).view(dtype)


SHAPES = [(2, 16, 40), (3, 8, 96), (1, 4, 1)] if MODE != "gpu" else \
    [(8, 4096, 128), (8, 4096, 80), (2, 16, 40), (4, 1024, 256)]


@pytest.mark.device
@pytest.mark.parametrize("n_kv,max_seq,head_dim", SHAPES)
@pytest.mark.parametrize("layout", ["interleaved", "head_major"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_scatter_is_bit_exact_and_touches_nothing_else(n_kv, max_seq, head_dim, layout, dtype):
    rng = np.random.default_rng(n_kv * 1000 + head_dim)
    cache = canary_cache(n_kv, max_seq, head_dim, dtype)
    before = cache.copy()
    rows = rng.standard_normal((n_kv, head_dim)).astype(dtype)
    src = rows.reshape(-1) if layout == "interleaved" else rows
    for pos in sorted({0, max_seq // 2, max_seq - 1}):
        kv_scatter(src, cache, pos)
        expect = before.copy()
        expect[:, pos, :] = rows
        np.testing.assert_array_equal(cache.view(np.uint8), expect.view(np.uint8))
        before = expect


@pytest.mark.device
def test_scatter_into_a_device_cache():
    from numba import cuda

    cache = canary_cache(2, 8, 40)
    d_cache = cuda.to_device(cache)
    rows = np.arange(80, dtype=np.float32).reshape(2, 40) + 0.1
    kv_scatter(cuda.to_device(rows), d_cache, 5)
    got = d_cache.copy_to_host()
    cache[:, 5, :] = rows
    np.testing.assert_array_equal(got.view(np.uint32), cache.view(np.uint32))


SCATTER_BAD = [
    ("pos past the end", dict(pos=8), checks.RangeError, "pos: expected position in \\[0, 7\\]"),
    ("negative pos", dict(pos=-1), checks.RangeError, "pos"),
    ("src size", dict(src=np.zeros(79, np.float32)), checks.ShapeError, "src: expected shape"),
    ("src heads", dict(src=np.zeros((3, 40), np.float32)), checks.ShapeError, "src"),
    ("src dtype", dict(src=np.zeros(80, np.float64)), checks.DTypeError, "src: expected dtype"),
    ("cache rank", dict(cache=np.zeros((2, 8), np.float32)), checks.ShapeError, "cache"),
    ("cache dtype", dict(cache=np.zeros((2, 8, 40), np.int32)), checks.DTypeError, "cache"),
    ("float pos", dict(pos=2.0), checks.DTypeError, "pos"),
]


@pytest.mark.parametrize("name,change,error,message", SCATTER_BAD, ids=[b[0] for b in SCATTER_BAD])
def test_scatter_bad_input_leaves_cache_untouched(name, change, error, message):
    args = dict(src=np.ones(80, np.float32), cache=canary_cache(2, 8, 40), pos=3)
    args.update(change)
    before = np.array(args["cache"], copy=True)
    with pytest.raises(error, match=message):
        kv_scatter(args["src"], args["cache"], args["pos"])
    np.testing.assert_array_equal(np.asarray(args["cache"]).view(np.uint8), before.view(np.uint8))
