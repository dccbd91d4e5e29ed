"""Fast batched decode (attention.decode.fast) against the float64 oracle.

Tolerance (derived, not tuned): the kernel's max error against the float64
oracle must be at most 2x the error of a plain numpy implementation in float32
on the same (dtype-rounded) inputs, plus a floor of 1e-6 (a few float32 ulps
of outputs of size ~1: fast-math exp and the different summation order
differ by rounding only). fp16 / bf16 caches are compared on the values they
hold (the oracle upcasts the stored values), so storage rounding is not error.

Hostile data: unused slots and positions past each length hold NaN (any
out-of-bounds read shows up), the slot table is shuffled, lengths are uneven
and include 0 (zeros and LSE -inf, never NaN).
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.oracle import decode_attention_ref, kv_head_of
from attention.core.device import SIMULATOR
from tests.conftest import MODE

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None

FLOOR = 1e-6


def numpy_f32_baseline(q, k, v, lens, slots, scale):
    """Plain float32 numpy decode attention (the same-precision baseline)."""
    m_count, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    out = np.zeros(q.shape, np.float32)
    for m in range(m_count):
        length = int(lens[m])
        if length == 0:
            continue
        for h in range(n_heads):
            g = kv_head_of(h, n_heads, n_kv)
            keys = k[slots[m], g, :length].astype(np.float32)  # [L, D]
            vals = v[slots[m], g, :length].astype(np.float32)  # [L, D]
            s = (keys @ q[m, h].astype(np.float32)) * np.float32(scale)  # [L]
            e = np.exp(s - s.max())
            out[m, h] = (e[:, None] * vals).sum(0) / e.sum()
    return out


def make_case(seed, m_count, n_heads, n_kv, head_dim, max_seq, dtype, lens=None):
    """Poisoned pooled cache (NaN outside each sequence), shuffled slot table."""
    rng = np.random.default_rng(seed)
    n_slots = m_count + 2
    k = rng.standard_normal((n_slots, n_kv, max_seq, head_dim)).astype(np.float32)
    v = rng.standard_normal((n_slots, n_kv, max_seq, head_dim)).astype(np.float32)
    q = rng.standard_normal((m_count, n_heads, head_dim)).astype(np.float32)
    if lens is None:
        lens = rng.integers(1, max_seq + 1, m_count)
        lens[0] = max_seq
        if m_count > 2:
            lens[1] = 0
    lens = np.asarray(lens, np.int32)
    slots = rng.permutation(n_slots)[:m_count].astype(np.int32)
    used = np.zeros((n_slots, max_seq), bool)
    for m in range(m_count):
        used[slots[m], :lens[m]] = True
    k.transpose(0, 2, 1, 3)[~used] = np.nan  # [slot, pos] mask over all heads
    v.transpose(0, 2, 1, 3)[~used] = np.nan
    return q, k.astype(dtype), v.astype(dtype), lens, slots


def check_against_oracle(q, k, v, lens, slots, **kw):
    from attention.decode.fast import batched_decode_attention_fast

    scale = 1.0 / np.sqrt(q.shape[2])
    out, lse = batched_decode_attention_fast(q, k, v, lens, slots, return_lse=True, **kw)
    ref_out, ref_lse = decode_attention_ref(q, k, v, lens, slots)
    base = numpy_f32_baseline(q, k, v, lens, slots, scale)
    assert not np.isnan(out).any(), "NaN in output (out-of-bounds read or empty sequence)"
    base_err = np.abs(base - ref_out).max()
    err = np.abs(out - ref_out).max()
    where = np.unravel_index(np.argmax(np.abs(out - ref_out)), out.shape)
    assert err <= 2 * base_err + FLOOR, f"max err {err:.3g} at {where}, baseline {base_err:.3g}"
    empty = lens == 0
    assert np.all(np.isneginf(lse[empty])) and np.all(out[empty] == 0)
    fin = ~empty
    lse_err = np.abs(lse[fin] - ref_lse[fin]).max() if fin.any() else 0.0
    assert lse_err <= 1e-5 * max(1.0, np.abs(ref_lse[fin]).max()), f"lse err {lse_err:.3g}"
    return err, base_err


# ---- simulator / GPU: small awkward shapes ---------------------------------

SMALL_CASES = [
    # (seed, M, H, H_kv, D, max_seq, dtype, n_split): why
    (1, 3, 4, 2, 32, 21, np.float32, None),   # GQA 2, D=32 (scalar row layout)
    (2, 3, 4, 2, 40, 13, np.float32, 2),      # D not a multiple of 32, split-KV
    (3, 2, 2, 2, 64, 19, np.float16, 3),      # fp16 vector path (VEC=2), MHA, 3 splits
    (4, 3, 6, 2, 128, 9, np.float32, None),   # group of 3, 16-byte loads
    (5, 1, 2, 1, 32, 140, np.float32, 9),     # 9 splits: two combine warps (runs of 5, 4)
    (6, 1, 2, 1, 40, 150, np.float32, 70),    # 70 splits: 8 combine warps, runs of 9 (a
                                              # second batch of 1), most splits empty, D=40
    (9, 3, 8, 2, 64, 45, np.float16, 2),      # GQA 4 at 16 lanes: 4 heads x 4 positions,
                                              # one score a lane (reduce-scatter)
    (10, 2, 8, 1, 32, 50, np.float32, 3),     # GQA 8: 8 heads a block (more than its
                                              # warps), 3 splits
]


@pytest.mark.device
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: f"s{c[0]}")
def test_small_matches_oracle(case):
    seed, m, h, kv, d, s, dt, ns = case
    if seed == 9:  # the case is there for the reduce-scatter form (rows by the ring)
        from attention.decode import fast as F

        name = F.plan(m, h, kv, d, s, "f16")["kernel"].py_func.__name__
        assert name.endswith(f"psa{F.ASYNC_STAGES}"), name
    q, k, v, lens, slots = make_case(seed, m, h, kv, d, s, dt)
    check_against_oracle(q, k, v, lens, slots, n_split=ns)


LANE_CASES = [
    # (seed, M, H, H_kv, D, max_seq, dtype, n_split): lengths 1..max_seq leave
    # lane groups whose positions all lie past the end of a tile
    (11, 3, 4, 2, 64, 23, np.float32, None),
    (12, 3, 4, 2, 64, 23, np.float16, 3),
    (13, 2, 6, 2, 40, 17, np.float16, 2),  # scalar layout with 16 / 8 lanes a row
]


@pytest.mark.device
@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("case", LANE_CASES, ids=lambda c: f"s{c[0]}")
def test_rows_of_fewer_lanes_match_oracle(case, lanes, monkeypatch):
    """Several rows a warp (lanes per row 16 / 8), the layout of the 16-bit
    caches, for every dtype: group sums, the merge of a warp's lane groups,
    groups with nothing to attend (lengths 1 and 0)."""
    from attention.decode import fast as F

    seed, m, h, kv, d, s, dt, ns = case
    monkeypatch.setattr(F, "LANES", {kind: lanes for kind in F.LANES})
    q, k, v, lens, slots = make_case(seed, m, h, kv, d, s, dt)
    lens[-1] = 1
    check_against_oracle(q, k, v, lens, slots, n_split=ns)


@pytest.mark.device
@pytest.mark.parametrize("case", [c for c in SMALL_CASES + LANE_CASES if c[6] == np.float16],
                         ids=lambda c: f"s{c[0]}")
def test_one_buffer_16bit_rows_match_oracle(case, monkeypatch):
    """16-bit vector rows without the pipeline (``plan(pipeline=False)``, the
    form fp32 always uses): the same check."""
    from attention.decode import fast as F

    seed, m, h, kv, d, s, dt, ns = case
    monkeypatch.setattr(F, "PIPELINE", False)
    q, k, v, lens, slots = make_case(seed, m, h, kv, d, s, dt)
    check_against_oracle(q, k, v, lens, slots, n_split=ns)


@pytest.mark.device
@pytest.mark.parametrize("stages", [0, 2, 3])
@pytest.mark.parametrize("case", [c for c in SMALL_CASES + LANE_CASES
                                  if c[6] == np.float16 and c[4] % 32 == 0],  # vector rows
                         ids=lambda c: f"s{c[0]}")
def test_pipeline_stages_match_oracle(case, stages, monkeypatch):
    """The pipelined 16-bit kernel with two register buffers (``stages`` 0, the
    form for GPUs without ``cp.async``) and with rings of 2 and 3 stages (the
    default is ``ASYNC_STAGES``): the same check. Lengths up to 150 give a warp
    more steps than stages, so the ring wraps. (The simulator copies at once:
    that a wait covers its copies is checked on a GPU, by these tests and the
    validation runner.)"""
    from attention.decode import fast as F

    seed, m, h, kv, d, s, dt, ns = case
    monkeypatch.setattr(F, "ASYNC_STAGES", stages)
    q, k, v, lens, slots = make_case(seed, m, h, kv, d, max(s, 150), dt)
    assert F.plan(m, h, kv, d, max(s, 150), "f16")["stages"] == stages
    check_against_oracle(q, k, v, lens, slots, n_split=ns)


@pytest.mark.device
def test_positive_control_wrong_scale_fails():
    """The comparison can fail: a wrong scale is caught by the same check."""
    q, k, v, lens, slots = make_case(7, 2, 2, 1, 32, 11, np.float32, lens=[11, 5])
    with pytest.raises(AssertionError):
        check_against_oracle(q, k, v, lens, slots, scale=0.5)


@pytest.mark.device
def test_q_in_cache_dtype_fp16():
    q, k, v, lens, slots = make_case(8, 2, 2, 1, 32, 7, np.float16, lens=[7, 3])
    check_against_oracle(q.astype(np.float16).astype(np.float32), k, v, lens, slots)
    from attention.decode.fast import batched_decode_attention_fast

    a = batched_decode_attention_fast(q.astype(np.float16), k, v, lens, slots)
    b = batched_decode_attention_fast(q.astype(np.float16).astype(np.float32), k, v, lens, slots)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ---- GPU: the full shapes of the benchmark ----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("max_seq", [1024, 16384])
def test_gpu_full_shape(dtype, max_seq):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes not installed")
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    m = 32 if max_seq <= 1024 else 4  # the oracle is float64 numpy: keep it quick
    q, k, v, lens, slots = make_case(11, m, 32, 8, 128, max_seq, dt)
    check_against_oracle(q, k, v, lens, slots)


@pytest.mark.gpu
def test_gpu_pdl_overlap():
    """sm_90 and later: ``attention.core.pdl.launch_dependent`` really lets a
    dependent start while its primary runs. The primary releases its
    dependents, then spins (at most ~2 ms) until a flag is set; the dependent
    sets the flag before its ``griddepcontrol.wait``. Launched as a dependent
    on the default stream (the launcher's path), the primary sees the flag.
    Negative control: launched plainly, the dependent cannot start before the
    primary ends, so the primary must time out (the check can fail)."""
    from numba import cuda

    from attention.core import pdl as P

    if not P.capable():
        pytest.skip("needs compute capability >= 9.0 and a cuda.core LaunchConfig with "
                    "programmatic_stream_serialization")
    release, wait = P.grid_dependency_ops(True)

    @cuda.jit
    def primary(flag, seen, spins):
        release()
        if cuda.threadIdx.x == 0:
            n = 0
            while n < spins and cuda.atomic.add(flag, 0, 0) == 0:
                cuda.nanosleep(1000)
                n += 1
            seen[0] = cuda.atomic.add(flag, 0, 0)

    @cuda.jit
    def dependent(flag):
        if cuda.threadIdx.x == 0:
            cuda.atomic.exch(flag, 0, 1)
        wait()

    def handshake(as_dependent, stream):
        flag = cuda.to_device(np.zeros(1, np.int32))
        seen = cuda.to_device(np.full(1, -1, np.int32))
        cuda.synchronize()
        primary[1, 32, stream](flag, seen, np.int32(2000))
        if as_dependent:
            P.launch_dependent(dependent, 1, 32, stream, (flag,))
        else:
            dependent[1, 32, stream](flag)
        cuda.synchronize()
        return int(seen.copy_to_host()[0])

    plain = handshake(False, 0)
    overlapped = handshake(True, 0)
    other = handshake(True, cuda.stream())
    assert plain == 0, f"negative control: a plain launch overlapped its predecessor ({plain})"
    assert overlapped == 1, (f"the dependent did not start while its primary ran on the "
                             f"default stream (on a created stream: {other})")


@pytest.mark.gpu
def test_gpu_pdl_combine():
    """sm_90 and later: the default plan launches the combine as a programmatic
    dependent of the main kernel; its output has the same bits as the plain
    launch's and matches the oracle."""
    from numba import cuda

    from attention.decode import fast as F
    from attention.core import pdl as P

    if not P.capable():
        pytest.skip("needs compute capability >= 9.0 and a cuda.core LaunchConfig with "
                    "programmatic_stream_serialization")
    m, h, kv, d, s = 1, 32, 8, 128, 16384
    q, k, v, lens, slots = make_case(21, m, h, kv, d, s, np.float16, lens=[s])
    check_against_oracle(q, k, v, lens, slots)  # the public launcher, PDL by default
    d_q, d_k, d_v = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
    d_lens, d_slots = cuda.to_device(lens), cuda.to_device(slots)
    scale = 1.0 / np.sqrt(d)
    outs = {}
    for pdl in (True, False):
        pl = F.plan(m, h, kv, d, s, "f16", pdl=pdl)
        assert pl["pdl"] == pdl and pl["n_split"] > 1
        out, lse = cuda.device_array((m, h, d), np.float32), cuda.device_array((m, h), np.float32)
        pa, pm = F.scratch(m, h, d, pl["n_split"])
        F.launch(pl, d_q, d_k, d_v, d_lens, d_slots, scale, out, lse, pa, pm, 0)
        outs[pdl] = (out.copy_to_host(), lse.copy_to_host())
    assert np.array_equal(outs[True][0], outs[False][0])
    assert np.array_equal(outs[True][1], outs[False][1])


@pytest.mark.gpu
def test_gpu_bf16_small():
    """bf16 has no simulator: the small awkward shapes run on the GPU only."""
    if BF16 is None:
        pytest.skip("ml_dtypes not installed")
    for seed, m, h, kv, d, s, _, ns in SMALL_CASES:
        q, k, v, lens, slots = make_case(seed, m, h, kv, d, s, BF16)
        check_against_oracle(q, k, v, lens, slots, n_split=ns)


@pytest.mark.skipif(not SIMULATOR, reason="says why bf16 is absent from the simulator run")
def test_bf16_not_on_simulator():
    pytest.skip("the CUDA simulator has no bfloat16: bf16 runs on the GPU "
                "(test_gpu_bf16_small, test_gpu_full_shape) and compiles in test_compile_ptx")


# ---- compile-only -----------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("kind,head_dim,want", [
    ("f32", 128, "ld.global.v4.f32"),
    ("f16", 128, "cp.async.cg.shared.global"),  # 16-byte pieces into the ring
    ("bf16", 128, "cp.async.cg.shared.global"),
    ("f32", 40, "ld.global.f32"),
])
@pytest.mark.parametrize("q_kind", ["f32", "cache"])
def test_compile_ptx(kind, head_dim, want, q_kind):
    """Each dtype's default kernel (lanes per row, the 16-bit pipeline)
    compiles for sm_90, for q in fp32 and in the cache's dtype, with the
    vector loads it was built for (16-byte loads for every dtype at D 128,
    q's included) and its state in registers."""
    import re

    from numba import cuda, types

    from attention.decode import fast as F

    elem = {"f32": types.float32, "f16": types.float16, "bf16": cuda.types.bfloat16}[kind]
    q_elem = types.float32 if q_kind == "f32" else elem
    pl = F.plan(2, 8, 2, head_dim, 1024, kind)  # the default kernel for this dtype
    assert pl["pipeline"] == (kind != "f32" and head_dim == 128)
    kern = pl["kernel"]
    # GQA 4, 16 lanes a row, 4 positions a step: one score a lane; rows by the ring
    assert kern.py_func.__name__.endswith(f"psa{F.ASYNC_STAGES}") == pl["pipeline"]
    cache = types.Array(elem, 4, "C")
    f32 = types.float32
    sig = (types.Array(q_elem, 3, "C"), cache, cache, types.int32[::1], types.int32[::1], f32,
           types.int32, types.Array(f32, 3, "C"), types.Array(f32, 2, "C"),
           types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.int32[::1])
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), fastmath=True)
    assert want in ptx
    assert_accurate_epilogue(ptx)  # the one-split epilogue
    assert "ld.local" not in ptx, "per-lane state spilled to local memory"
    # the group size is a constant of the kernel: a block finds its heads with
    # no integer division (each one a ~70-instruction routine on the GPU)
    assert not re.search(r"\b(div|rem)\.[su]\d+", ptx), "runtime integer division"
    if head_dim == 128:  # q in vector loads too (fp32: 16 bytes), none element-wise
        assert not re.search(r"ld\.global(\.nc)?\.(f32|[bu]16)\b", ptx), \
            "q loaded element by element"
    if pl["pipeline"]:  # a lane waits for its own copies, then reads them back
        assert f"cp.async.wait_group {F.ASYNC_STAGES - 2};" in ptx
        assert "ld.shared.v4.u32" in ptx and "bar.sync" not in ptx.split("wait_group")[0]


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [128, 40])
def test_compile_combine_ptx(head_dim):
    """The split-KV combine compiles for sm_90 with its batch of partials in
    registers (no local memory), so a warp's loads of a batch are all in flight."""
    from numba import cuda, types

    from attention.decode import fast as F

    kern = F.combine_kernel(-(-head_dim // F.WARP))
    f32 = types.float32
    sig = (types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.Array(f32, 3, "C"),
           types.Array(f32, 2, "C"))
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), fastmath=True)
    assert ".local" not in ptx, "the combine's batch of partials spilled to local memory"
    assert "bar.sync" in ptx
    assert_accurate_epilogue(ptx)


