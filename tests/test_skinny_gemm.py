"""The few-rows GEMM (``attention.gemm.skinny``): ``sgemm``'s bits, its PTX, its routing.

* simulator / GPU (``device``): over both ``b`` layouts, ``a``/``c`` layouts,
  a ``K`` with a short last part, ``N`` past the last full column tile, 1 to
  9 rows and an fp16 ``b``, the output equals ``sgemm``'s bit for bit (the
  same partial sums in the same order), and matches a float64 product; the
  columns of ``c`` at and past ``N`` keep their canary. A positive control: a
  product with one weight changed differs (the equality can fail).
* plain process (``compile``): the GPU plan's kernel at the MLA shapes (``K``
  512 and 128) keeps its row sums in registers (no local memory) and runs
  fused multiply-adds.
* plain process: ``use_skinny`` picks it where ``sgemm``'s grid is small.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.gemm import sgemm, skinny


def _run(kernel, a, b, a_order, b_order, c_order, n_len, alpha):
    from attention.core.device import to_device

    z = int(b.shape[0])
    m = a.shape[1] if a_order == "zmk" else a.shape[0]
    width = n_len + 3  # c has columns past N: they must keep the canary
    c = np.full((z, m, width) if c_order == "zmn" else (m, z, width), 7.0, np.float32)
    d_c = to_device(c)
    k_len = int(a.shape[2])
    if kernel == "sgemm":
        ones = np.arange(z, dtype=np.int32)
        sgemm.launch(to_device(a), to_device(b), d_c, to_device(ones),
                     to_device(np.full(z, n_len, np.int32)), to_device(np.full(z, k_len, np.int32)),
                     alpha, a_order=a_order, b_order=b_order, c_order=c_order, max_n=n_len,
                     n_batch=z, stream=0)
    else:
        skinny.launch(to_device(a), to_device(b), d_c, alpha, a_order=a_order, b_order=b_order,
                      c_order=c_order, n_len=n_len, k_len=k_len, n_batch=z, stream=0)
    return d_c.copy_to_host()


def _operands(rng, z, m, n, k, a_order, b_order, b_dtype):
    a = rng.standard_normal((z, m, k) if a_order == "zmk" else (m, z, k)).astype(np.float32)
    b = rng.standard_normal((z, n, k) if b_order == "znk" else (z, k, n)).astype(b_dtype)
    return a, b


def _reference(a, b, a_order, b_order, alpha):
    a64 = a.astype(np.float64) if a_order == "zmk" else a.astype(np.float64).transpose(1, 0, 2)
    b64 = b.astype(np.float64) if b_order == "zkn" else b.astype(np.float64).transpose(0, 2, 1)
    return alpha * (a64 @ b64)  # [z, m, n]


CASES = [
    # (z, m, n, k, a_order, b_order, c_order, b dtype)
    (2, 1, 9, 130, "mzk", "znk", "mzn", np.float32),  # the decompress's layouts, K tail
    (3, 3, 6, 64, "mzk", "zkn", "mzn", np.float32),  # the absorb's layouts
    (1, 9, 5, 70, "zmk", "znk", "zmn", np.float16),  # rows past one block, fp16 b
    (2, 2, 4, 200, "zmk", "zkn", "zmn", np.float32),  # four parts
]


@pytest.mark.device
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[1]}-k{c[3]}-{c[5]}")
def test_same_bits_as_sgemm(case):
    z, m, n, k, a_order, b_order, c_order, b_dtype = case
    rng = np.random.default_rng(m * 100 + k)
    a, b = _operands(rng, z, m, n, k, a_order, b_order, b_dtype)
    alpha = 0.75
    got = _run("skinny", a, b, a_order, b_order, c_order, n, alpha)
    want = _run("sgemm", a, b, a_order, b_order, c_order, n, alpha)
    np.testing.assert_array_equal(got, want)
    assert (got[..., n:] == 7.0).all(), "a column past N was written"
    prod = got[..., :n] if c_order == "zmn" else got[..., :n].transpose(1, 0, 2)
    ref = _reference(a, b, a_order, b_order, alpha)
    base = np.abs((alpha * (a.astype(np.float32) if a_order == "zmk" else a.transpose(1, 0, 2))
                   @ (b.astype(np.float32) if b_order == "zkn" else
                      b.astype(np.float32).transpose(0, 2, 1))) - ref).max()
    err = np.abs(prod - ref).max()
    assert err <= 2 * base + 4 * np.spacing(np.float32(np.abs(ref).max())), (err, base)
    # positive control: one changed weight shows up in the compared bits
    b2 = b.copy()
    b2.reshape(-1)[0] += 1
    assert not np.array_equal(_run("skinny", a, b2, a_order, b_order, c_order, n, alpha), want)


@pytest.mark.compile
@pytest.mark.parametrize("b_order,k_len,m_len", [("znk", 512, 1), ("znk", 512, 64),
                                                 ("zkn", 128, 1), ("zkn", 128, 64)])
def test_gpu_plan_compiles_without_local_memory(b_order, k_len, m_len):
    from numba import cuda, types

    nt, parts, groups, mg = skinny.plan(m_len, k_len)
    kern = skinny.skinny_kernel(b_order, k_len, nt, parts, groups, mg)
    f1 = types.Array(types.float32, 1, "C")
    i64 = types.int64
    sig = (f1, f1, f1, types.float32, i64, i64, i64, i64, i64, i64, i64, i64)
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
    assert ".local" not in ptx, "row sums spilled to local memory"
    assert "fma.rn.f32" in ptx
    assert nt * parts * groups <= 256


def test_routing():
    """The measured choices (``skinny``'s constants): B 1 at 16 heads takes it
    for both GEMMs; B 1 at 128 heads and B 64 keep sgemm; K past 16 parts."""
    assert skinny.use_skinny(1, 128, 512, 16)  # decompress: 16 sgemm blocks
    assert skinny.use_skinny(1, 512, 128, 16)  # absorb: 64
    assert not skinny.use_skinny(1, 128, 512, 128)  # 128 blocks
    assert not skinny.use_skinny(1, 512, 128, 128)
    assert not skinny.use_skinny(64, 128, 512, 16)  # M 64
    assert not skinny.use_skinny(1, 128, skinny.MAX_K + 1, 16)
