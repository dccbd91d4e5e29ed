"""Falsification suite of the fp8 (e4m3) KV cache: the fp8 fast decode, per
tensor and per (token, kv head) scales, and the quantizing append.

Contract: ``validation/suite.py``. ``run_suite(None)`` passes; ``run_suite(d)``
fails for every planted defect ``d`` in ``DEFECTS``:

* the fp8 decode kernel's switches (``attention.decode.fast.FP8_DEFECTS``,
  through ``DecodePlan(cache_dtype="float8_e4m3fn", defect=d)``):
  "fp8_scale_twice" (the V scale applied twice), "fp8_no_k_scale" (the K scale
  not applied), "fp8_as_e5m2" (the codes decoded as e5m2), and, per-token-head
  plans only, "fp8_scale_wrong_head" (the scale of kv head ``(h + 1) %
  H_kv``) and "fp8_scale_wrong_token" (the scale of the next position of the
  page);
* the tensor-core fp8 decode's (``attention.decode.mma.FP8_TOKEN_DEFECTS``,
  through ``DecodePlan(method="mma", fp8_scales="token_head", defect=d)``):
  "fp8_scale_wrong_head" and "fp8_scale_wrong_token" (as above, in its ring's
  scale copies) and "fp8_p_unnormalized" (the V scales folded into P without
  the row normaliser: ``P vs`` rounded to f16 as it is);
* the append's (``attention.cache.fp8.FP8_DEFECTS``): "append_round_to_zero"
  (magnitudes rounded toward zero instead of to nearest).

Checks (each named ``<check>[<case>]``):

* ``out`` / ``lse [tensor_pooled]``: a decode case (``fixtures.decode_inputs``:
  NaN in unused slots and past every length, a shuffled slot table, GQA)
  quantized per tensor by the reference encoder (``fixtures.fp8_quantize``),
  against the float64 oracle over the DEQUANTIZED cache under the full rule
  (``validation.tolerance.verdict``; the baseline: the float32 attention over
  the dequantized cache in the kernel's lane order);
* ``out`` / ``lse [token_head_NHD3]``: the same case quantized per (token, kv
  head), in NHD pages of 3 (codes and scales shuffled alike, NaN codes and NaN
  scales in spare pages and past each length), D not a multiple of the vector
  width on the simulator (the scalar-load path), against the same oracle;
* ``out`` / ``lse [mma_token_head_HND16]``: the tensor-core decode over a case
  quantized per (token, kv head) with V scaled by 1e-4 first (V scales near
  1e-6, the issue's low end: f16's subnormals without the normaliser), q in
  float16, HND pages of 16, against the same oracle with the kernel's
  baseline ``mma16_pvf16/after`` (the registry's ``decode_mma_fp8_tok``);
* ``append [<layout>_<mode>]``: three new tokens a sequence quantized by
  ``fp8_append`` into HND pages of 4 (per token and head) and NHD pages of 3
  (per tensor), one of them a row of zeros and one past 448 before
  quantization: every byte of the pages and every scale compared bit for bit
  with ``quantize_append_ref`` (the written rows, and a canary everywhere
  else).
"""

from __future__ import annotations

import numpy as np

from attention.cache import fp8 as fp8_cache
from attention.core.device import can_execute, to_device, to_host
from attention.decode import fast as decode_fast
from attention.decode import mma as decode_mma
from attention.decode.plan import DecodePlan
from attention.oracle import decode_attention_ref
from validation import baselines, fixtures
from validation.suite import Check
from validation.tolerance import verdict

FAMILY = "decode_fp8"
DEFECTS = decode_fast.FP8_DEFECTS + ("fp8_p_unnormalized",) + fp8_cache.FP8_DEFECTS
TENSOR_DEFECTS = ("fp8_scale_twice", "fp8_no_k_scale", "fp8_as_e5m2")  # act on tensor plans
TOKEN_DEFECTS = ("fp8_as_e5m2",) + decode_fast.FP8_TOKEN_DEFECTS  # act on token_head plans
MMA_TOKEN_DEFECTS = decode_mma.FP8_TOKEN_DEFECTS  # act on the tensor-core token_head plan
MMA_BASELINE = "mma16_pv16/after"  # the tensor-core token_head decode's (registry)
CANARY = 0xA5
BASELINE = "decode_fast/before/recip_after/ex2"  # the fast decode's order (registry)
# its order over a per-tensor cache: the codes' values, the scales outside the sums
TENSOR_BASELINE = "decode_fast_c/before/recip_after/ex2"