@pytest.mark.device
def test_combine_column_slices_give_the_same_bits():
    """The combine over column slices (a third grid axis, ``mla.mma.combine_slices``)
    writes the bits of the whole-row combine: D 96 (3 chunks) as 3 slices of one
    chunk, 20 splits (3 warps), one split empty; rows past D untouched."""
    from attention.core.device import to_device
    from attention.decode import fast as F

    rng = np.random.default_rng(3)
    m, h, ns, d = 2, 3, 20, 96
    acc = rng.standard_normal((m, h, ns, d)).astype(np.float32)
    ml = np.stack([rng.standard_normal((m, h, ns)) * 3, rng.uniform(0.5, 4, (m, h, ns))],
                  -1).astype(np.float32)
    ml[0, 1, 4] = (-np.inf, 0.0)  # an empty split drops out
    outs = []
    for chunks, grid in ((3, (h, m)), (1, (h, m, 3))):
        out = to_device(np.full((m, h, d), 9.0, np.float32))
        lse = to_device(np.full((m, h), 9.0, np.float32))
        F.combine_kernel(chunks)[grid, F.combine_warps(ns) * F.WARP, 0](
            to_device(acc), to_device(ml), out, lse)
        outs.append((out.copy_to_host(), lse.copy_to_host()))
    (o_row, l_row), (o_sl, l_sl) = outs
    np.testing.assert_array_equal(o_sl, o_row)
    np.testing.assert_array_equal(l_sl, l_row)
    assert np.isfinite(o_row).all() and (o_row != 9.0).all() and (l_row != 9.0).all()


