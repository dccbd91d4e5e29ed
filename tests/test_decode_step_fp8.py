"""FP8 e4m3 decode steps: ``DecodeState(dtype="float8_e4m3fn", fp8_scales=...)``
and ``decode(..., k_scale=, v_scale=, fp8_scales=)``.

A state's step appends with the quantizing append of ``attention.cache.fp8``
(per-tensor scales, or per-(token, kv head) scales ``amax / 448`` written
beside the cache) and attends with its ``DecodePlan(fp8_scales=...)``. Checked
against a host model: after every step (a prefill of 3 / 0 positions, three
steps with a finish and a restart between; rows of zeros and rows past 448
among the new rows, NaN codes and NaN scales in every unwritten row) the
whole cache (codes) and, per token and head, the scale arrays equal bit for
bit ``fp8.quantize_append_ref`` (the numpy reference quantizer), and at
the steps with every sequence live the output and LSE equal bit for bit a
direct ``DecodePlan`` run over the reference's codes and scales; the last
step is also judged against the float64 oracle over the dequantized cache.
Eager and graph states run the same steps (on the simulator a graph state
runs eager, recorded; on a GPU it replays a captured graph), so both are held
to the same bits. D is 64: an fp8 plan at D 32 does not plan on a GPU
(``fast.async_ring_ops``: 2 e4m3 elements a lane are not whole words).

Positive controls: the append's planted ``append_round_to_zero`` breaks the
bit-exact check; per-tensor scales of 1 given for codes written with
per-(token, head) scales change the answer (and fail the oracle check); a
scale array of the other mode's shape is named. Bad input (scale arrays of
the wrong shape, dtype or value, new rows of the wrong dtype) raises a named
error before anything is written: the caches, scales and lengths stay as
they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.cache import fp8
from attention.core import checks

MODES = ["eager", "graph"]
SCALES = ["tensor", "token_head"]
M, H, KV, D, CAP, SLOTS = 2, 4, 2, 64, 8, (2, 0)
K_SCALE, V_SCALE = np.float32(0.02), np.float32(0.5)  # per-tensor


def _state(fp8_scales, mode="eager", **kw):
    from attention.decode.step import DecodeState

    if fp8_scales == "tensor":
        kw.setdefault("k_scale", np.array([K_SCALE], np.float32))
        kw.setdefault("v_scale", np.array([V_SCALE], np.float32))
    return DecodeState(M, H, KV, D, CAP, kv_slots=3, slot_table=np.array(SLOTS, np.int32),
                       dtype="float8_e4m3fn", mode=mode, fill=np.nan, fp8_scales=fp8_scales,
                       **kw)


def _rows(rng, shape, dtype=np.float32):
    """New rows [..., D] of mixed magnitudes: a row of zeros and rows far past
    448 (before the per-tensor scale too)."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))
    x[(0,) * (len(shape) - 1)] = 0.0
    x[(-1,) * (len(shape) - 1)] *= 1e4
    if np.dtype(dtype) == np.float16:
        x = np.clip(x, -6e4, 6e4)  # finite in float16
    return x.astype(dtype)