def _dims(small):
    if small:
        return dict(m=3, h=4, h_kv=2, d=64, lens=(11, 0, 6), max_seq=12, kv_slots=5), 40
    return dict(m=4, h=16, h_kv=4, d=128, lens=(1025, 0, 97, 300), max_seq=1100,
                kv_slots=6), 111


def _judge(tag, x, out, lse, mma=False):
    """The ``out`` / ``lse`` checks of a run against the dequantized case (the
    fast decode's baseline, or with ``mma`` the tensor-core decode's)."""
    args = (x["q"], x["k_cache"], x["v_cache"], x["seq_lens"], x["slot_table"])
    ref, ref_lse = decode_attention_ref(*args)
    if mma:
        base = baselines.baseline("decode", x, baselines.resolve(MMA_BASELINE, x, np.float16))
        base, base_lse = base["out"], base["lse"]
    else:
        tensor = x.get("fp8_scales") == "tensor"
        label = baselines.resolve(TENSOR_BASELINE if tensor else BASELINE, x, np.uint8)
        base = baselines.baseline("decode", x, label)
        base, base_lse = base["out"], base["lse"]
    checks = []
    for name, got, r, b in (("out", out, ref, base), ("lse", lse, ref_lse, base_lse)):
        ok, text = verdict(got, r, b)
        checks.append(Check(f"{name}[{tag}]", bool(ok), text))
    return checks


def _run(x, mode, defect, page=None, layout="HND", method="fast"):
    q, kc, vc, ks, vs = x["q"], x["k_codes"], x["v_codes"], x["k_scale"], x["v_scale"]
    m, h, d = q.shape
    lens = np.asarray(x["seq_lens"], np.int32)
    slots = np.asarray(x["slot_table"], np.int32)
    n_kv, max_seq = kc.shape[1], kc.shape[2]
    kw = {"slot_table": to_device(slots)}
    if page is not None:
        seed = [page, m, int(lens.sum())]
        kc, vc, table = fixtures.paged_from_pooled(kc, vc, lens, slots, page, layout,
                                                   np.random.default_rng(seed))
        ks, _ = fixtures.paged_scales(ks, lens, slots, page, layout, np.random.default_rng(seed))
        vs, _ = fixtures.paged_scales(vs, lens, slots, page, layout, np.random.default_rng(seed))
        kw = {"page_table": to_device(table)}
    pl = DecodePlan(m, h, n_kv, d, kc.shape[0], max_seq, cache_dtype="float8_e4m3fn",
                    q_dtype=q.dtype, fp8_scales=mode, page_size=page, layout=layout,
                    defect=defect, method=method)
    d_lse = to_device(np.zeros((m, h), np.float32))
    out = pl.run(to_device(q), to_device(kc), to_device(vc), to_device(lens), lse=d_lse,
                 k_scale=to_device(ks), v_scale=to_device(vs), sync=True, **kw)
    return np.asarray(to_host(out)), np.asarray(to_host(d_lse))


def check_tensor(defect=None, small=True):
    dims, _ = _dims(small)
    x = fixtures.fp8_quantize(fixtures.decode_inputs(np.random.default_rng(41), **dims), "tensor")
    out, lse = _run(x, "tensor", defect if defect in TENSOR_DEFECTS else None)
    return _judge("tensor_pooled", x, out, lse)


def check_token_head(defect=None, small=True):
    dims, d_scalar = _dims(small)
    dims = dict(dims, d=d_scalar)
    x = fixtures.fp8_quantize(fixtures.decode_inputs(np.random.default_rng(42), **dims),
                              "token_head")
    out, lse = _run(x, "token_head", defect if defect in TOKEN_DEFECTS else None, 3, "NHD")
    return _judge("token_head_NHD3", x, out, lse)


def check_mma_token_head(defect=None, small=True):
    dims, _ = _dims(small)
    x = fixtures.decode_inputs(np.random.default_rng(44), **dims)
    x = dict(x, v_cache=x["v_cache"] * np.float32(1e-4), q=x["q"].astype(np.float16))
    x = fixtures.fp8_quantize(x, "token_head")
    out, lse = _run(x, "token_head", defect if defect in MMA_TOKEN_DEFECTS else None, 16,
                    "HND", method="mma")
    return _judge("mma_token_head_HND16", x, out, lse, mma=True)