def assert_accurate_epilogue(ptx):
    """The epilogue's 1 / l and log l are the accurate ones
    (``attention.core.warp.softmax_finish``), not fast-math's ``div.approx`` /
    ``lg2.approx``, which cost every output of a head an ulp or two."""
    assert "rcp.rn" in ptx, "the reciprocal 1 / l is not correctly rounded"
    assert "div.approx" not in ptx and "div.full" not in ptx, "approximate division"
    assert "lg2.approx" not in ptx, "the LSE takes fast-math's lg2.approx"


@pytest.mark.compile
def test_compile_pdl_ptx():
    """With ``pdl`` the main kernel releases its dependents
    (``griddepcontrol.launch_dependents``) and the combine waits for the main
    grid (``griddepcontrol.wait``) before its first load; without it neither
    instruction is emitted (older GPUs)."""
    import re

    from numba import cuda, types

    from attention.decode import fast as F

    f32 = types.float32
    cache = types.Array(types.float16, 4, "C")
    sig = (types.Array(f32, 3, "C"), cache, cache, types.int32[::1], types.int32[::1], f32,
           types.int32, types.Array(f32, 3, "C"), types.Array(f32, 2, "C"),
           types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.int32[::1])
    csig = (types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.Array(f32, 3, "C"),
            types.Array(f32, 2, "C"))
    for pdl in (False, True):
        pl = F.plan(1, 32, 8, 128, 32768, "f16", pdl=pdl)
        ptx, _ = cuda.compile_ptx(pl["kernel"].py_func, sig, cc=(9, 0), fastmath=True)
        assert ptx.count("griddepcontrol.launch_dependents;") == int(pdl)
        assert "griddepcontrol.wait" not in ptx
        cptx, _ = cuda.compile_ptx(F.combine_kernel(4, pdl).py_func, csig, cc=(9, 0),
                                   fastmath=True)
        assert cptx.count("griddepcontrol.wait;") == int(pdl)
        if pdl:  # the wait comes before every global load of the combine
            body = cptx.split("griddepcontrol.wait;")
            assert not re.search(r"ld\.global", body[0]), "a partial read before the wait"
            assert re.search(r"ld\.global", body[1])