class Model:
    """What an fp8 state's caches, scales and lengths should hold: the codes
    and scales of ``fp8.quantize_append_ref`` (numpy)."""

    def __init__(self, st):
        self.st = st
        self.kc = np.full(st.cache_shape, fp8.E4M3_NAN, np.uint8)
        self.vc = self.kc.copy()
        self.tensor = st.fp8_scales == "tensor"
        if self.tensor:
            self.ksc, self.vsc = np.array([K_SCALE]), np.array([V_SCALE])
        else:
            self.ksc = np.full(st.cache_shape[:3], np.nan, np.float32)
            self.vsc = self.ksc.copy()
        self.lengths = np.zeros(st.m, np.int64)
        self.table = np.asarray(st.slot_table, np.int32)[:, None]

    def append(self, k, v, live, lengths=None):
        """k, v [M, T, H_kv, D]: rows at ``lengths`` (default the model's) of the
        live sequences."""
        lengths = self.lengths if lengths is None else np.asarray(lengths)
        live = np.flatnonzero(live)
        for new, codes, sc in ((k, self.kc, self.ksc), (v, self.vc, self.vsc)):
            fp8.quantize_append_ref(new[live], codes, None if self.tensor else sc,
                                    self.table[live], lengths[live],
                                    scale=sc[0] if self.tensor else None)
        self.lengths[live] = lengths[live] + k.shape[1]

    def assert_state(self, what):
        from attention.core.device import to_host

        st = self.st
        for name, dev, want in (("k_cache", st.k_cache, self.kc), ("v_cache", st.v_cache, self.vc),
                                ("k_scale", st.k_scale, self.ksc),
                                ("v_scale", st.v_scale, self.vsc)):
            got = np.asarray(to_host(dev))
            assert got.dtype == (np.uint8 if "cache" in name else np.float32)
            same = (np.array_equal(got, want) if "cache" in name else
                    np.array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(
                        np.uint32)))  # bit for bit, NaN payloads included
            assert same, f"{name} differs from the reference quantizer ({what})"
        np.testing.assert_array_equal(st.lengths, self.lengths)

    def dequantized(self):
        """float64 caches decode(code) * scale (0 where no row was written)."""
        written = self.kc != fp8.E4M3_NAN
        out = []
        for codes, sc in ((self.kc, self.ksc), (self.vc, self.vsc)):
            s = (np.float64(sc[0]) if self.tensor else sc[..., None].astype(np.float64))
            with np.errstate(invalid="ignore"):
                out.append(np.where(written, fp8.decode_e4m3(codes) * s, 0.0))
        return out

    def plan_run(self, q, seen):
        """out, lse of a direct DecodePlan run over the model's codes and scales."""
        from attention.core.device import to_device, to_host
        from attention.decode.plan import DecodePlan

        st = self.st
        pl = DecodePlan(st.m, st.n_heads, st.n_kv_heads, st.head_dim, st.kv_slots, st.max_seq,
                        cache_dtype=np.uint8, q_dtype=st.q_dtype, fp8_scales=st.fp8_scales,
                        method=st.method)
        assert pl.n_split == st.n_split and pl.scale_shape == st.scale_shape
        ks, vs = (np.asarray(s, np.float32) for s in (self.ksc, self.vsc))
        out = pl.run(to_device(q.astype(st.q_dtype)), to_device(self.kc), to_device(self.vc),
                     to_device(np.asarray(seen, np.int32)),
                     to_device(np.asarray(st.slot_table, np.int32)), k_scale=to_device(ks),
                     v_scale=to_device(vs), sync=True)
        return np.asarray(to_host(out)), np.asarray(to_host(pl.lse))


def judge(q, kd, vd, seen, slots, out, lse, what):
    """The fp8 path's rule (tests/test_decode_fp8.py): float64 oracle over the
    dequantized cache, float32 baseline in the 16-lane order."""
    from attention.oracle import decode_attention_ref
    from validation import baselines, growth
    from validation.tolerance import assert_matches

    ref_o, ref_l = decode_attention_ref(q, kd, vd, seen, slots)
    label = growth.baseline_order("fast_decode", {"q": q}, np.float16)
    base_o, base_l = baselines.decode_order(q, kd.astype(np.float32), vd.astype(np.float32),
                                            seen, slots, label)
    assert_matches(out, ref_o, base_o, what=f"out {what}")
    assert_matches(lse, ref_l, base_l, what=f"lse {what}")


