"""Falsification suite of the fp8 latent cache (``mla.fp8``): the MLA decode over
it (``mla_decode`` with ``latent_scale``, ``mla.mma``'s fp8 mode) and its
quantizing append (``mla.fp8_append.fp8_append_latent``).

Contract: ``validation/suite.py``. ``run_suite(None)`` returns only passing
checks; ``run_suite(d)`` returns at least one failing check for each planted
defect ``d`` in ``DEFECTS`` (compile-time switches, ``defect=``):

    fp8_scale_twice        the decode multiplies each code by its scale twice
    fp8_no_scale           the decode takes the codes' values unscaled
    fp8_scale_wrong_token  per token: a row dequantized with the next row's scale
    fp8_as_e5m2            the decode reads the codes as e5m2
    codes_no_trans         per tensor at rank 128 (the codes read straight into
                           the fragments): V's loaded without ``.trans``
    codes_swizzle_off      ... the code buffers stored with the next row's swizzle
    codes_v_block          ... V's chunks all from the first 64 columns
    append_round_to_zero   the append rounds magnitudes toward zero

Checks (named ``<check>[<case>]``):

* ``out[tensor_s2]`` / ``out[token_s2]``: ``mla_decode`` of two sequences
  (lengths 49 and 17, s_q 2 new queries each: query 0 of the first ends on a
  16-position edge) over a contiguous fp8 cache, 2 heads, d_nope 16, r 64,
  d_rope 64; every row past a length holds e4m3's NaN code (0x7F) and, per
  token, a NaN scale (never read). Per tensor: normal rows, scale amax / 448;
  per token: row p of a sequence scaled by ``10**e`` with e running over -6 ..
  4 (scales across 1e-6 .. 1e4 / 448 ... 1e4), an all-zero row (scale 0) at
  position 5. Judged against the float64 oracle over the exactly dequantized
  cache and ``baselines.mla_rounded_p`` in the kernel's order (per token the
  dequantized values rounded to fp16 as the kernel rounds them; per tensor
  the codes' values with the scale on S's c_kv part and on O, the order
  ``mma16_pcT``): the sweep's rule (``tolerance.verdict``).
* ``out[tensor_r128]``: the per-tensor case at rank 128, where ``mla.mma`` keeps
  no f16 tile and reads K's and V's fragments from the staged codes
  (``DIRECT``: swizzled code buffers, ldmatrix and ldmatrix ``.trans``, Q's
  columns permuted, O's put back); the same fixture and judge. The decode
  defects and the three ``codes_*`` layout switches run on it.
* ``append[token]`` / ``append[tensor]``: ``fp8_append_latent`` of 1 to 3 rows
  a sequence into pages of 4 (shuffled table), rows with values far past
  448 * scale (saturated), an all-zero row; every byte of the cache and every
  scale against ``mla.fp8.quantize`` applied to a copy: the new rows bit for
  bit, everything else unchanged (the canary).
"""

from __future__ import annotations

import numpy as np

from attention.core.device import can_execute
from validation.suite import Check

FAMILY = "mla_fp8"
DECODE_DEFECTS = ("fp8_scale_twice", "fp8_no_scale", "fp8_scale_wrong_token", "fp8_as_e5m2")
# the kernel's layout switches (``mla.mma.DEFECTS``) on the codes' direct path
CODES_DEFECTS = {"codes_no_trans": "ldmatrix_no_trans",
                 "codes_swizzle_off": "swizzle_off_by_one",
                 "codes_v_block": "v_block_stride"}
APPEND_DEFECTS = ("append_round_to_zero",)
DEFECTS = DECODE_DEFECTS + tuple(CODES_DEFECTS) + APPEND_DEFECTS
N_HEADS, D_NOPE, RANK, D_ROPE, D_V = 2, 16, 64, 64, 16
DIRECT_RANK = 128  # the smallest rank of mla.mma's direct path (a power of two >= 128)