def test_launch_rejects_a_plan_of_another_group():
    """A plan's kernel has the group size H // H_kv built in: launching it on
    arrays of another group is an error naming q, before anything is launched."""
    from attention.decode import fast as F
    from attention.core.checks import ShapeError

    pl = F.plan(2, 8, 2, 128, 64, "f32")  # group 4
    q = np.zeros((2, 4, 128), np.float32)  # group 2 with the same cache
    k = np.zeros((2, 2, 64, 128), np.float32)
    with pytest.raises(ShapeError, match=r"q: expected H = 4 \* H_kv = 8"):
        F.launch(pl, q, k, k, None, None, 1.0, None, None, None, None, 0)


class _DeviceStub:
    """A stand-in device array: shape, dtype and ``__cuda_array_interface__``
    at a given address (nothing is ever read through it)."""

    def __init__(self, shape, dtype, addr):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": self.dtype.str,
                                         "data": (addr, False), "strides": None,
                                         "version": 3}


def test_misaligned_device_arrays_are_refused():
    """q and the caches are read in 16-byte vector loads at D 128: a device
    view that does not start on 16 bytes is an error naming it (before any
    launch); an aligned one passes the check, and so does a misaligned one
    where rows are read element-wise (D 40)."""
    from attention.decode import fast as F
    from attention.core.checks import LayoutError

    k = np.zeros((2, 2, 64, 128), np.float32)
    lens = np.array([3, 5])
    q_bad = _DeviceStub((2, 8, 128), np.float32, 0x10004)
    with pytest.raises(LayoutError, match="q: expected a device address aligned to 16"):
        F.check_fast(q_bad, k, k, lens, None)
    with pytest.raises(LayoutError, match="v_cache: expected a device address aligned"):
        F.check_fast(np.zeros((2, 8, 128), np.float32), k, _DeviceStub(k.shape, k.dtype, 0x208),
                     lens, None)
    assert F.check_fast(_DeviceStub((2, 8, 128), np.float32, 0x10010), k, k, lens, None)[0] == 2
    k40 = np.zeros((2, 2, 64, 40), np.float32)
    assert F.check_fast(_DeviceStub((2, 8, 40), np.float32, 0x10004), k40, k40, lens, None)


