"""Which fp32 accumulation does ``mma.m16n8k16`` (16-bit operands) perform, and
``mma.m16n8k8`` with tf32 operands? A probe.

Run (on a GPU): ``python -m validation.mma_accum_probe [--cases 200] [--out DIR]``;
score saved outputs offline: ``python -m validation.mma_accum_probe --from-bits NPZ``.

One warp computes ``D = A B + C`` for ``A`` [16, 16] and ``B`` [16, 8] 16-bit and ``C``
[16, 8] float32, one mma k step (``attention.gemm.mma16.tile_gemm_kernel`` at K 16), on
operands built to tell accumulation rules apart (products whose exponents spread over
a wide range, accumulators larger and smaller than the products, cancellation). Each
of the 128 outputs is compared bit for bit with host models of one k step (``MODELS``):

* ``exact_rz``: the 16 exact products and C summed, the sum truncated to fp32 (the
  rule ``validation.baselines.mma16_scores`` uses; the
  sum is taken in float64, whose rounding, 2^-53 of the sum, sits 29 bits below the
  truncation);
* ``align_e<E>``: the 16 products and C aligned to the largest exponent among the 17
  terms, each truncated toward zero ``E`` bits below fp32's last place at that
  exponent (24 + E bits below the leading bit), the terms added exactly, the sum
  truncated to fp32. A host model of the tensor-core prefill with ``align_e2`` in its
  scores reproduced the H200's errors on the twelve ``large`` prefill cases of the
  difference-first run to about four digits (notes/validation.md), where ``exact_rz``
  did not; this probe is the direct test of that inference.
* ``ops_e2``: as ``align_e2``, but the exponent each product is aligned by is the
  sum of its operands' exponents (``floor(log2|a|) + floor(log2|b|)``: the
  product's significand, in [1, 4), may carry one bit above it), and C's by its
  own; the grid is 2^(max - 25). Fitted offline to the H200's outputs of this
  probe (``--from-bits``, notes/validation.md): it matches every one of the
  25,600 outputs of each 16-bit type, where ``align_e2`` matched 90 % (fp16) and
  94 % (bf16) and ``exact_rz`` 57 % / 69 %. The probe's operands are nonzero
  and normal (C is zero in a quarter of the cases); how zeros and subnormals
  set the exponent is not tested.

tf32 (kind ``"tf32"``): one ``mma.m16n8k8`` (``attention.gemm.tgemm.tile_mma_kernel``),
A [16, 8] and B [8, 8] float32 values rounded to tf32, 8 products a k step; the same
models with 8 products in place of 16. Not fitted yet: the question is whether the
tf32 path follows the 16-bit one (``ops_e2``) or ``exact_rz``, the model
``attention.gemm.tgemm``'s simulator mma and the judge's ``tcP`` sums use. The two
differ where a tiny term of the opposite sign meets a large one: ``exact_rz`` then
truncates the sum one unit below the large term, ``ops_e2`` drops the tiny term
(the float32 tensor-core prefill's one-hot rows, notes/validation.md).

It prints, per operand type and model, how many outputs match bit for bit, and with
``--out`` writes ``mma_accum_probe.json`` with provenance and
``mma_accum_probe_bits.npz`` (each case's operands and the device's outputs).
On the simulator the mma is emulated with the fitted rule
(``attention.gemm.mma16.k_step_sum``, written apart from ``ops_e2`` here), so
there the probe checks itself: ``ops_e2`` matches every output and the
operands are shown to separate the models (``tests/test_mma16.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from validation.baselines import _ops_e2_step, _truncate32

F32, F64 = np.float32, np.float64
MODELS = ("exact_rz", "align_e1", "align_e2", "align_e3", "ops_e2")
KINDS = ("f16", "bf16", "tf32")


def model_step(a, b, c, model):
    """One k step of ``model``: ``a`` [16, K], ``b`` [K, 8] (16-bit values, K 16,
    or tf32 values, K 8), ``c`` [16, 8] float32 -> d [16, 8] float32."""
    prods = a.astype(F64)[:, None, :] * b.astype(F64).T[None, :, :]  # [16, 8, 16], exact
    terms = np.concatenate([c.astype(F64)[..., None], prods], axis=-1)  # [16, 8, 17]
    if model == "exact_rz":
        return _truncate32(terms.sum(axis=-1))
    if model == "ops_e2":  # the baselines' step of the rule (mma16_scores' "ops_e2")
        return _ops_e2_step(c.astype(F32), a.astype(F64), b.astype(F64).T)
    if not model.startswith("align_e"):
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    extra = int(model[len("align_e"):])
    mag = np.abs(terms).max(axis=-1, keepdims=True)
    lead = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    grid = np.exp2(lead - 23 - extra)
    kept = np.trunc(terms / grid)  # each term toward zero on the grid
    return _truncate32(kept.sum(axis=-1) * grid[..., 0])


def score_bits(path):
    """{kind: {model: matching outputs}, "outputs": n} of a saved
    ``mma_accum_probe_bits.npz`` (operands and device outputs) against ``MODELS``:
    the offline fit, no GPU needed."""
    data = np.load(path)
    rows = {}
    for kind in KINDS:
        if f"{kind}_a" not in data:  # a run from before the kind was probed
            continue
        a, b, c, d = (data[f"{kind}_{x}"] for x in "abcd")
        got = d.view(np.uint32)
        rows[kind] = {m: int(sum((model_step(a[i], b[i], c[i], m).view(np.uint32)
                                  == got[i]).sum() for i in range(len(a))))
                      for m in MODELS}
        rows[kind]["outputs"] = int(got.size)
    return rows


def tf32_round(x):
    """float32 ``x`` rounded to tf32 on its bit pattern (``attention.gemm.tgemm.split``'s
    ``hi``: add half a unit, clear the low 13 bits), as float32."""
    bits = (np.asarray(x, F32).view(np.uint32).astype(np.uint64) + 0x1000) & 0xFFFFE000
    return bits.astype(np.uint32).view(F32)


def operands(rng, kind, case):
    """(a [16, K], b [K, 8] 16-bit (K 16) or tf32 in float32 (K 8), c [16, 8]
    float32) of probe case ``case``: cycling over spreads of the products'
    exponents and accumulator sizes."""
    from validation.fixtures import resolve_dtype

    k = 8 if kind == "tf32" else 16
    spread = (2, 6, 12)[case % 3]  # exponent range of the operands
    c_scale = (0.0, 1.0, 2.0 ** 8, 2.0 ** -8)[(case // 3) % 4]

    def draw(shape):
        mant = rng.uniform(1.0, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
        x = mant * np.exp2(rng.integers(-spread, spread + 1, shape))
        if kind == "tf32":
            return tf32_round(x.astype(F32))
        return x.astype(resolve_dtype("float16" if kind == "f16" else "bfloat16"))

    a, b = draw((16, k)), draw((k, 8))
    exact = a.astype(F64) @ b.astype(F64)
    c = (rng.uniform(-1.0, 1.0, (16, 8)) * c_scale * np.abs(exact).max()).astype(F32)
    if case % 5 == 4:  # cancellation: C nearly minus the products' sum
        c = (-exact * (1.0 + rng.uniform(-1e-3, 1e-3, (16, 8)))).astype(F32)
    return a, b, c


def run_case(kind, a, b, c):
    """D from the device (``mma16.tile_gemm_kernel`` at K 16; tf32:
    ``tgemm.tile_mma_kernel``)."""
    from attention.core.device import to_device, to_host
    from attention.gemm import mma16, tgemm

    d_c = to_device(c.copy())
    if kind == "tf32":
        tgemm.tile_mma_kernel()[1, 32](to_device(np.ascontiguousarray(a, F32)),
                                       to_device(np.ascontiguousarray(b, F32)), d_c)
        return np.asarray(to_host(d_c))
    kern = mma16.tile_gemm_kernel(kind, False)
    kern[1, 32](to_device(mma16.pack_rows(a, kind)),
                to_device(mma16.pack_rows(np.ascontiguousarray(b.T), kind)), d_c, np.int32(16))
    return np.asarray(to_host(d_c))


def probe(kind, cases, seed=0, keep=None):
    """{model: [matching outputs, outputs]} over ``cases`` probe cases, and the
    number of outputs where the models do not all agree (what the probe can
    tell apart). ``keep``: a dict that receives the operands and the device's
    outputs (``a`` [cases, 16, K], ``b`` [cases, K, 8] as float32 holding the
    16-bit or tf32 values, ``c`` and ``d`` [cases, 16, 8] float32), so that other
    accumulation models can be fitted offline."""
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    hits = {m: [0, 0] for m in MODELS}
    split = 0
    for case in range(cases):
        a, b, c = operands(rng, kind, case)
        got = run_case(kind, a, b, c).view(np.uint32)
        if keep is not None:
            for name, x in zip("abcd", (a, b, c, got.view(np.float32))):
                keep.setdefault(name, []).append(np.asarray(x, np.float32))
        preds = {m: model_step(a, b, c, m).view(np.uint32) for m in MODELS}
        for m, p in preds.items():
            hits[m][0] += int((p == got).sum())
            hits[m][1] += got.size
        first = preds[MODELS[0]]
        split += int(np.any([p != first for p in preds.values()], axis=0).sum())
    return hits, split


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200, help="probe cases a type (128 outputs each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for mma_accum_probe.json")
    ap.add_argument("--from-bits", default=None, metavar="NPZ",
                    help="score a saved mma_accum_probe_bits.npz against the models "
                         "(no GPU) and exit")
    args = ap.parse_args(argv)
    if args.from_bits:
        for kind, row in score_bits(args.from_bits).items():
            n = row.pop("outputs")
            print(f"{kind}: " + "  ".join(f"{m} {h}/{n}" for m, h in row.items()))
        return 0
    from attention.core.device import SIMULATOR, gpu_available

    if not (gpu_available() or SIMULATOR):
        print("mma_accum_probe: needs a CUDA GPU (or NUMBA_ENABLE_CUDASIM=1)", file=sys.stderr)
        return 2
    rows, kept = {}, {}
    for kind in KINDS:
        keep = {}
        hits, split = probe(kind, args.cases, args.seed, keep)
        kept.update({f"{kind}_{name}": np.stack(x) for name, x in keep.items()})
        rows[kind] = {"outputs": hits[MODELS[0]][1], "models_disagree": split,
                      "matches": {m: h[0] for m, h in hits.items()}}
        line = "  ".join(f"{m} {h[0]}/{h[1]}" for m, h in hits.items())
        print(f"{kind}: {line}  (models disagree on {split} outputs)")
    if args.out:
        from validation.provenance import provenance

        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "mma_accum_probe.json")
        with open(path, "w") as f:
            json.dump({"provenance": provenance(), "cases": args.cases, "seed": args.seed,
                       "simulator": bool(SIMULATOR), "results": rows}, f, indent=1)
        print(f"wrote {path}")
        # the operands and the device's outputs, bit for bit (float32 holds every
        # 16-bit value exactly), for fitting other models offline
        np.savez_compressed(os.path.join(args.out, "mma_accum_probe_bits.npz"), **kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