def check_append(defect=None, small=True):
    """Three tokens a sequence through ``fp8_append``, bit for bit against
    ``quantize_append_ref`` (pages and scales), a canary everywhere else."""
    checks = []
    d = 16 if small else 128
    for layout, page, mode in (("HND", 4, "token_head"), ("NHD", 3, "tensor")):
        rng = np.random.default_rng(43 + page)
        n_kv, t_new = 2, 3
        lens = np.array([5, 0, 7], np.int32)
        width = 4
        n_pages = 3 * width
        table = rng.permutation(n_pages).astype(np.int32).reshape(3, width)
        shape = (n_pages, n_kv, page, d) if layout == "HND" else (n_pages, page, n_kv, d)
        k_new = (rng.standard_normal((3, t_new, n_kv, d)) * 30).astype(np.float32)
        v_new = (rng.standard_normal((3, t_new, n_kv, d)) * 3).astype(np.float32)
        k_new[0, 1] = 0.0  # a row of zeros: scale 0, codes 0
        v_new[2, 0, 1, :4] = [1e4, -6e4, 500.0, -449.0]  # past 448 (saturate per tensor)
        kp = np.full(shape, CANARY, np.uint8)
        vp = kp.copy()
        want_k, want_v = kp.copy(), vp.copy()
        append_defect = defect if defect in fp8_cache.FP8_DEFECTS else None
        if mode == "tensor":
            sk, sv = np.float32([0.07]), np.float32([0.9])
            fp8_cache.fp8_append(k_new, v_new, kp, vp, table, lens, k_scale=sk, v_scale=sv,
                                 layout=layout, defect=append_defect)
            fp8_cache.quantize_append_ref(k_new, want_k, None, table, lens, scale=sk[0],
                                          layout=layout)
            fp8_cache.quantize_append_ref(v_new, want_v, None, table, lens, scale=sv[0],
                                          layout=layout)
            scales_ok = True
        else:
            ks = np.full(shape[:3], -7.0, np.float32)  # a canary scale
            vs = ks.copy()
            want_ks, want_vs = ks.copy(), vs.copy()
            fp8_cache.fp8_append(k_new, v_new, kp, vp, table, lens, k_scales=ks, v_scales=vs,
                                 layout=layout, defect=append_defect)
            fp8_cache.quantize_append_ref(k_new, want_k, want_ks, table, lens, layout=layout)
            fp8_cache.quantize_append_ref(v_new, want_v, want_vs, table, lens, layout=layout)
            scales_ok = (np.array_equal(ks.view(np.uint32), want_ks.view(np.uint32))
                         and np.array_equal(vs.view(np.uint32), want_vs.view(np.uint32)))
        same = np.array_equal(kp, want_k) and np.array_equal(vp, want_v) and scales_ok
        nan_codes = int(np.sum((kp & 0x7F) == 0x7F) + np.sum((vp & 0x7F) == 0x7F))
        differ = int(np.sum(kp != want_k) + np.sum(vp != want_v))
        checks.append(Check(f"append[{layout}{page}_{mode}]", bool(same and nan_codes == 0),
                            f"{differ} bytes differ from the reference (canary and rows), "
                            f"scales {'equal' if scales_ok else 'differ'}, {nan_codes} NaN "
                            "codes"))
    return checks


def run_suite(defect=None, *, small=True):
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("decode_fp8 suite: no GPU and the CUDA simulator is not enabled")
    if not decode_fast.fp8_capable():
        raise RuntimeError("decode_fp8 suite: this GPU has no fp8 conversion (sm_89 or later)")
    results = []
    if defect is None or defect in TENSOR_DEFECTS:
        results += check_tensor(defect, small)
    if defect is None or defect in TOKEN_DEFECTS:
        results += check_token_head(defect, small)
    if defect is None or defect in MMA_TOKEN_DEFECTS:
        results += check_mma_token_head(defect, small)
    if defect is None or defect in fp8_cache.FP8_DEFECTS:
        results += check_append(defect, small)
    return results
