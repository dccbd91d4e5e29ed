"""Single-sequence warp-per-head decode attention: oracle, codegen, execution, bad input.

Executed on the simulator at small shapes (H 4, H_kv 2, D 40 and 96, lengths
0, 1, 7 and max) and on a GPU at H 32, H_kv 8, D 64/80/128/256, lengths up
to 4096. Tolerances come from validation.tolerance (kernel error against the
float64 oracle at most twice the float32 baseline's, plus a few roundings).
"""

import numpy as np
import pytest

from attention.core import checks
from attention.reference.warp_decode import batched_decode_kernel, decode_attention, n_chunks
from attention.oracle import decode_attention_ref, kv_head_of, softmax_attend
from tests.conftest import MODE
from validation.tolerance import assert_matches


def make_case(rng, n_heads, n_kv, head_dim, max_seq, *, nan_beyond=None):
    q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_kv, max_seq, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_kv, max_seq, head_dim)).astype(np.float32)
    if nan_beyond is not None:  # positions past the length must never be read
        k[:, nan_beyond:] = np.nan
        v[:, nan_beyond:] = np.nan
    return q, k, v


# -- the oracle itself --------------------------------------------------------


def test_oracle_equal_scores_average_the_values():
    """All-equal scores: the output is the plain mean of the value rows."""
    rng = np.random.default_rng(0)
    vals = rng.standard_normal((5, 3))
    out, lse = softmax_attend(np.full(5, 0.7), vals)
    np.testing.assert_allclose(out, vals.mean(0), rtol=1e-14)
    np.testing.assert_allclose(lse, 0.7 + np.log(5), rtol=1e-14)


def test_oracle_empty_sequence_is_zero_and_minus_inf():
    out, lse = decode_attention_ref(np.ones((2, 4)), np.ones((1, 3, 4)), np.ones((1, 3, 4)), 0)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_oracle_gqa_map_groups_consecutive_heads():
    assert [kv_head_of(h, 12, 2) for h in range(12)] == [0] * 6 + [1] * 6
    assert [kv_head_of(h, 9, 3) for h in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_oracle_matches_a_dense_softmax():
    """The per-row oracle against one dense matrix formulation."""
    rng = np.random.default_rng(1)
    q, k, v = make_case(rng, 4, 2, 8, 6)
    out, lse = decode_attention_ref(q, k, v, 5, scale=0.3)
    for h in range(4):
        g = kv_head_of(h, 4, 2)
        s = 0.3 * k[g, :5].astype(float) @ q[h].astype(float)
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        np.testing.assert_allclose(out[h], p @ v[g, :5].astype(float), rtol=1e-12)
        np.testing.assert_allclose(lse[h], np.log(np.exp(s).sum()), rtol=1e-12)


# -- codegen (no GPU) ----------------------------------------------------------

DECODE_SIG = "void(float32[:,:,::1], float32[:,:,:,::1], float32[:,:,:,::1], int32[::1], " \
             "int32[::1], float32, float32[:,:,::1], float32[:,::1])"


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [1, 40, 96, 128, 200, 256])
def test_decode_kernel_compiles_with_warp_shuffles(head_dim):
    from numba import cuda

    kernel = batched_decode_kernel(n_chunks(head_dim))
    ptx, _ = cuda.compile_ptx(kernel.py_func, DECODE_SIG, cc=(9, 0), fastmath=True)
    assert "shfl.sync.down.b32" in ptx, "score reduction must use shuffle-down"
    assert "shfl.sync.idx.b32" in ptx, "lane 0's sum must be broadcast"
    assert "ex2.approx" in ptx
    assert ".local" not in ptx, "per-lane q/acc arrays spilled to local memory"
    # the epilogue's 1 / l and log l are accurate (attention.core.warp.softmax_finish)
    assert "rcp.rn" in ptx and "div.approx" not in ptx and "lg2.approx" not in ptx


def test_host_views_get_plain_strides_before_the_copy():
    """numpy gives ``x[None]`` a 0 stride; numba's host copy then walks the
    array element by element in Python (minutes for a KV cache). ``to_device``
    hands it a view with the plain C strides instead, sharing the memory."""
    from attention.core.device import c_strides

    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert x[None].strides[0] == 0
    y = c_strides(x[None])
    assert y.strides == (96, 48, 16, 4)
    assert np.shares_memory(x, y) and np.array_equal(y[0], x)
    assert c_strides(x) is x


