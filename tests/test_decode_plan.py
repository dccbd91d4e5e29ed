"""DecodePlan (attention.decode.plan) and the one-call decode (attention.decode.api).

* ``run`` against the float64 oracle under the project's rule
  (``validation.tolerance``: error <= 2 x the same-precision baseline's + a
  floor), for float32, float16 and bfloat16 caches, on NaN-poisoned pools;
* ``run`` makes no host-device copy, allocation or synchronisation: every entry
  point for those is patched to raise, and the old one-call path is shown to
  hit them (positive control);
* the device range check: a bad length or slot is attended as empty (the
  simulator raises on any out-of-bounds index: nothing is read past the cache),
  the caches are untouched, and ``check()`` raises ``RangeError`` naming the
  argument, the sequence, its value and the valid range;
* ``decode`` fills numpy ``out=`` / ``lse=``;
* host-side checks and error messages (plain process, no kernel);
* the main kernel, with its range check, still compiles without local memory
  (compile-only).

Kernel-executing tests are marked ``device``: they run in the simulator
process and on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from attention.core.device import SIMULATOR
from attention.oracle import decode_attention_ref
from tests.test_decode_fast import make_case

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None


def expect(q, k, v, lens, slots):
    """(float64 oracle, same-precision baseline) as the sweep judges ``decode_fast``."""
    from validation import baselines
    from validation.registry import KERNELS_BY_NAME

    ref = decode_attention_ref(q, k, v, lens, slots)
    label = baselines.resolve(KERNELS_BY_NAME["decode_fast"].baseline, {"q": q},
                              np.asarray(k).dtype)
    return ref, baselines.decode_order(q, k, v, lens, slots, label)


def make_plan(q, k, **kw):
    from attention.decode.plan import DecodePlan

    m, h, d = q.shape
    slots, kv, s, _ = k.shape
    return DecodePlan(m, h, kv, d, slots, s, cache_dtype=k.dtype, q_dtype=q.dtype, **kw)


def staged(*arrays):
    from numba import cuda

    return [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]


def _to_device_cache(k):
    """numba device copy of a cache (bfloat16 through a uint16 view)."""
    from attention.core.device import to_device

    return to_device(k)


CASES = [
    # (seed, M, H, H_kv, D, max_seq, dtype, n_split)
    (21, 3, 4, 2, 32, 21, np.float32, None),  # GQA 2, fp32 rows over 32 lanes
    (22, 3, 8, 2, 64, 45, np.float16, 2),     # GQA 4, 16-bit pipeline, split + combine
    (23, 2, 4, 2, 64, 30, "bf16", None),      # bfloat16 cache (GPU only)
]


@pytest.mark.device
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c[0]}")
def test_run_matches_oracle(case):
    """``run`` on device arrays equals the float64 oracle within the project's
    rule, output and LSE; empty sequences give zeros and -inf; the plan's own
    buffers are returned when no ``out`` is given."""
    seed, m, h, kv, d, s, dt, ns = case
    if dt == "bf16":
        if SIMULATOR:
            pytest.skip("the simulator has no bfloat16; runs on a GPU")
        dt = BF16
    q, k, v, lens, slots = make_case(seed, m, h, kv, d, s, dt)
    pl = make_plan(q, k, n_split=ns)
    if ns:
        assert pl.n_split == ns
    d_q, d_lens, d_slots = staged(q, lens, slots)
    d_k, d_v = _to_device_cache(k), _to_device_cache(v)
    out = pl.run(d_q, d_k, d_v, d_lens, d_slots, sync=True)
    assert out is pl.out
    got, got_lse = pl.out.copy_to_host(), pl.lse.copy_to_host()
    from validation.tolerance import assert_matches

    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots)
    assert not np.isnan(got).any()
    assert_matches(got, ref, base)
    assert_matches(got_lse, ref_lse, base_lse, what="lse")
    empty = lens == 0
    assert np.all(got[empty] == 0) and np.all(np.isneginf(got_lse[empty]))
    # given buffers are written instead, and the identity slot table is the default
    d_out, d_lse = staged(np.zeros((m, h, d), np.float32), np.zeros((m, h), np.float32))
    ident = np.arange(m, dtype=np.int32)
    pl.run(d_q, d_k, d_v, d_lens, None, out=d_out, lse=d_lse, sync=True)
    (ref2, _), (base2, _) = expect(q, k, v, lens, ident)
    got2 = d_out.copy_to_host()
    finite = np.isfinite(ref2).all(axis=(1, 2))  # slots 0..M-1 may hold NaN past lengths
    assert_matches(got2[finite], ref2[finite], base2[finite])


def _value(x):
    return x.value if hasattr(x, "value") else x


@pytest.mark.device
def test_argument_template_matches_numba_packing():
    """The prebuilt argument lists, once ``run`` has written the pointers, equal
    what numba's dispatcher packs for the same arrays (main kernel and combine)."""
    if SIMULATOR:
        pytest.skip("the simulator launches through numba: no argument lists")
    import numba

    q, k, v, lens, slots = make_case(24, 3, 8, 2, 64, 45, np.float16)
    pl = make_plan(q, k, n_split=2)
    d = staged(q, k, v, lens, slots)
    pl.run(*d, sync=True)
    fp = pl.fast_plan
    lists = [(fp["kernel"], tuple(d) + (np.float32(pl.scale), np.int32(fp["chunk"]), pl.out,
                                         pl.lse, pl.part_acc, pl.part_ml, pl.flag),
              pl._main_args)]
    from attention.decode import fast

    combine = fast.combine_kernel(-(-64 // fast.WARP), fp["pdl"], fp["defect"])
    lists.append((combine, (pl.part_acc, pl.part_ml, pl.out, pl.lse), pl._combine_args))
    for kernel, args, built in lists:
        compiled = kernel.compile(tuple(numba.typeof(a) for a in args))
        retr, packed = [], []
        for ty, val in zip(compiled.argument_types, args):
            compiled._prepare_args(ty, val, 0, retr, packed)
        assert [_value(a) for a in packed] == [_value(b) for b in built]


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_run_with_torch_tensors(dtype):
    """torch CUDA tensors (bfloat16 included, which numba itself refuses) on a
    torch stream; the result is a torch view of the plan's buffer."""
    if SIMULATOR:
        pytest.skip("torch CUDA tensors need a GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    np_dt = np.float16 if dtype == "float16" else BF16
    q, k, v, lens, slots = make_case(25, 3, 8, 2, 128, 60, np_dt)
    q = q.astype(np_dt)
    tdt = getattr(torch, dtype)

    def tt(a):
        if a.dtype == np.dtype(BF16):
            return torch.as_tensor(a.view(np.int16), device="cuda").view(tdt)
        return torch.as_tensor(a, device="cuda")

    pl = make_plan(q, k, n_split=2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        args = [tt(a) for a in (q, k, v, lens, slots)]
    stream.synchronize()
    out = pl.run(*args, stream=stream)
    stream.synchronize()
    pl.check()
    assert isinstance(out, torch.Tensor)
    from validation.tolerance import assert_matches

    (ref, _), (base, _) = expect(q.astype(np.float32), k, v, lens, slots)
    assert_matches(out.cpu().numpy(), ref, base)


# ---- no host copy, allocation or synchronisation ----------------------------

@pytest.fixture
def plan_case():
    """A split plan (fp16, GQA 4, 2 splits: main kernel + combine) and its
    device arrays, made before the patches of ``no_host_traffic`` apply."""
    q, k, v, lens, slots = make_case(31, 3, 8, 2, 64, 40, np.float16)
    return make_plan(q, k, n_split=2), staged(q, k, v, lens, slots)


@pytest.mark.device
def test_run_makes_no_copy_or_sync(plan_case, no_host_traffic):
    """With every copy / allocation / synchronisation entry point patched to
    raise, ``run`` still enqueues: plan buffers, given buffers, default slot
    table, explicit default stream."""
    pl, (d_q, d_k, d_v, d_lens, d_slots) = plan_case
    out = pl.run(d_q, d_k, d_v, d_lens, d_slots)
    pl.run(d_q, d_k, d_v, d_lens, None, out=out, lse=pl.lse, stream=0)
    assert no_host_traffic == []


@pytest.fixture
def old_path_inputs():
    q, k, v, lens, slots = make_case(32, 2, 4, 2, 32, 20, np.float32)
    return staged(q, k, v, lens, slots)


@pytest.mark.device
def test_positive_control_old_path_copies(old_path_inputs, no_host_traffic):
    """The patches fire: the old one-call function copies the lengths to the
    host (``host_ints``) on every call, and is stopped by them."""
    from attention.decode.fast import batched_decode_attention_fast

    with pytest.raises(AssertionError, match="called"):
        batched_decode_attention_fast(*old_path_inputs, stream=0)
    assert no_host_traffic


# ---- the device range check ----------------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("what", ["length", "slot", "negative_length"])
def test_device_range_check(what):
    """A length past the capacity or a slot past KV_SLOTS: that sequence is
    attended as empty (the simulator raises on an out-of-bounds index, so a
    read past the cache would fail the run), the others are correct, the caches
    are unchanged, and ``check()`` raises ``RangeError`` naming the argument,
    the sequence, the value and the valid range, then clears the flag."""
    q, k, v, lens, slots = make_case(41, 3, 4, 2, 32, 24, np.float32)
    lens = np.array([24, 5, 9], np.int32)
    pl = make_plan(q, k)
    bad_lens, bad_slots = lens.copy(), slots.copy()
    if what == "length":
        bad_lens[1] = 24 + 1000  # far past the cache: an unchecked read faults
        match = r"seq_lens: sequence 1 has length 1024, expected a length in \[0, 24\]"
    elif what == "negative_length":
        bad_lens[1] = -3
        match = r"seq_lens: sequence 1 has length -3"
    else:
        bad_slots[1] = k.shape[0] + 7
        match = rf"slot_table: sequence 1 has slot {k.shape[0] + 7}, expected a slot in " \
                rf"\[0, KV_SLOTS={k.shape[0]}\)"
    d_q, d_k, d_v, d_lens, d_slots = staged(q, k, v, bad_lens, bad_slots)
    pl.run(d_q, d_k, d_v, d_lens, d_slots)
    with pytest.raises(checks.RangeError, match=match):
        pl.check()
    pl.check()  # cleared
    got, got_lse = pl.out.copy_to_host(), pl.lse.copy_to_host()
    assert np.all(got[1] == 0) and np.all(np.isneginf(got_lse[1]))
    np.testing.assert_array_equal(d_k.copy_to_host(), k)
    np.testing.assert_array_equal(d_v.copy_to_host(), v)
    keep = np.array([0, 2])
    (ref, _), (base, _) = expect(q[keep], k, v, lens[keep], slots[keep])
    from validation.tolerance import assert_matches

    assert_matches(got[keep], ref, base)


@pytest.mark.device
def test_range_check_covers_the_plans_splits():
    """A plan made for ``max_len`` below the capacity covers ``limit`` positions:
    a longer length is flagged (not silently cut), naming the limit."""
    q, k, v, lens, slots = make_case(42, 2, 4, 2, 32, 200, np.float32)
    pl = make_plan(q, k, max_len=8, n_split=1)
    assert 8 <= pl.limit < 200
    lens = np.array([pl.limit + 1, 3], np.int32)
    pl.run(*staged(q, k, v, lens, slots))
    with pytest.raises(checks.RangeError, match=rf"sequence 0 .* \[0, {pl.limit}\]"):
        pl.check()


@pytest.mark.device
def test_sync_option_raises():
    q, k, v, lens, slots = make_case(43, 2, 4, 2, 32, 12, np.float32)
    pl = make_plan(q, k)
    with pytest.raises(checks.RangeError, match="slot_table: sequence 0"):
        pl.run(*staged(q, k, v, lens, np.array([-1, 1], np.int32)), sync=True)


# ---- the one-call decode ---------------------------------------------------------

@pytest.mark.device
def test_decode_fills_numpy_out_and_lse():
    from attention import decode

    q, k, v, lens, slots = make_case(51, 3, 4, 2, 32, 16, np.float32)
    out = np.full(q.shape, 7.0, np.float32)
    lse = np.full(q.shape[:2], 7.0, np.float32)
    res, res_lse = decode(q, k, v, lens, slots, out=out, lse=lse, return_lse=True)
    assert res is out and res_lse is lse
    from validation.tolerance import assert_matches

    (ref, ref_lse), (base, base_lse) = expect(q, k, v, lens, slots)
    assert_matches(out, ref, base)
    assert_matches(lse, ref_lse, base_lse, what="lse")
    again = decode(q, k, v, lens, slots)  # the cached plan, a fresh numpy result
    assert isinstance(again, np.ndarray) and np.array_equal(again, out)


@pytest.mark.device
def test_decode_device_inputs_checked_on_device():
    from attention import decode

    q, k, v, lens, slots = make_case(52, 2, 4, 2, 32, 16, np.float32)
    with pytest.raises(checks.RangeError, match="seq_lens: sequence 1 has length 99"):
        decode(*staged(q, k, v, np.array([3, 99], np.int32), slots))
    d_out = decode(*staged(q, k, v, lens, slots))
    assert not isinstance(d_out, np.ndarray)


def test_decode_checks_numpy_lengths_on_the_host():
    """numpy lengths and slots are checked before anything is staged."""
    from attention import decode

    q = np.zeros((2, 4, 32), np.float32)
    k = np.zeros((2, 2, 8, 32), np.float32)
    with pytest.raises(checks.RangeError, match="seq_lens"):
        decode(q, k, k, np.array([3, 9], np.int32))
    with pytest.raises(checks.RangeError, match="slot_table"):
        decode(q, k, k, np.array([3, 4], np.int32), np.array([0, 2], np.int32))
    with pytest.raises(checks.DTypeError, match="seq_lens: expected an integer array"):
        decode(q, k, k, None)


# ---- host-side checks of run (no kernel) -------------------------------------------

class _Device:
    """A stand-in device array (``__cuda_array_interface__``; never read)."""

    def __init__(self, shape, typestr, addr=0x10000, strides=None):
        self.shape = tuple(shape)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": typestr,
                                         "data": (addr, False), "strides": strides,
                                         "version": 3}


def _stub_args(**over):
    args = {"q": _Device((2, 8, 128), "<f2"), "k_cache": _Device((3, 2, 64, 128), "<f2"),
            "v_cache": _Device((3, 2, 64, 128), "<f2"), "seq_lens": _Device((2,), "<i4"),
            "slot_table": _Device((2,), "<i4")}
    args.update(over)
    return args


@pytest.mark.skipif(SIMULATOR, reason="stand-in device arrays are for the GPU / no-GPU checks")
@pytest.mark.parametrize("over,error,match", [
    ({"q": _Device((2, 8, 64), "<f2")}, checks.ShapeError,
     r"q: expected shape \[M=2, H=8, D=128\] \(the plan's\), got \(2, 8, 64\)"),
    ({"k_cache": _Device((3, 2, 64, 128), "<f4")}, checks.DTypeError,
     "k_cache: expected dtype float16"),
    ({"v_cache": _Device((3, 2, 64, 128), "<f2", addr=0x10008)}, checks.LayoutError,
     "v_cache: expected a device address aligned to 16"),
    ({"seq_lens": _Device((2,), "<i8")}, checks.DTypeError, "seq_lens: expected dtype int32"),
    ({"slot_table": _Device((3,), "<i4")}, checks.ShapeError, "slot_table: expected shape"),
    ({"q": _Device((2, 8, 128), "<f2", strides=(4096, 256, 4))}, checks.LayoutError,
     "q: expected a C-contiguous"),
    ({"q": np.zeros((2, 8, 128), np.float16)}, checks.LayoutError,
     "q: expected a device array, got a numpy array"),
    ({"q": [1, 2]}, checks.DTypeError, "q: expected a device array"),
])
def test_run_rejects_bad_arrays_before_launch(over, error, match):
    """Cheap host checks against the plan, named errors, before any launch."""
    from attention.decode.plan import DecodePlan

    pl = DecodePlan(2, 8, 2, 128, 3, 64, cache_dtype="float16")
    a = _stub_args(**over)
    with pytest.raises(error, match=match):
        pl.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["slot_table"])


@pytest.mark.skipif(SIMULATOR, reason="stand-in device arrays are for the GPU / no-GPU checks")
def test_bfloat16_void_typestr_is_read_as_bfloat16():
    """torch exports bfloat16 as a 2-byte void (``|V2``): read as bfloat16 where
    the plan expects it, refused with a DTypeError naming it elsewhere."""
    from attention.decode.plan import DecodePlan, _Spec, pointer

    spec = _Spec("k_cache", (3, 2, 64, 128), np.dtype(BF16), 16, "ABCD")
    assert pointer(spec, _Device((3, 2, 64, 128), "|V2")) == 0x10000
    pl = DecodePlan(2, 8, 2, 128, 3, 64, cache_dtype="float16")
    a = _stub_args(k_cache=_Device((3, 2, 64, 128), "|V2"))
    with pytest.raises(checks.DTypeError, match="k_cache: expected dtype float16.*bfloat16"):
        pl.run(*a.values())


@pytest.mark.parametrize("kw,error,match", [
    ({"n_heads": 0}, checks.RangeError, "n_heads: expected at least one query head"),
    ({"n_kv_heads": 0}, checks.RangeError, "n_kv_heads: expected at least one kv head"),
    ({"n_kv_heads": 3}, checks.RangeError, "n_kv_heads: H_kv=3 must divide"),
    ({"head_dim": 300}, checks.RangeError, r"head_dim: expected head_dim in \[1, 256\]"),
    ({"kv_slots": 1}, checks.RangeError, "kv_slots: expected KV_SLOTS >= m=2"),
    ({"cache_dtype": "float64"}, checks.DTypeError, "cache_dtype: expected float32"),
    ({"q_dtype": "float16", "cache_dtype": "float32"}, checks.DTypeError, "q_dtype"),
    ({"max_len": 65}, checks.RangeError, "max_len"),
    ({"n_split": 0}, checks.RangeError, "n_split"),
])
def test_plan_arguments_named(kw, error, match):
    from attention.decode.plan import DecodePlan

    args = {"m": 2, "n_heads": 8, "n_kv_heads": 2, "head_dim": 128, "kv_slots": 3,
            "max_seq": 64}
    args.update(kw)
    geometry = {k: args.pop(k) for k in ("m", "n_heads", "n_kv_heads", "head_dim",
                                         "kv_slots", "max_seq")}
    with pytest.raises(error, match=match):
        DecodePlan(*geometry.values(), **args)


def test_launch_path_recorded():
    from attention.core.device import gpu_available
    from attention.decode.plan import DecodePlan

    pl = DecodePlan(2, 8, 2, 128, 3, 64, cache_dtype="float16")
    want = "numba" if SIMULATOR else ("cuda.core" if gpu_available() else "none")
    assert pl.launch_path == want and pl.launch_reason


# ---- error messages that name the right argument (one-call path) --------------------

def test_message_q_head_dim_names_q():
    from attention.decode.fast import batched_decode_attention_fast as f

    k = np.zeros((2, 2, 8, 32), np.float32)
    with pytest.raises(checks.ShapeError, match=r"q: expected head_dim D=32 \(k_cache's\), "
                                                r"got D=64"):
        f(np.zeros((2, 4, 64), np.float32), k, k, np.array([3, 4], np.int32))


def test_message_missing_seq_lens_is_not_a_shape():
    from attention.decode.fast import batched_decode_attention_fast as f

    q, k = np.zeros((2, 4, 32), np.float32), np.zeros((2, 2, 8, 32), np.float32)
    with pytest.raises(checks.DTypeError, match=r"seq_lens: expected an integer array of "
                                                r"shape \[M=2\], got None"):
        f(q, k, k, None)


def test_message_zero_query_heads_names_q():
    from attention.decode.fast import batched_decode_attention_fast as f

    k = np.zeros((2, 2, 8, 32), np.float32)
    with pytest.raises(checks.RangeError, match="q: expected at least one query head, got H=0"):
        f(np.zeros((2, 0, 32), np.float32), k, k, np.array([3, 4], np.int32))
    with pytest.raises(checks.RangeError, match="n_heads: expected at least one query head"):
        checks.check_heads(0, 2, q_name="n_heads", kv_name="n_kv_heads")


# ---- compile-only ------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_checked_kernel_compiles_without_spills(kind):
    """The main kernel with its device range check compiles for sm_90 with no
    local memory, the check's atomics (count, first sequence) in it, and no
    runtime integer division."""
    import re

    from numba import cuda, types

    from attention.decode import fast as F

    elem = {"f32": types.float32, "f16": types.float16, "bf16": cuda.types.bfloat16}[kind]
    cache = types.Array(elem, 4, "C")
    f32 = types.float32
    sig = (types.Array(f32, 3, "C"), cache, cache, types.int32[::1], types.int32[::1], f32,
           types.int32, types.Array(f32, 3, "C"), types.Array(f32, 2, "C"),
           types.Array(f32, 4, "C"), types.Array(f32, 4, "C"), types.int32[::1])
    pl = F.plan(32, 32, 8, 128, 4096, kind)
    ptx, _ = cuda.compile_ptx(pl["kernel"].py_func, sig, cc=(9, 0), fastmath=True)
    assert ".local" not in ptx and "ld.local" not in ptx, "spilled to local memory"
    assert "atom.global.min.s32" in ptx and re.search(r"atom\.global\.add\.[su]32", ptx)
    assert not re.search(r"\b(div|rem)\.[su]\d+", ptx), "runtime integer division"