def decode_case(mode, lens=(49, 17), s_q=2, seed=0, rank=RANK):
    """The decode case of ``mode`` ("tensor" / "token"): a dict with q_nope,
    q_pe [B, s_q, nh, .], w_uk, w_uv, ``codes`` uint8 [B, cap, RB], ``scale``
    ([1] or [B, cap]), ``exact`` float64 [B, cap, r + d_rope] (NaN past each
    length) and ``lens`` int32."""
    from attention.cache.fp8 import E4M3_NAN
    from mla import fp8

    rng = np.random.default_rng([seed, len(mode), s_q] + list(lens)
                                + ([] if rank == RANK else [rank]))
    n_b, cap, width = len(lens), max(lens), rank + D_ROPE
    q_nope = rng.standard_normal((n_b, s_q, N_HEADS, D_NOPE)).astype(np.float32)
    q_pe = rng.standard_normal((n_b, s_q, N_HEADS, D_ROPE)).astype(np.float32)
    w_uk = (rng.standard_normal((N_HEADS, D_NOPE, rank)) / np.sqrt(rank)).astype(np.float32)
    w_uv = (rng.standard_normal((N_HEADS, D_V, rank)) / np.sqrt(rank)).astype(np.float32)
    rows = rng.standard_normal((n_b, cap, width)).astype(np.float32)
    if mode == "token":  # each row its own order of magnitude: 1e-6 .. 1e4
        expo = (np.arange(cap)[None, :] * 7 + np.arange(n_b)[:, None] * 3) % 11 - 6
        rows[..., :rank] *= (10.0 ** expo)[..., None].astype(np.float32)
        rows[:, 5, :rank] = 0.0
        codes, scale = fp8.quantize(rows, rank)
        scale = np.array(scale, np.float32)
    else:
        s = np.float32(np.abs(rows[..., :rank]).max() / 448.0)
        codes, _ = fp8.quantize(rows, rank, np.array([s], np.float32))
        scale = np.array([s], np.float32)
    exact = fp8.dequantize(codes, scale, rank)
    for b, n in enumerate(lens):  # unused rows: NaN codes and scales, never read
        codes[b, n:, :rank] = E4M3_NAN
        exact[b, n:] = np.nan
        if mode == "token":
            scale[b, n:] = np.nan
    return {"q_nope": q_nope, "q_pe": q_pe, "w_uk": w_uk, "w_uv": w_uv, "codes": codes,
            "scale": scale, "exact": exact, "lens": np.asarray(lens, np.int32)}


def check_decode(mode, defect=None, rank=RANK):
    """``out[<mode>_s2]`` (``out[<mode>_r<rank>]`` at another rank): the decode
    against the oracle and the baseline."""
    from attention.cache.fp8 import decode_e4m3
    from mla.oracle import mla_decode_ref
    from mla.pipeline import mla_decode
    from validation import tolerance
    from validation.baselines import mla_rounded_p

    c = decode_case(mode, rank=rank)
    out = mla_decode(c["q_nope"], c["q_pe"], c["codes"], c["lens"], c["w_uk"], c["w_uv"],
                     latent_scale=c["scale"], defect=CODES_DEFECTS.get(defect, defect))
    ref = mla_decode_ref(c["q_nope"], c["q_pe"], c["exact"], c["lens"], c["w_uk"], c["w_uv"])
    scale = 1.0 / np.sqrt(D_NOPE + D_ROPE)
    base = np.zeros(ref.shape, np.float32)
    for b, n in enumerate(c["lens"]):
        rows = c["exact"][b, :n]
        c_kv, code_scale = rows[:, :rank], None
        if mode == "tensor":  # the kernel's order: the codes' values, the scale apart
            c_kv, code_scale = decode_e4m3(c["codes"][b, :n, :rank]), float(c["scale"][0])
        base[b] = mla_rounded_p(c["q_nope"][b], c["q_pe"][b], c_kv, rows[:, rank:],
                                c["w_uk"], c["w_uv"], scale, np.float16, code_scale=code_scale)
    ok, text = tolerance.verdict(np.asarray(out), ref, base)
    return Check(f"out[{mode}_s2]" if rank == RANK else f"out[{mode}_r{rank}]", ok, text)