@pytest.mark.compile
def test_decode_kernel_keeps_its_kahan_compensation():
    """fastmath must not fold ``(t - scaled) - y`` away: each compensated sum
    (l and CH accumulators) keeps three subtractions in the PTX. Control: the
    same kernel with a plain ``total * alpha + y`` in place of the helper
    falls below the bound, so the count can fail."""
    import re

    from numba import cuda

    def subs(fn):
        ptx, _ = cuda.compile_ptx(fn, DECODE_SIG, cc=(9, 0), fastmath=True)
        return len(re.findall(r"\bsub(\.rn)?(\.ftz)?\.f32", ptx))

    @cuda.jit(device=True, inline="always")
    def plain_rescale_add(total, comp, alpha, y):
        return total * alpha + y, comp

    from attention.reference import warp_decode

    chunks = 4
    fn = batched_decode_kernel(chunks).py_func
    bound = 3 * (1 + chunks)
    assert subs(fn) >= bound, "the compensation was folded away"
    # control: the same kernel built with a plain rescale-add in the shared
    # position loop (warp_decode.position_loop resolves the helper at compile)
    saved = warp_decode.compensated_rescale_add
    try:
        warp_decode.compensated_rescale_add = plain_rescale_add
        warp_decode.position_loop.cache_clear()
        warp_decode.batched_decode_kernel.cache_clear()
        plain = warp_decode.batched_decode_kernel(chunks).py_func
        assert subs(plain) < bound, "control: an uncompensated kernel must fall below the bound"
    finally:
        warp_decode.compensated_rescale_add = saved
        warp_decode.position_loop.cache_clear()
        warp_decode.batched_decode_kernel.cache_clear()


@pytest.mark.compile
def test_warp_helpers_emit_butterfly_shuffles():
    from numba import cuda

    from attention.core.warp import warp_max, warp_sum

    def kernel(x, out):
        i = cuda.threadIdx.x
        out[i] = warp_sum(x[i]) + warp_max(x[i])

    ptx, _ = cuda.compile_ptx(kernel, "void(float32[::1], float32[::1])", cc=(9, 0))
    assert ptx.count("shfl.sync.bfly.b32") == 10


# -- execution (simulator or GPU) ----------------------------------------------

if MODE == "gpu":
    SHAPES = [(32, 8, d, 4096) for d in (64, 80, 128, 256)]
    LENGTHS = [0, 1, 7, 1000, 4096]
else:
    SHAPES = [(4, 2, 40, 16), (4, 2, 96, 16)]
    LENGTHS = [0, 1, 7, 16]


@pytest.mark.device
@pytest.mark.parametrize("n_heads,n_kv,head_dim,max_seq", SHAPES)
def test_decode_matches_oracle(n_heads, n_kv, head_dim, max_seq):
    """Every length of LENGTHS on one cache; positions past the length hold NaN."""
    rng = np.random.default_rng(100 + head_dim)
    q, k, v = make_case(rng, n_heads, n_kv, head_dim, max_seq)
    for length in LENGTHS:
        length = min(length, max_seq)
        kl, vl = k.copy(), v.copy()
        kl[:, length:] = np.nan  # never read: a read would poison the output
        vl[:, length:] = np.nan
        out, lse = decode_attention(q, kl, vl, length, return_lse=True)
        ref, ref_lse = decode_attention_ref(q, kl, vl, length)
        base, base_lse = decode_attention_ref(q, kl, vl, length, dtype=np.float32)
        assert out.dtype == np.float32 and out.shape == (n_heads, head_dim)
        assert_matches(out, ref, base, what=f"out (length {length})")
        assert_matches(lse, ref_lse, base_lse, what=f"lse (length {length})")
        if length == 0:
            assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.device
def test_decode_custom_scale_and_device_arrays():
    """Device-array inputs give device outputs; an explicit scale is honoured."""
    from numba import cuda

    rng = np.random.default_rng(7)
    q, k, v = make_case(rng, 4, 2, 40, 12)
    d_out = decode_attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), 9,
                             scale=0.05)
    assert not isinstance(d_out, np.ndarray)
    ref, _ = decode_attention_ref(q, k, v, 9, scale=0.05)
    base, _ = decode_attention_ref(q, k, v, 9, scale=0.05, dtype=np.float32)
    assert_matches(d_out.copy_to_host(), ref, base)