def _bits_equal(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


# -- steps against the host model -----------------------------------------

@pytest.mark.device
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fp8_scales", SCALES)
def test_fp8_steps_track_the_reference_quantizer_and_a_direct_plan(fp8_scales, mode):
    from tests.conftest import MODE

    rng = np.random.default_rng(31)
    new_dtype = np.float16 if fp8_scales == "tensor" else np.float32
    st = _state(fp8_scales, mode, new_dtype=new_dtype)
    if mode == "eager" or MODE == "sim":
        assert st.path == "eager"
    else:
        assert st.path == "graph" and st.graph is not None, st.fallback_reason
    assert st.fp8 and st.scale_shape == ((1,) if fp8_scales == "tensor" else (3, KV, CAP))
    model = Model(st)
    model.assert_state("fresh")
    k_pre, v_pre = (_rows(rng, (M, KV, 3, D), new_dtype) for _ in "kv")
    st.prefill(k_pre, v_pre, [3, 0])
    model.append(k_pre.transpose(0, 2, 1, 3)[:, :3], v_pre.transpose(0, 2, 1, 3)[:, :3],
                 np.array([True, False]))
    model.assert_state("prefill")
    for step in range(3):
        if step == 1:
            st.finish(0)
        if step == 2:
            st.restart(0, length=1)
            model.lengths[0] = 1
        live = ~st.done
        q = rng.standard_normal((M, H, D)).astype(np.float32)
        k_new, v_new = (_rows(rng, (M, KV, D), new_dtype) for _ in "kv")
        out, lse = st.step(q, k_new, v_new, return_lse=True)
        model.append(k_new[:, None], v_new[:, None], live)
        model.assert_state(f"step {step}")
        seen = np.where(live, model.lengths, 0)
        if step == 1:  # the finished sequence: zeros and -inf (no plan run: time)
            assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
            continue
        want_o, want_l = model.plan_run(q, seen)
        assert _bits_equal(out, want_o) and _bits_equal(lse, want_l), f"step {step}"
    kd, vd = model.dequantized()
    judge(q, kd, vd, seen, np.asarray(st.slot_table), out, lse, f"{fp8_scales} {mode}")
    st.check()


@pytest.mark.device
def test_eager_and_graph_states_give_the_same_bits():
    rng = np.random.default_rng(5)
    states = [_state("token_head", mode) for mode in MODES]
    for step in range(2):
        q = rng.standard_normal((M, H, D)).astype(np.float32)
        k_new, v_new = (_rows(rng, (M, KV, D)) for _ in "kv")
        outs = [st.step(q, k_new, v_new, return_lse=True) for st in states]
        assert _bits_equal(outs[0][0], outs[1][0]) and _bits_equal(outs[0][1], outs[1][1])
    from attention.core.device import to_host

    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        a, b = (np.asarray(to_host(getattr(st, name))) for st in states)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


# -- positive controls -------------------------------------------------------

@pytest.mark.device
def test_planted_round_to_zero_append_breaks_the_bit_check():
    rng = np.random.default_rng(7)
    st = _state("token_head", defect="append_round_to_zero")
    model = Model(st)
    k_new, v_new = (_rows(rng, (M, KV, D)) for _ in "kv")
    st.step(rng.standard_normal((M, H, D)).astype(np.float32), k_new, v_new)
    model.append(k_new[:, None], v_new[:, None], np.ones(M, bool))
    with pytest.raises(AssertionError, match="k_cache differs"):
        model.assert_state("round to zero")


@pytest.mark.device
def test_per_tensor_scales_over_token_head_codes_give_another_answer():
    """The codes and scales a token_head state wrote, attended right (the
    state, decode(fp8_scales="token_head")) and wrongly (decode with per-tensor
    scales of 1: the codes' values unscaled): the wrong one differs and fails
    the oracle check; a token_head scale array given as per-tensor is named."""
    from attention import decode
    from attention.core.device import to_host

    rng = np.random.default_rng(9)
    st = _state("token_head")
    k_pre, v_pre = (_rows(rng, (M, KV, 4, D)) for _ in "kv")
    st.prefill(k_pre, v_pre, [4, 2])
    q = rng.standard_normal((M, H, D)).astype(np.float32)
    k_new, v_new = (_rows(rng, (M, KV, D)) for _ in "kv")
    out, lse = st.step(q, k_new, v_new, return_lse=True)
    kc, vc, ks, vs = (np.asarray(to_host(getattr(st, n)))
                      for n in ("k_cache", "v_cache", "k_scale", "v_scale"))
    lens, slots = st.lengths, np.asarray(st.slot_table, np.int32)
    right, right_lse = decode(q, kc, vc, lens, slots, k_scale=ks, v_scale=vs,
                              fp8_scales="token_head", return_lse=True)
    assert _bits_equal(right, out) and _bits_equal(right_lse, lse)
    one = np.ones(1, np.float32)
    wrong, wrong_lse = decode(q, kc, vc, lens, slots, k_scale=one, v_scale=one,
                              return_lse=True)
    assert np.abs(wrong - out).max() > 1e-2 * np.abs(out).max()
    model = Model(st)
    model.kc, model.vc, model.ksc, model.vsc = kc, vc, ks, vs
    kd, vd = model.dequantized()
    judge(q, kd, vd, lens, slots, out, lse, "token_head state")
    with pytest.raises(AssertionError):
        judge(q, kd, vd, lens, slots, wrong, wrong_lse, "per-tensor scales of 1")
    with pytest.raises(checks.ShapeError, match=r"k_scale: .*\[1=1\].*fp8_scales='token_head'"):
        decode(q, kc, vc, lens, slots, k_scale=ks, v_scale=vs)


# -- decode(): fp8 caches ----------------------------------------------------------

@pytest.mark.device
def test_decode_token_head_numpy_and_device_inputs_match_the_plan():
    from attention import decode
    from attention.core.device import to_device, to_host
    from attention.decode.plan import DecodePlan

    rng = np.random.default_rng(3)
    x = _rows(rng, (3, KV, CAP, D))
    y = _rows(rng, (3, KV, CAP, D))
    ks, vs = fp8.row_scales(x), fp8.row_scales(y)
    kc, vc = fp8.quantize_rows(x, ks), fp8.quantize_rows(y, vs)
    lens, slots = np.array([CAP, 3], np.int32), np.array([2, 0], np.int32)
    q = rng.standard_normal((M, H, D)).astype(np.float32)
    host = decode(q, kc, vc, lens, slots, k_scale=ks, v_scale=vs, fp8_scales="token_head")
    dev = decode(*(to_device(a) for a in (q, kc, vc, lens, slots)), k_scale=to_device(ks),
                 v_scale=to_device(vs), fp8_scales="token_head")
    pl = DecodePlan(M, H, KV, D, 3, CAP, cache_dtype=np.uint8, fp8_scales="token_head")
    want = pl.run(*(to_device(a) for a in (q, kc, vc, lens, slots)), k_scale=to_device(ks),
                  v_scale=to_device(vs), sync=True)
    assert _bits_equal(host, to_host(want)) and _bits_equal(to_host(dev), to_host(want))
    bad = ks.copy()
    bad[2, 1, CAP - 1] = np.nan  # attended by sequence 0 (slot 2, length CAP)
    with pytest.raises(checks.RangeError, match=r"k_scale: .*finite.*\[2, 1, 7\]"):
        decode(q, kc, vc, lens, slots, k_scale=bad, v_scale=vs, fp8_scales="token_head")
    bad[2, 1, CAP - 1], bad[0, 0, 5] = 1.0, np.nan  # slot 0 attends 3 positions only
    decode(q, kc, vc, lens, slots, k_scale=bad, v_scale=vs, fp8_scales="token_head")


def test_decode_fp8_arguments_are_named():
    from attention import decode

    q = np.zeros((M, H, D), np.float32)
    kc = np.zeros((3, KV, CAP, D), np.uint8)
    lens = np.array([1, 1], np.int32)
    tok = np.ones((3, KV, CAP), np.float32)
    one = np.ones(1, np.float32)
    with pytest.raises(checks.AttentionInputError, match="k_scale, v_scale: an fp8 cache"):
        decode(q, kc, kc, lens, fp8_scales="token_head")
    with pytest.raises(checks.ShapeError, match=r"v_scale: expected shape \[KV_SLOTS=3, "
                                                 r"H_kv=2, max_seq=8\]"):
        decode(q, kc, kc, lens, k_scale=tok, v_scale=tok[:, :, :4], fp8_scales="token_head")
    with pytest.raises(checks.DTypeError, match="k_scale"):
        decode(q, kc, kc, lens, k_scale=tok.astype(np.float64), v_scale=tok,
               fp8_scales="token_head")
    with pytest.raises(checks.RangeError, match="v_scale: expected a finite scale > 0"):
        decode(q, kc, kc, lens, k_scale=one, v_scale=np.zeros(1, np.float32))
    with pytest.raises(checks.AttentionInputError, match="only fp8 caches"):
        decode(q, kc.astype(np.float32), kc.astype(np.float32), lens, k_scale=one, v_scale=one)
    with pytest.raises(checks.AttentionInputError, match="fp8_scales"):
        decode(q, kc, kc, lens, k_scale=one, v_scale=one, fp8_scales="row")
    with pytest.raises(checks.DTypeError, match="q"):
        decode(q.astype(np.float64), kc, kc, lens, k_scale=one, v_scale=one)


# -- bad input: named, before anything is written ------------------------------

def test_fp8_state_arguments_are_named_before_any_allocation():
    from attention.decode.step import DecodeState

    tok = np.ones((3, KV, CAP), np.float32)
    with pytest.raises(checks.AttentionInputError, match="k_scale, v_scale: an fp8 state"):
        DecodeState(M, H, KV, D, CAP, dtype=np.uint8)
    with pytest.raises(checks.RangeError, match="k_scale: expected a finite scale > 0"):
        _state("tensor", k_scale=np.zeros(1, np.float32))
    with pytest.raises(checks.ShapeError,
                       match=r"k_scale: expected shape \[1=1\].*fp8_scales='token_head'"):
        _state("tensor", k_scale=tok)
    with pytest.raises(checks.ShapeError, match=r"v_scale: expected shape \[KV_SLOTS=3, "
                                                 r"H_kv=2, max_seq=8\]"):
        _state("token_head", k_scale=tok, v_scale=tok.transpose(0, 2, 1).copy())
    with pytest.raises(checks.DTypeError, match="k_scale"):
        _state("token_head", k_scale=tok.astype(np.float16), v_scale=tok)
    with pytest.raises(checks.AttentionInputError, match="give both"):
        _state("token_head", k_scale=tok)
    with pytest.raises(checks.AttentionInputError, match="fp8_scales"):
        _state("row")
    with pytest.raises(checks.AttentionInputError, match="fp8_scales: 'token_head' needs an fp8"):
        DecodeState(M, H, KV, D, CAP, fp8_scales="token_head")
    with pytest.raises(checks.AttentionInputError, match="only fp8 states"):
        DecodeState(M, H, KV, D, CAP, k_scale=np.ones(1, np.float32),
                    v_scale=np.ones(1, np.float32))
    with pytest.raises(checks.DTypeError, match="new_dtype"):
        _state("token_head", new_dtype=np.float64)
    with pytest.raises(checks.DTypeError, match="new_dtype"):
        DecodeState(M, H, KV, D, CAP, dtype=np.float16, new_dtype=np.float32)
    with pytest.raises(checks.DTypeError, match="q_dtype"):
        _state("token_head", q_dtype=np.float64)
    import attention.reference.decode_step  # noqa: F401  (registers "warp")

    with pytest.raises(checks.DTypeError, match="dtype.*'warp'"):
        _state("token_head", kernel="warp")


@pytest.mark.device
def test_bad_fp8_input_is_named_and_leaves_the_caches_alone():
    """After a step: a load with scale arrays of the wrong shape or dtype (or
    none), a step with new rows of the wrong dtype: each named, and the
    codes, scales and lengths are what the step left."""
    from attention.core.device import to_host

    rng = np.random.default_rng(11)
    st = _state("token_head")
    k_new, v_new = (_rows(rng, (M, KV, D)) for _ in "kv")
    st.step(rng.standard_normal((M, H, D)).astype(np.float32), k_new, v_new)
    names = ("k_cache", "v_cache", "k_scale", "v_scale")
    before = [np.asarray(to_host(getattr(st, n))).copy() for n in names]
    codes = np.zeros(st.cache_shape, np.uint8)
    good = np.ones(st.scale_shape, np.float32)
    bad = [({"k_scale": np.ones((3, CAP, KV), np.float32), "v_scale": good},
            checks.ShapeError, r"k_scale: expected shape \[KV_SLOTS=3, H_kv=2, max_seq=8\]"),
           ({"k_scale": good, "v_scale": np.ones(1, np.float32)}, checks.ShapeError,
            "v_scale: .*fp8_scales='tensor'"),
           ({"k_scale": good, "v_scale": good.astype(np.float64)}, checks.DTypeError,
            "v_scale"),
           ({}, checks.AttentionInputError, "k_scale, v_scale: loading")]
    for kw, err, match in bad:
        with pytest.raises(err, match=match):
            st.load(codes, codes, [1, 1], **kw)
    with pytest.raises(checks.DTypeError, match="k_new"):
        st.step(np.zeros((M, H, D), np.float32), np.zeros_like(k_new, np.float16), v_new)
    with pytest.raises(checks.DTypeError, match="k"):
        st.prefill(np.zeros((M, KV, 2, D), np.uint8), np.zeros((M, KV, 2, D), np.uint8), [1, 1])
    for n, b in zip(names, before):
        assert np.array_equal(np.asarray(to_host(getattr(st, n))).view(np.uint8),
                              b.view(np.uint8)), f"{n} changed"
    np.testing.assert_array_equal(st.lengths, [1, 1])
    st.load(codes, codes, [1, 1], k_scale=good, v_scale=good * 2)  # a good load goes through
    assert np.array_equal(to_host(st.v_scale), good * 2)


@pytest.mark.device
@pytest.mark.parametrize("fp8_scales", SCALES)
def test_tensor_core_fp8_steps_give_a_direct_plans_bits(fp8_scales):
    """``DecodeState(method="mma", q_dtype=float16)``: the same quantizing append
    (the caches and scales the reference quantizer's, bit for bit), and the
    attention of a direct ``DecodePlan(method="mma")`` over them."""
    rng = np.random.default_rng(32)
    st = _state(fp8_scales, q_dtype=np.float16, method="mma")
    assert st.method == "mma" and st.plan["kind"] == "f8"
    assert st.plan["scales"] == fp8_scales
    model = Model(st)
    k_pre, v_pre = (_rows(rng, (M, KV, 3, D)) for _ in "kv")
    st.prefill(k_pre, v_pre, [3, 1])
    model.append(k_pre.transpose(0, 2, 1, 3)[:, :3], v_pre.transpose(0, 2, 1, 3)[:, :3],
                 np.array([True, False]))
    model.append(k_pre.transpose(0, 2, 1, 3)[:, :1], v_pre.transpose(0, 2, 1, 3)[:, :1],
                 np.array([False, True]))
    for step in range(2):
        q = rng.standard_normal((M, H, D)).astype(np.float16)
        k_new, v_new = (_rows(rng, (M, KV, D)) for _ in "kv")
        out, lse = st.step(q, k_new, v_new, return_lse=True)
        model.append(k_new[:, None], v_new[:, None], np.array([True, True]))
        model.assert_state(f"step {step}")
        want_o, want_l = model.plan_run(q, model.lengths)
        assert _bits_equal(out, want_o) and _bits_equal(lse, want_l), f"step {step}"


def test_state_method_is_checked_before_any_allocation():
    from attention.decode.step import DecodeState

    with pytest.raises(checks.AttentionInputError, match="method: expected 'fast' or 'mma'"):
        DecodeState(M, H, KV, D, CAP, method="auto")
    with pytest.raises(checks.AttentionInputError, match="method: 'mma'.*q_dtype"):
        DecodeState(M, H, KV, D, CAP, dtype="float8_e4m3fn", q_dtype=np.float32,
                    k_scale=np.float32([1.0]), v_scale=np.float32([1.0]), method="mma")