def append_case(mode, seed=0):
    """The append case: a dict with new_rows [B, T, W] float32, ``cache`` uint8
    [num_pages, 4, RB] of random bytes, ``scales`` (token: [num_pages, 4] random
    floats) or ``scale`` [1], ``table`` [B, max_pages] (shuffled), ``lens``,
    ``n_new``."""
    from mla import fp8

    rng = np.random.default_rng([seed, len(mode), 4])
    page, n_pages, width = 4, 9, RANK + D_ROPE
    lens = np.array([3, 0, 6], np.int32)
    n_new = np.array([3, 1, 2], np.int32)
    table = rng.permutation(n_pages)[:6].reshape(3, 2).astype(np.int32)
    new = rng.standard_normal((3, 3, width)).astype(np.float32)
    new[0, 1, :RANK] *= 1e4  # far past 448 * scale per tensor: saturates
    new[2, 0, :RANK] = 0.0  # an all-zero row: scale 0, codes 0
    cache = rng.integers(0, 256, (n_pages, page, fp8.row_bytes(RANK, D_ROPE)), dtype=np.uint8)
    case = {"new_rows": new, "cache": cache, "table": table, "lens": lens, "n_new": n_new}
    if mode == "token":
        case["scales"] = rng.standard_normal((n_pages, page)).astype(np.float32)
    else:
        case["scale"] = np.array([0.01], np.float32)
    return case


def check_append(mode, defect=None):
    """``append[<mode>]``: the kernel's bytes and scales against the reference's."""
    from mla import fp8
    from mla.fp8_append import fp8_append_latent

    c = append_case(mode)
    want_cache, got_cache = c["cache"].copy(), c["cache"].copy()
    page = c["cache"].shape[1]
    want_sc = c["scales"].copy() if mode == "token" else None
    got_sc = c["scales"].copy() if mode == "token" else None
    for b, n in enumerate(c["n_new"]):
        for i in range(int(n)):
            p = int(c["lens"][b]) + i
            pg, off = int(c["table"][b, p // page]), p % page
            codes, s = fp8.quantize(c["new_rows"][b, i], RANK, c.get("scale"))
            want_cache[pg, off] = codes
            if mode == "token":
                want_sc[pg, off] = s
    kw = {"scales": got_sc} if mode == "token" else {"scale": c["scale"]}
    fp8_append_latent(c["new_rows"], got_cache, c["table"], c["lens"], n_new=c["n_new"],
                      defect=defect, **kw)
    bad = np.argwhere(got_cache != want_cache)
    if mode == "token" and not np.array_equal(got_sc, want_sc, equal_nan=True):
        return Check(f"append[{mode}]", False, "scales differ from the reference's")
    if bad.size:
        return Check(f"append[{mode}]", False, f"{len(bad)} bytes differ from the reference's, "
                                               f"first at {tuple(int(i) for i in bad[0])}")
    return Check(f"append[{mode}]", True, "every byte and scale as the reference's")


def run_suite(defect=None, *, small=True):
    if defect not in (None,) + DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    if not can_execute():
        raise RuntimeError("mla_fp8 suite: no GPU and the CUDA simulator is not enabled")
    results = []
    if defect is None or defect in DECODE_DEFECTS:
        modes = ("token",) if defect == "fp8_scale_wrong_token" else ("tensor", "token")
        for mode in modes:
            results.append(check_decode(mode, defect))
    if defect is None or (defect in DECODE_DEFECTS and defect != "fp8_scale_wrong_token") \
            or defect in CODES_DEFECTS:
        results.append(check_decode("tensor", defect, DIRECT_RANK))
    if defect is None or defect in APPEND_DEFECTS:
        for mode in ("token", "tensor"):
            results.append(check_append(mode, defect))
    return results