def test_split_count_fills_waves():
    """The default split count: the fewest waves filled to WAVE_FILL, the most
    splits in them; never chunks under MIN_CHUNK; a zero-length batch still
    gets one split."""
    from attention.decode import fast as F

    wave = F.RESIDENT_BLOCKS[False] * F.N_SMS
    assert F.split_count(8, 32768) == wave // 8  # B 1, H_kv 8: one wave
    assert F.split_count(256, 4096) == (2 * wave) // 256  # B 32: 0.65 of a wave at 1
    assert F.split_count(8, 1000) == -(-1000 // F.MIN_CHUNK)  # too short to fill a wave
    assert F.split_count(256, 100) == 1 and F.split_count(3, 0) == 1
    # two blocks a SM (the pipelined 16-bit kernel): B 32 fills one wave unsplit
    assert F.split_count(256, 4096, resident=2) == 1
    assert F.split_count(8, 32768, resident=2) == 2 * F.N_SMS // 8
    for resident in (2, 3):
        wave = resident * F.N_SMS
        for pairs, max_len in [(8, 32768), (256, 1024), (512, 4096), (400, 1 << 20),
                               (4000, 4096)]:
            n = F.split_count(pairs, max_len, resident)
            blocks = pairs * n
            most = -(-max_len // F.MIN_CHUNK)
            assert 1 <= n <= most
            assert blocks >= F.WAVE_FILL * (-(-blocks // wave) * wave) or n == most


def test_plan_trims_empty_splits():
    """A default split count is lowered to the chunks that hold a position
    (chunks are rounded up to whole steps, which can leave the last splits
    empty); an explicit count is kept as given."""
    from attention.decode import fast as F

    for m, max_len in [(1, 32768), (1, 1000), (2, 4500), (4, 16384), (32, 1024)]:
        pl = F.plan(m, 32, 8, 128, max_len, "f16")
        assert (pl["n_split"] - 1) * pl["chunk"] < max_len <= pl["n_split"] * pl["chunk"]
    pl = F.plan(1, 32, 8, 128, 32768, "f16")
    wave = F.RESIDENT_BLOCKS[True] * F.N_SMS
    assert F.split_count(8, 32768, F.RESIDENT_BLOCKS[True]) == wave // 8 == 33
    assert pl["n_split"] == 32 and pl["chunk"] == 1024  # 33 chunks of 993 -> 1024
    assert F.plan(1, 32, 8, 128, 32768, "f16", n_split=40)["n_split"] == 40


def test_pdl_off_without_sm90():
    """Programmatic dependent launch is chosen only on a GPU that has it: the
    simulator and compile-only runs plan plain launches, and their kernels get
    empty stand-ins for the ``griddepcontrol`` instructions."""
    from attention.decode import fast as F
    from attention.core import pdl as P

    if MODE in ("sim", "cpu"):
        assert not P.capable()
        assert F.plan(1, 32, 8, 128, 32768, "f16")["pdl"] is False
    release, wait = P.grid_dependency_ops(False)
    assert release is wait  # one empty device function for both
    # a dependent launch takes device arrays only (nothing can be copied back)
    with pytest.raises(TypeError, match="argument 1 is a host array"):
        P.launch_dependent(F.combine_kernel(4, True), (1, 1), 32, 0,
                           (None, np.zeros((1, 1, 2, 128), np.float32), None, None))


# ---- bad input: named errors before any launch --------------------------------

def test_bad_input_raises_named_errors():
    from attention.decode.fast import batched_decode_attention_fast as f

    q = np.zeros((2, 4, 32), np.float32)
    k = np.zeros((2, 2, 8, 32), np.float32)
    lens = np.array([3, 4], np.int32)
    with pytest.raises(checks.ShapeError):
        f(q, k, np.zeros((2, 2, 8, 31), np.float32), lens)
    with pytest.raises(checks.DTypeError):
        f(q, k.astype(np.float64), k.astype(np.float64), lens)
    with pytest.raises(checks.DTypeError):
        f(q, k, k.astype(np.float16), lens)
    with pytest.raises(checks.DTypeError):
        f(q.astype(np.float16), k, k, lens)  # fp16 q needs an fp16 cache
    with pytest.raises(checks.RangeError):
        f(q, k, k, np.array([3, 9], np.int32))
    with pytest.raises(checks.RangeError):
        f(q, k, k, lens, np.array([0, 2], np.int32))
    with pytest.raises(checks.RangeError):
        f(np.zeros((2, 3, 32), np.float32), k, k, lens)
    with pytest.raises(checks.LayoutError):
        f(q, np.zeros((2, 2, 32, 8), np.float32).transpose(0, 1, 3, 2), k, lens)
