"""The same-precision baselines (``validation.baselines``): one order per kernel.

Plain CPU tests. They show (1) each order sums what it says, in that order,
bit for bit against a plain loop, (2) the ``matmul`` order is the oracle code
itself, (3) every registered kernel names a valid order and the per-case orders
resolve to the kernel's layout, (4) every order is a correct float32
computation, and (5) the single baseline still fails the defects the decode
suites plant (wrong kv head, wrong slot, one position short), at every fixture.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.oracle import decode_attention_ref
from validation import baselines, metrics, registry

F32 = np.float32


def _case(kind, shape, fixture="normal", seed=0, small=True):
    sh = registry.find_shape(kind, shape, small)
    return registry.make_inputs(kind, sh, fixture, seed)


def _fma(total, a, b):
    return F32(np.float64(total) + np.float64(a) * np.float64(b))


def _lanes_loop(x, y, n_lanes, vec):
    """The warp kernels' score: a running FMA a lane, then the butterfly."""
    parts = np.zeros(n_lanes, F32)
    for j in range(n_lanes):
        total = None
        for d in range(len(x)):
            if (d // vec) % n_lanes == j:
                total = F32(np.float64(x[d]) * np.float64(y[d])) if total is None \
                    else _fma(total, x[d], y[d])
        parts[j] = 0 if total is None else total
    off = n_lanes // 2
    while off:
        parts = np.array([F32(parts[i] + parts[i ^ off]) for i in range(n_lanes)], F32)
        off //= 2
    return parts[0]


def _interleaved_loop(x, y):
    w4 = len(x) - len(x) % 4
    acc = [F32(0)] * 4
    for d in range(w4):
        acc[d % 4] = _fma(acc[d % 4], x[d], y[d])
    for d in range(w4, len(x)):
        acc[0] = _fma(acc[0], x[d], y[d])
    return F32(F32(acc[0] + acc[1]) + F32(acc[2] + acc[3]))


def _blocked_loop(x, y, part):
    total = None
    for k0 in range(0, len(x), part):
        acc = F32(0)
        for d in range(k0, min(len(x), k0 + part)):
            acc = _fma(acc, x[d], y[d])
        total = acc if total is None else F32(total + acc)
    return total


@pytest.mark.parametrize("n", [1, 7, 40, 111, 128])
def test_each_order_sums_as_it_says(n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal((5, n)).astype(F32)
    b = rng.standard_normal(n).astype(F32)
    rows = range(a.shape[0])
    np.testing.assert_array_equal(baselines.dot(a, b, "fma"),
                                  [_blocked_loop(a[i], b, 1 << 20) for i in rows])
    np.testing.assert_array_equal(baselines.blocked_matmul(a, b[:, None], n)[:, 0],
                                  baselines.dot(a, b, "fma"))
    for lanes, vec in ((32, 1), (16, 8), (16, 1), (32, 4)):
        np.testing.assert_array_equal(baselines.dot(a, b, f"lanes{lanes}x{vec}"),
                                      [_lanes_loop(a[i], b, lanes, vec) for i in rows])
    np.testing.assert_array_equal(baselines.dot(a, b, "interleaved4"),
                                  [_interleaved_loop(a[i], b) for i in rows])
    for part in (16, 64):
        want = [_blocked_loop(a[i], b, part) for i in rows]
        np.testing.assert_array_equal(baselines.dot(a, b, f"blocked{part}"), want)
        np.testing.assert_array_equal(
            baselines.blocked_matmul(a, b[:, None], part)[:, 0], want)
    # positive control: the orders differ from one another somewhere
    if n >= 40:
        assert not np.array_equal(baselines.dot(a, b, "fma"), baselines.dot(a, b, "lanes32x1"))


def test_labels_are_checked():
    for bad in ("running/after", "fma", "fma/sideways", "matmul/after/recip_after",
                "lanes32/before", "fma/after/guess"):
        with pytest.raises(ValueError, match="baseline order"):
            baselines.parse(bad)
    assert baselines.parse("fma/before") == ("fma", "before", "divide", "exp")
    assert baselines.parse("lanes32x1/before/recip_after/ex2")[3] == "ex2"
    with pytest.raises(ValueError, match="baseline order"):
        baselines.parse("fma/before/recip_after/expm1")


CASES = [("decode", "gqa9x3_d40"), ("decode", "d111_t97"), ("prefill", "d80_t17_causal"),
         ("prefill", "gqa3x1_d40_t5_causal"), ("mla", "s1_q3_kv9"), ("mla", "s0_q1_kv9")]


@pytest.mark.parametrize("kind,shape", CASES)
def test_the_matmul_order_is_the_oracle_code(kind, shape):
    x = _case(kind, shape)
    _, plain = registry.references(kind, x, "float32")
    got = baselines.baseline(kind, x, baselines.MATMUL)
    for name, arr in plain.items():
        np.testing.assert_array_equal(got[name], arr)
    assert baselines.baseline(kind, x, baselines.MATMUL, plain)["out"] is plain["out"]


@pytest.mark.parametrize("spec", registry.KERNELS, ids=lambda s: s.name)
def test_every_kernel_names_an_order_that_is_float32_accurate(spec):
    """Each kernel's order, resolved on a case of its kind, is a correct float32
    computation: within a few times the oracle code's own float32 error."""
    shape = {"decode": "gqa9x3_d40", "prefill": "d80_t17_causal", "mla": "s1_q3_kv9"}[spec.kind]
    x = _case(spec.kind, shape)
    if spec.quantize:  # an fp8 entry: judged over the case's dequantized cache
        from validation import fixtures

        x = fixtures.fp8_quantize(x, spec.quantize)
    label = baselines.resolve(spec.baseline, x, x[spec.storage[0]].dtype)
    assert baselines.parse(label)[0] not in ("decode_fast", "mla_gemm")
    ref, plain = registry.references(spec.kind, x, "float32")
    got = baselines.baseline(spec.kind, x, label)
    for name in ref:
        e_plain = metrics.max_abs_error(plain[name], ref[name])
        e = metrics.max_abs_error(got[name], ref[name])
        assert e <= 4 * e_plain + 1e-6, (name, label, e, e_plain)


def test_orders_resolve_to_the_kernel_layout():
    x = {"q": np.zeros((2, 4, 128), F32), "q_nope": np.zeros((1, 128, 8), F32)}
    assert baselines.resolve("decode_fast/before/recip_after/ex2", x, np.float16) == \
        "lanes16x8/before/recip_after/ex2"
    assert baselines.resolve("decode_fast/before/recip_after", x, np.float32) == \
        "lanes32x4/before/recip_after"
    x["q"] = np.zeros((2, 4, 40), F32)
    assert baselines.resolve("decode_fast/before", x, np.float16) == "lanes16x1/before/divide"
    few = {"q_nope": np.zeros((1, 4, 8), F32)}
    from attention.gemm import sgemm

    assert baselines.resolve("mla_gemm/after/recip_first", few, F32) == \
        f"blocked{sgemm.PART_K}/after/recip_first"


def _defective(x, defect):
    """The float64 oracle's output with one of the decode suites' planted defects."""
    q, k, v = x["q"], x["k_cache"], x["v_cache"]
    lens, slots = np.array(x["seq_lens"]), np.array(x["slot_table"])
    n_heads, n_kv = q.shape[1], k.shape[1]
    if defect == "gqa_mod":  # query head h reads kv head h % H_kv
        idx = [h % n_kv for h in range(n_heads)]
        k = np.concatenate([k[:, [i]] for i in idx], axis=1)
        v = np.concatenate([v[:, [i]] for i in idx], axis=1)
    elif defect == "slot_off_by_one":  # the next slot's cache
        slots = (slots + 1) % k.shape[0]
        k, v = np.nan_to_num(k), np.nan_to_num(v)
    elif defect == "length_short":  # the newest position not read
        lens = np.maximum(lens - 1, 0)
    return decode_attention_ref(q, k, v, lens, slots)[0]


@pytest.mark.parametrize("fixture", ["normal", "large", "equal"])
@pytest.mark.parametrize("defect", ["gqa_mod", "slot_off_by_one", "length_short"])
def test_the_baseline_fails_planted_defects(fixture, defect):
    x = _case("decode", "gqa9x3_d40", fixture, seed=2, small=False)
    ref, _ = registry.references("decode", x, "float32")
    label = registry.KERNELS_BY_NAME["batched_decode"].baseline
    base = baselines.baseline("decode", x, label)["out"]
    rec = metrics.judge(_defective(x, defect), ref["out"], base, label)
    assert not rec["passed"]
    assert rec["margin"] > 10, rec["margin"]  # far outside, not a near miss
    assert rec["baseline"] == label


def test_ex2_rounds_the_argument_as_fast_math_exp_does():
    """``ex2``: exp(x) as 2 ** fl32(x log2 e): at x from -10 to -20 its weights
    differ from numpy's exp by several float32 units."""
    scores = np.concatenate([[0.0], -np.linspace(10.0, 20.0, 63)]).astype(F32)[None]
    vals = np.eye(64, dtype=F32)
    exact, _ = baselines.attend(scores, vals, "recip_after", "exp")
    fast, _ = baselines.attend(scores, vals, "recip_after", "ex2")
    np.testing.assert_allclose(fast, exact, rtol=1e-5)
    # the argument's rounding shows: several float32 units in some weight
    assert np.abs(fast[0, 1:] / exact[0, 1:] - 1).max() > 4 * 2.0 ** -24


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind must be"):
        baselines.baseline("nope", {}, baselines.MATMUL)


@pytest.mark.parametrize("scale", [1.0, 1e-21, 1e19])
def test_tensor_blocked_matmul_is_the_rz_model(scale):
    """``blocked_matmul(tensor=True)`` (``tcP``) sums as ``bench.tgemm_emu``'s
    ``rz`` model, bit for bit: normal sums (the vectorised truncation) and sums
    whose float32 result is subnormal or overflows (the scalar path)."""
    from bench import tgemm_emu

    rng = np.random.default_rng(7)
    a = (rng.standard_normal((5, 72)) * scale).astype(np.float32)
    b = (rng.standard_normal((72, 19)) * scale).astype(np.float32)
    got = baselines.blocked_matmul(a, b, 16, tensor=True)
    want = tgemm_emu.tgemm_emu(a, b, 2, "rz")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    if scale < 1:  # the case exercises float32 subnormals
        assert (np.abs(got[got != 0]) < np.finfo(np.float32).tiny).any()
    if scale > 1:
        assert np.isinf(got).any()  # and overflows


def test_token_head_baseline_forms_scores_in_the_kernels_order():
    """``decode_rounded_p(k_scales=)`` (the registry's ``mma16_pv16``): the scores
    are q summed against the K codes' values, times the scale, times the row's K
    scale, three float32 roundings as the tensor-core fp8 decode forms them. With
    K scales of 1 it is the sum over the rows as they are, bit for bit; with
    real scales at |score| near 1e4 (an ulp of a score is then 1e-3 of its
    weight) the two orders give different LSEs, so the order is not moot
    (the finding on decode_mma_fp8_tok/long_d128/large, validation.findings)."""
    from attention.cache.fp8 import E4M3_VALUES
    from validation.baselines import decode_rounded_p

    rng = np.random.default_rng(3)
    m, kv, n, d = 1, 1, 64, 32
    codes = rng.choice(E4M3_VALUES[np.isfinite(E4M3_VALUES)], (m, kv, n, d)).astype(np.float32)
    codes /= np.abs(codes).max()
    v = rng.standard_normal((m, kv, n, d)).astype(np.float32)
    vs = rng.uniform(0.5, 1.0, (m, kv, n)).astype(np.float32)
    q = (rng.standard_normal((m, 1, 4, d)) * 3000).astype(np.float16).astype(np.float32)
    lens = np.array([n])
    ones = np.ones((m, kv, n), np.float32)
    plain = decode_rounded_p(q, codes, v, lens, 0.125, np.float16, "mma16", v_scales=vs)
    same = decode_rounded_p(q, codes, v, lens, 0.125, np.float16, "mma16", v_scales=vs,
                            k_scales=ones)
    assert all(np.array_equal(a, b) for a, b in zip(plain, same))
    ks = rng.uniform(0.9, 1.1, (m, kv, n)).astype(np.float32)
    dequant = (codes * ks[..., None]).astype(np.float32)
    kernel_order = decode_rounded_p(q, codes, v, lens, 0.125, np.float16, "mma16",
                                    v_scales=vs, k_scales=ks)
    dequant_order = decode_rounded_p(q, dequant, v, lens, 0.125, np.float16, "mma16",
                                     v_scales=vs)
    assert not np.array_equal(kernel_order[1], dequant_order[1])  # lse: the top score


def test_per_tensor_fp8_order_keeps_the_scales_out_of_the_sums():
    """``lanesLxVc`` (the registry's ``decode_fp8``): each score is the lane sum
    of q against the K codes' values, then times the K scale (one rounding);
    the output is ``((e @ V codes) * vs) * fl(1 / l)``, as the fast decode's
    per-tensor path forms them. Checked element by element against a plain
    loop of that arithmetic; a case quantized per (token, head) is refused."""
    from validation import fixtures
    from validation.baselines import LOG2E, decode_order, fp8_tensor_codes

    x = fixtures.fp8_quantize(_case("decode", "d80"), "tensor")
    label = baselines.resolve("decode_fast_c/before/recip_after/ex2", x, np.uint8)
    assert label.startswith("lanes") and label.split("/")[0].endswith("c")
    got = baselines.baseline("decode", x, label)
    q, k, v, lens, slots = fp8_tensor_codes(x, label)
    ks, vs = F32(x["k_scale"][0]), F32(x["v_scale"][0])
    layout = baselines._LANES.match(label.split("/")[0])
    lanes, vec = int(layout.group(1)), int(layout.group(2))
    scale = F32(1.0 / np.sqrt(q.shape[-1]))
    n_heads, n_kv = q.shape[1], k.shape[1]
    for m in range(q.shape[0]):
        n = int(lens[m])
        for h in range(n_heads):
            g = h // (n_heads // n_kv)
            qs = (q[m, h].astype(F32) * scale).astype(F32)
            s = np.array([F32(_lanes_loop(k[slots[m], g, j], qs, lanes, vec) * ks)
                          for j in range(n)], F32)
            top = s.max()
            e = np.exp2(((s - top).astype(F32) * LOG2E).astype(F32).astype(np.float64))
            e = e.astype(F32)
            acc = (e @ v[slots[m], g, :n]).astype(F32)
            want = ((acc * vs).astype(F32) * (F32(1) / e.sum()).astype(F32)).astype(F32)
            assert np.array_equal(got["out"][m, h], want), (m, h)
    # the dequantized order (the old baseline) is another float32 computation
    old = baselines.baseline("decode", x, baselines.resolve(
        "decode_fast/before/recip_after/ex2", x, np.uint8))
    assert not np.array_equal(old["out"], got["out"])
    with pytest.raises(ValueError, match="quantized per tensor"):
        baselines.baseline("decode", fixtures.fp8_quantize(_case("decode", "d80"),
                                                           "token_head"), label)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        decode_order(q, k, v, lens, slots, label)
    with pytest.raises(ValueError, match="v_scale takes NORM recip_after"):
        baselines.attend(np.zeros((1, 2), F32), np.zeros((2, 3), F32), "divide", v_scale=1.0)