@pytest.mark.device
def test_decode_on_a_stream_only_enqueues():
    from numba import cuda

    rng = np.random.default_rng(8)
    q, k, v = make_case(rng, 4, 2, 40, 12)
    stream = cuda.stream()
    d_out = decode_attention(cuda.to_device(q, stream=stream), cuda.to_device(k, stream=stream),
                             cuda.to_device(v, stream=stream), 12, stream=stream)
    host = d_out.copy_to_host(stream=stream)
    stream.synchronize()
    ref, _ = decode_attention_ref(q, k, v, 12)
    base, _ = decode_attention_ref(q, k, v, 12, dtype=np.float32)
    assert_matches(host, ref, base)


@pytest.mark.gpu
def test_decode_accepts_torch_tensors():
    torch = pytest.importorskip("torch", reason="torch not installed: CAI/DLPack path untested")
    rng = np.random.default_rng(9)
    q, k, v = make_case(rng, 32, 8, 128, 256)
    tq, tk, tv = (torch.from_numpy(a).cuda() for a in (q, k, v))
    out = decode_attention(tq, tk, tv, 200)
    got = torch.as_tensor(out, device="cuda").cpu().numpy()
    ref, _ = decode_attention_ref(q, k, v, 200)
    base, _ = decode_attention_ref(q, k, v, 200, dtype=np.float32)
    assert_matches(got, ref, base)

    class DLPackOnly:  # only the DLPack protocol, no __cuda_array_interface__
        def __init__(self, t):
            self._t, self.shape, self.dtype = t, tuple(t.shape), np.float32

        def __dlpack__(self, **kw):
            return self._t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._t.__dlpack_device__()

    out2 = decode_attention(DLPackOnly(tq), DLPackOnly(tk), DLPackOnly(tv), 200)
    np.testing.assert_array_equal(out2.copy_to_host(), got)


# -- bad input: raised before any launch (no GPU needed) -----------------------


def _ok(rng=np.random.default_rng(3)):
    return make_case(rng, 4, 2, 40, 16)


BAD_INPUTS = [
    ("q rank", lambda q, k, v: (q[None], k, v, 4), checks.ShapeError, "q: expected shape"),
    ("q dtype", lambda q, k, v: (q.astype(np.float64), k, v, 4), checks.DTypeError,
     "q: expected dtype float32"),
    ("head_dim mismatch", lambda q, k, v: (q, k[..., :39].copy(), v, 4), checks.ShapeError,
     "k_cache: expected shape"),
    ("v shape", lambda q, k, v: (q, k, v[:, :8].copy(), 4), checks.ShapeError,
     "v_cache: expected shape"),
    ("H not a multiple of H_kv", lambda q, k, v: (q[:3].copy(), k, v, 4), checks.RangeError,
     "H_kv=2 must divide"),
    ("head_dim too large", lambda q, k, v: (np.zeros((4, 257), np.float32),
                                           np.zeros((2, 4, 257), np.float32),
                                           np.zeros((2, 4, 257), np.float32), 1),
     checks.RangeError, "head_dim in \\[1, 256\\]"),
    ("seq_len past max_seq", lambda q, k, v: (q, k, v, 17), checks.RangeError,
     "seq_len: expected length in \\[0, 16\\]"),
    ("negative seq_len", lambda q, k, v: (q, k, v, -1), checks.RangeError, "seq_len"),
    ("non-contiguous cache", lambda q, k, v: (q, k.transpose(1, 0, 2).copy().transpose(1, 0, 2),
                                              v, 4), checks.LayoutError, "C-contiguous"),
    ("float seq_len", lambda q, k, v: (q, k, v, 4.0), checks.DTypeError, "seq_len"),
]


@pytest.mark.parametrize("name,mutate,error,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_decode_bad_input_raises_named_error(name, mutate, error, message):
    q, k, v, n = mutate(*_ok())
    with pytest.raises(error, match=message):
        decode_attention(q, k, v, n)
    assert issubclass(error, ValueError)


def test_bad_scale_raises():
    q, k, v = _ok()
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(checks.RangeError, match="scale"):
            decode_attention(q, k, v, 4, scale=scale)
