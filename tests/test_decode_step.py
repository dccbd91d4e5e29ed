"""The decode state and its step (attention.decode.step.DecodeState), eager and graph.

Each step is checked against a host model: a numpy mirror of what the scatter
should have written (the whole cache compared bit for bit, NaN fill included)
and the float64 oracle over the mirror, under the validation rule
(``validation.tolerance``) with the float32 baseline in the kernel's own order
(``validation.baselines``, as the growth runs judge). Both modes run on every
machine: on the simulator a graph state runs eager (recorded), on a GPU it
replays a captured graph. bfloat16 needs a GPU (the simulator has none).
Capacity overflow raises through the device flag; finished sequences are
neither read nor written; every planted defect changes what a step does.
Fallback warnings: tests/test_fallbacks.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
import attention.reference.decode_step  # noqa: F401  (registers the reference kernels)
from tests.conftest import MODE, storage_dtype

DTYPES = ["float32", "float16", "bfloat16"]
MODES = ["eager", "graph"]



def _dtype(name):
    return storage_dtype(name)


def _state(dtype=np.float32, mode="eager", kernel="fast", m=2, h=4, kv=2, d=32, cap=8,
           slots=(2, 0), **kw):
    from attention.decode.step import DecodeState

    return DecodeState(m, h, kv, d, cap, kv_slots=3, slot_table=np.array(slots, np.int32),
                       dtype=dtype, kernel=kernel, mode=mode, fill=np.nan, **kw)


class Mirror:
    """What the caches and lengths of a state should hold (float64 values)."""

    def __init__(self, state, k_pre=None, v_pre=None, lengths=None):
        self.state = state
        self.k = np.full(state.cache_shape, np.nan)
        self.v = np.full(state.cache_shape, np.nan)
        self.lengths = np.zeros(state.m, np.int64)
        if lengths is not None:
            for i, n in enumerate(lengths):
                s = state.slot_table[i]
                self.k[s, :, :n], self.v[s, :, :n] = k_pre[i, :, :n], v_pre[i, :, :n]
            self.lengths = np.array(lengths, np.int64)

    def step(self, k_new, v_new, live):
        for i in np.flatnonzero(live):
            s, p = self.state.slot_table[i], self.lengths[i]
            self.k[s, :, p], self.v[s, :, p] = k_new[i], v_new[i]
            self.lengths[i] += 1

    def judge(self, q, out, lse, live, what):
        from validation import baselines, growth
        from validation.tolerance import assert_matches
        from attention.oracle import decode_attention_ref

        seen = np.where(live, self.lengths, 0)
        slots = self.state.slot_table
        ref = decode_attention_ref(q, self.k, self.v, seen, slots)
        kernel = {"fast": "fast_decode", "warp": "batched_decode", "split": "flash_decode"}[
            self.state.kernel]
        label = growth.baseline_order(kernel, {"q": q}, self.state.dtype)
        base = baselines.decode_order(q, self.k.astype(np.float32), self.v.astype(np.float32),
                                      seen, slots, label)
        assert_matches(out, ref[0], base[0], what=f"out {what}")
        assert_matches(lse, ref[1], base[1], what=f"lse {what}")

    def assert_state(self):
        from attention.core.device import to_host

        for name, dev, want in (("k", self.state.k_cache, self.k),
                                ("v", self.state.v_cache, self.v)):
            got = np.asarray(to_host(dev), np.float64)
            assert np.array_equal(got, want, equal_nan=True), f"{name}_cache differs"
        np.testing.assert_array_equal(self.state.lengths, self.lengths)


def _rows(rng, state, what="kv"):
    shape = (state.m, state.n_kv_heads, state.head_dim)
    return tuple(rng.standard_normal(shape).astype(state.dtype) for _ in what)


# -- steps against the host model -----------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_track_the_host_model(dtype, mode):
    """Prefill 3 / 0 positions, three steps with a finish and a restart between."""
    dt = _dtype(dtype)
    rng = np.random.default_rng(21)
    st = _state(dt, mode)
    if mode == "eager" or MODE == "sim":
        assert st.path == "eager"
    else:
        assert st.path == "graph" and st.graph is not None, st.fallback_reason
    k_pre, v_pre = (rng.standard_normal((2, 2, 3, 32)).astype(dt) for _ in "kv")
    st.prefill(k_pre, v_pre, [3, 0])
    model = Mirror(st, k_pre, v_pre, [3, 0])
    for step in range(3):
        if step == 1:
            st.finish(0)
        if step == 2:
            st.restart(0, length=1)
            model.lengths[0] = 1
        live = ~st.done
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        k_new, v_new = _rows(rng, st)
        out, lse = st.step(q, k_new, v_new, return_lse=True)
        model.step(k_new, v_new, live)
        model.judge(q, out, lse, live, f"step {step}")
        model.assert_state()
        if step == 1:  # the finished sequence: zeros and -inf
            assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    st.check()


@pytest.mark.device
@pytest.mark.parametrize("mode", MODES)
def test_tensor_core_steps_give_the_mma_decode_bits(mode):
    """``DecodeState(method="mma")`` over a float16 cache (q float16): the caches
    the host model's, and each step's output and LSE the bits of
    ``mma_decode`` over them with the state's split count (a finished sequence:
    zeros and -inf)."""
    from attention.core.device import to_host
    from attention.decode import mma

    rng = np.random.default_rng(22)
    st = _state(np.float16, mode, q_dtype=np.float16, method="mma")
    assert st.method == "mma" and st.plan["kind"] == "f16"
    k_pre, v_pre = (rng.standard_normal((2, 2, 3, 32)).astype(np.float16) for _ in "kv")
    st.prefill(k_pre, v_pre, [3, 2])
    model = Mirror(st, k_pre, v_pre, [3, 2])
    for step in range(2):
        if step == 1:
            st.finish(1)
        live = ~st.done
        q = rng.standard_normal((2, 4, 32)).astype(np.float16)
        k_new, v_new = _rows(rng, st)
        out, lse = st.step(q, k_new, v_new, return_lse=True)
        model.step(k_new, v_new, live)
        model.assert_state()
        seen = np.where(live, model.lengths, 0).astype(np.int32)
        want = mma.mma_decode(q, np.asarray(to_host(st.k_cache)), np.asarray(to_host(st.v_cache)),
                              seen, slot_table=np.asarray(st.slot_table, np.int32),
                              n_split=st.n_split)
        for got, w in zip((out, lse), want):
            assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(w).view(np.uint32))
    st.check()


@pytest.mark.device
@pytest.mark.parametrize("kernel", ["warp", "split"])
def test_reference_kernels_step_too(kernel):
    rng = np.random.default_rng(3)
    st = _state(kernel=kernel, mode="graph", split_chunk=3)
    model = Mirror(st)
    for step in range(2):
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        k_new, v_new = _rows(rng, st)
        out, lse = st.step(q, k_new, v_new, return_lse=True)
        model.step(k_new, v_new, np.ones(2, bool))
        model.judge(q, out, lse, np.ones(2, bool), f"{kernel} step {step}")
    model.assert_state()


@pytest.mark.device
@pytest.mark.parametrize("mode", MODES)
def test_device_buffers_filled_by_the_caller(mode):
    """``step()`` with no arguments runs on the buffers as the caller left them
    and returns the device outputs; q may be the cache dtype."""
    from attention.core.device import to_device, to_host

    rng = np.random.default_rng(8)
    st = _state(np.float16, mode, q_dtype=np.float16)
    q = rng.standard_normal((2, 4, 32)).astype(np.float16)
    k_new, v_new = _rows(rng, st)
    st.q.copy_to_device(q)
    st.k_new.copy_to_device(k_new)
    st.v_new.copy_to_device(to_device(v_new))
    d_out = st.step(sync=True)
    assert d_out is st.out
    model = Mirror(st)
    model.step(k_new, v_new, np.ones(2, bool))
    model.judge(q.astype(np.float32), to_host(st.out), to_host(st.lse), np.ones(2, bool),
                "device buffers")
    model.assert_state()
    d_out, d_lse = st.step(to_device(q), return_lse=True)  # device q: device results
    assert d_lse is st.lse
    np.testing.assert_array_equal(st.lengths, [2, 2])


# -- capacity --------------------------------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("mode", MODES)
def test_past_capacity_raises_through_the_flag(mode):
    """Sequence 0 holds 2 of 4 positions: two steps fit, the third does not:
    nothing written for it, output zeros, length kept; sequence 1 still steps.
    The flag becomes a RangeError naming sequence 0 and max_seq=4 at check()."""
    rng = np.random.default_rng(9)
    st = _state(np.float32, mode, cap=4)
    k_pre, v_pre = (rng.standard_normal((2, 2, 2, 32)).astype(np.float32) for _ in "kv")
    st.prefill(k_pre, v_pre, [2, 0])
    model = Mirror(st, k_pre, v_pre, [2, 0])
    for _ in range(2):
        k_new, v_new = _rows(rng, st)
        st.step(np.zeros((2, 4, 32), np.float32), k_new, v_new)
        model.step(k_new, v_new, np.ones(2, bool))
    model.assert_state()
    k_new, v_new = _rows(rng, st)
    st.step(None, k_new, v_new)  # no numpy q: no sync, the error waits on the device
    model.step(k_new, v_new, np.array([False, True]))
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=4"):
        st.check()
    model.assert_state()  # sequence 0 untouched, lengths [4, 3]
    from attention.core.device import to_host

    assert np.all(to_host(st.out)[0] == 0) and np.all(np.isneginf(to_host(st.lse)[0]))
    st.check()  # cleared by the check that raised
    with pytest.raises(checks.RangeError, match=r"sequence 0 .*max_seq=4"):
        st.step(np.zeros((2, 4, 32), np.float32), k_new, v_new)  # numpy: a synchronising step
    np.testing.assert_array_equal(st.lengths, [4, 4])  # sequence 1 took its last row
    st.finish(0)  # a finished full sequence no longer raises; sequence 1 now does
    with pytest.raises(checks.RangeError, match=r"sequence 1 .*max_seq=4"):
        st.step(np.zeros((2, 4, 32), np.float32), k_new, v_new)
    st.finish(1)
    st.step(np.zeros((2, 4, 32), np.float32), k_new, v_new)
    np.testing.assert_array_equal(st.lengths, [4, 4])


@pytest.mark.device
def test_length_set_out_of_range_on_the_device_raises():
    st = _state(cap=4)
    st.d_lengths.copy_to_device(np.array([0, -1], np.int32))
    with pytest.raises(checks.RangeError, match=r"sequence 1 holds -1 positions.*max_seq=4"):
        st.step(sync=True)
    np.testing.assert_array_equal(st.lengths, [1, -1])


# -- planted defects: each changes what a step does --------------------------

def _two_steps(defect, finish=None, **kw):
    rng = np.random.default_rng(4)
    st = _state(defect=defect, **kw)
    k_pre, v_pre = (rng.standard_normal((2, 2, 3, 32)).astype(np.float32) for _ in "kv")
    st.prefill(k_pre, v_pre, [3, 1])
    outs = []
    for step in range(2):
        if step == 1 and finish is not None:
            st.finish(finish)
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        k_new, v_new = _rows(rng, st)
        outs.append(st.step(q, k_new, v_new, return_lse=True))
    return st, outs


@pytest.mark.device
@pytest.mark.parametrize("defect", ["length_not_advanced", "done_slot_read",
                                    "scatter_pos_plus_one", "one_short", "gqa_mod"])
def test_planted_defects_change_the_step(defect):
    from attention.core.device import to_host

    good, good_outs = _two_steps(None, finish=1)
    bad, bad_outs = _two_steps(defect, finish=1)
    if defect == "length_not_advanced":
        np.testing.assert_array_equal(good.lengths, [5, 2])
        np.testing.assert_array_equal(bad.lengths, [3, 1])
    elif defect == "done_slot_read":  # the finished sequence is read
        assert np.all(good_outs[1][0][1] == 0)
        assert np.all(np.isfinite(bad_outs[1][1][1])) and np.any(bad_outs[1][0][1] != 0)
    elif defect == "scatter_pos_plus_one":
        assert not np.array_equal(to_host(good.k_cache), to_host(bad.k_cache), equal_nan=True)
    else:  # the fast kernel's switch is passed on
        assert bad.plan["defect"] == defect and good.plan["defect"] is None
        assert not np.allclose(good_outs[0][0], bad_outs[0][0])


# -- arguments and records -------------------------------------------------

def test_bad_arguments_are_named_before_any_allocation():
    from attention.decode.step import DecodeState

    with pytest.raises(checks.RangeError, match="kv_slots"):
        DecodeState(3, 2, 1, 8, 4, kv_slots=2)
    with pytest.raises(checks.RangeError, match="slot_table"):
        DecodeState(2, 2, 1, 8, 4, kv_slots=3, slot_table=[1, 1])
    with pytest.raises(checks.RangeError, match="n_kv_heads"):
        DecodeState(2, 3, 2, 8, 4)
    with pytest.raises(checks.DTypeError, match="dtype"):
        DecodeState(2, 2, 1, 8, 4, dtype=np.float64)
    with pytest.raises(checks.DTypeError, match="dtype.*'warp'"):
        DecodeState(2, 2, 1, 8, 4, dtype=np.float16, kernel="warp")
    with pytest.raises(checks.DTypeError, match="q_dtype"):
        DecodeState(2, 2, 1, 8, 4, dtype=np.float16, q_dtype=np.float64)
    with pytest.raises(checks.AttentionInputError, match="mode"):
        DecodeState(2, 2, 1, 8, 4, mode="lazy")
    with pytest.raises(checks.AttentionInputError, match="kernel"):
        DecodeState(2, 2, 1, 8, 4, kernel="slow")
    with pytest.raises(ValueError, match="defect"):
        DecodeState(2, 2, 1, 8, 4, defect="nope")
    with pytest.raises(checks.ShapeError, match="k_cache"):
        DecodeState(2, 2, 1, 8, 4, k_cache=np.zeros((2, 1, 5, 8), np.float32))


@pytest.mark.device
def test_bad_step_input_is_named_and_leaves_the_state_alone():
    st = _state()
    k_new = np.zeros((2, 2, 32), np.float32)
    with pytest.raises(checks.ShapeError, match="q"):
        st.step(np.zeros((2, 4, 31), np.float32), k_new, k_new)
    with pytest.raises(checks.DTypeError, match="v_new"):
        st.step(np.zeros((2, 4, 32), np.float32), k_new, k_new.astype(np.float16))
    with pytest.raises(checks.RangeError, match="lengths"):
        st.load(np.zeros(st.cache_shape, np.float32), np.zeros(st.cache_shape, np.float32),
                [9, 0])
    np.testing.assert_array_equal(st.lengths, [0, 0])


@pytest.mark.device
def test_path_records():
    from attention.core.device import SIMULATOR

    eager = _state(mode="eager")
    assert eager.path == "eager" and eager.fallback_reason is None and eager.graph is None
    graph = _state(mode="graph", cap=1024)  # several splits: a combine launch
    if SIMULATOR:
        assert graph.path == "eager" and "simulator" in graph.fallback_reason
    else:
        assert graph.path == "graph" and graph.fallback_reason is None
    for st in (eager, graph):
        assert st.pdl["path"] in ("pdl", "plain", "none") and st.pdl["reason"]


@pytest.fixture(params=["fast", "warp"])
def eager_state(request):
    """An eager state, made before the patches of ``no_host_traffic`` apply."""
    return _state(mode="eager", kernel=request.param, cap=64)


@pytest.mark.device
def test_eager_step_makes_no_copy_or_sync(eager_state, no_host_traffic):
    """An eager step over the state's own buffers only enqueues: with every
    copy / allocation / synchronisation entry point patched to raise
    (``no_host_traffic``), steps still run. On a GPU they go through the
    prebuilt launches (``PrebuiltLaunch`` for prepare and scatter, the state's
    ``DecodePlan`` for the fast kernel's attention)."""
    from attention.core.device import SIMULATOR

    st = eager_state
    assert st.path == "eager"
    assert (st._prebuilt is None) == SIMULATOR
    assert (st._attn is not None) == (st.kernel == "fast")
    for _ in range(3):
        out = st.step()
    assert out is st.out and no_host_traffic == []
