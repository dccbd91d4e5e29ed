"""tgemm's arithmetic emulated on the CPU, in the 128-head MLA growth run.

    python -m bench.tgemm_emu [--steps N] MODEL [MODEL ...]
    python -m bench.tgemm_emu --case SHAPE/FIXTURE/sSEED MODEL [MODEL ...]

Why: on the H200 the tensor-core MLA GEMMs' growth run failed with 64-k
partials, nearly passed with 32-k ones (notes/bench.md, run 19) and passes with
16-k ones, as this model foretold (run 20). This
replays the same run (``validation.growth``'s inputs for ``mla_gemm_decode``,
fp32 cache, seed 0: same generator, same draws) with the GEMMs emulated in
numpy, so a change to the summation can be judged before it is built.

The emulated GEMM follows ``attention.gemm.tgemm``: operands split into tf32 halves
(round to nearest on the bit pattern, as ``split``), per k8 step the terms
``al bh``, ``ah bl``, ``ah bh`` (``terms`` 4 adds ``al bl`` first), each an mma
``part = round(part + sum of 8 exact products)``, and ``part`` added to the
fp32 totals every ``part_k8`` k8 steps. ``round`` is the model of the tensor
core's own sum: ``rn`` rounds to nearest,
``rz`` truncates towards zero (the hardware's behaviour: this model reproduces
the H200's failures, e.g. at length 192 with 32-k partials; the simulator's
``mma`` and ``validation.baselines``' ``tcP`` order take it). The rest of the
pipeline is float32 numpy: absorb, scale, softmax, decompress.

MODEL: ``MODE:PART_K8[:TERMS]`` for both GEMMs, or ``SCORES/PV`` with one such
spec for the score GEMM and one for P.V (e.g. ``rz:1/rz:4``). Prints, per model,
the steps over the growth run's bound (``validation.metrics.judge`` against
the oracle-order float32 baseline), worst and median ratio to that baseline,
and worst err/bound.

``--case`` runs one fp32 case of the validation sweep's ``mla_gemm`` family
instead (GPU shapes, one query: e.g. ``dsv3_q1_kv1025/large/s0``) and prints
each model's ratio and err/bound against the oracle-order baseline alone: how
far legal fp32 summation orders move a case's verdict under a single baseline
(notes/validation.md, near ties; the sweep itself takes the largest error of
``validation.baselines``' orders).
"""

from __future__ import annotations

import argparse

import numpy as np

F32, F64 = np.float32, np.float64


def tf32(x):
    """``x`` rounded to tf32 (10 mantissa bits) to nearest on the bit pattern."""
    b = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(F32)


def split(x):
    """(hi, lo) with hi = tf32(x), lo = tf32(x - hi), as ``attention.gemm.tgemm``."""
    hi = tf32(x)
    return hi, tf32((np.asarray(x, F32) - hi).astype(F32))


def round_rz(x):
    """float64 ``x`` to float32, truncated towards zero."""
    f = np.asarray(x, F64).astype(F32)
    over = np.abs(f.astype(F64)) > np.abs(x)
    f[over] = np.nextafter(f[over], F32(0))
    return f


def round_rn(x):
    return np.asarray(x, F64).astype(F32)


def tgemm_emu(a, b, part_k8=4, mode="rz", terms=3):
    """a [M, K] @ b [K, N] (float32 values) as tgemm sums it; returns [M, N] float32."""
    m, k = a.shape
    n = b.shape[1]
    kp = -(-k // 8) * 8
    ap = np.zeros((m, kp), F32)
    ap[:, :k] = a
    bp = np.zeros((kp, n), F32)
    bp[:k] = b
    ah, al = split(ap)
    bh, bl = split(bp)
    pairs = [(al, bh), (ah, bl), (ah, bh)]
    if terms == 4:
        pairs.insert(0, (al, bl))
    rnd = {"rz": round_rz, "rn": round_rn}[mode]
    acc = np.zeros((m, n), F32)
    part = np.zeros((m, n), F32)
    steps = kp // 8
    for s in range(steps):
        ks = slice(8 * s, 8 * s + 8)
        for x, y in pairs:  # products of tf32 halves are exact in float64
            part = rnd(part.astype(F64) + x[:, ks].astype(F64) @ y[ks].astype(F64))
        if (s + 1) % part_k8 == 0 or s + 1 == steps:
            acc = (acc + part).astype(F32)
            part[:] = 0
    return acc


def parse_model(spec):
    """``MODE:PART_K8[:TERMS]`` or ``SCORES/PV`` -> ((mode, part, terms), (...))."""
    def one(s):
        bits = s.split(":")
        if len(bits) not in (2, 3) or bits[0] not in ("rz", "rn"):
            raise ValueError(f"model {spec!r}: expected MODE:PART_K8[:TERMS], MODE rz or rn")
        part, terms = int(bits[1]), int(bits[2]) if len(bits) == 3 else 3
        if part < 1 or terms not in (3, 4):
            raise ValueError(f"model {spec!r}: PART_K8 >= 1, TERMS 3 or 4")
        return bits[0], part, terms

    sides = spec.split("/")
    if len(sides) > 2:
        raise ValueError(f"model {spec!r}: at most one '/'")
    scores = one(sides[0])
    return scores, one(sides[1]) if len(sides) == 2 else scores


def decode(q_nope, q_pe, c, k, w_uk, w_uv, model):
    """One decode step of the GEMM path, GEMMs emulated: q_nope [1, nh, d_nope],
    q_pe [1, nh, d_rope], c [L, r], k [L, d_rope], w_uk [nh, d_nope, r],
    w_uv [nh, d_v, r] -> out [1, nh, d_v] float32."""
    from mla.oracle import default_scale

    (sm, sp, st), (pm, pp, pt) = model
    scale = F32(default_scale(q_nope.shape[2], q_pe.shape[2]))
    q_lat = np.einsum("hpl,hp->hl", w_uk, q_nope[0]).astype(F32)
    qc = np.concatenate([q_lat, q_pe[0]], axis=1).astype(F32)  # [nh, r + d_rope]
    rows = np.concatenate([c, k], axis=1).astype(F32)  # [L, r + d_rope]
    s = (scale * tgemm_emu(qc, np.ascontiguousarray(rows.T), sp, sm, st)).astype(F32)
    e = np.exp(s - s.max(axis=1, keepdims=True)).astype(F32)
    p = (e / e.sum(axis=1, keepdims=True, dtype=F32)).astype(F32)
    o_lat = tgemm_emu(p, c.astype(F32), pp, pm, pt)
    return np.einsum("hjl,hl->hj", w_uv, o_lat).astype(F32)[None]


def growth(models, steps, seed=0, total=1024):
    """The first ``steps`` steps of the 128-head ``mla_gemm_decode`` growth run
    (``total`` steps long, as on the GPU); per model a list of (length, ratio, margin)."""
    from mla.oracle import mla_attend_absorbed, mla_attend_float32
    from validation import metrics
    from validation.growth import GrowthJob, mla_growth_inputs

    job = GrowthJob("mla_gemm_decode", "float32", seed, total, False)
    _, _, start, w_uk, w_uv, c_all, k_all, queries = mla_growth_inputs(job)
    out = {name: [] for name in models}
    for step, (q_nope, q_pe) in zip(range(steps), queries):
        length = start + step + 1
        args = (q_nope, q_pe, c_all[:length].astype(F64), k_all[:length].astype(F64), w_uk,
                w_uv)
        ref, base = mla_attend_absorbed(*args), mla_attend_float32(*args)
        for name, model in models.items():
            got = decode(q_nope, q_pe, c_all[:length], k_all[:length], w_uk, w_uv, model)
            j = metrics.judge(got, ref, base, F32)
            out[name].append((length, j["ratio"], j["margin"]))
    return out


def sweep_case(models, spec):
    """One fp32 ``mla`` case of the sweep, ``spec`` "SHAPE/FIXTURE/sSEED" (GPU
    shapes, ``t_q`` 1), under each model: {name: (ratio, err/bound)}."""
    from validation import metrics, registry

    parts = spec.split("/")
    if len(parts) != 3 or not parts[2].startswith("s") or not parts[2][1:].isdigit():
        raise ValueError(f"--case: expected SHAPE/FIXTURE/sSEED, got {spec!r}")
    try:
        shape = registry.find_shape("mla", parts[0], small=False)
    except KeyError as exc:
        raise ValueError(f"--case: {exc.args[0]}") from None
    if shape.dims["t_q"] != 1:
        raise ValueError(f"--case: the model runs one decode query; {parts[0]} has "
                         f"t_q {shape.dims['t_q']}")
    inp = registry.make_inputs("mla", shape, parts[1], int(parts[2][1:]))
    ref, base = registry.references("mla", inp, "float32")
    args = [inp[n] for n in registry.MLA_ARGS]
    out = {}
    for name, model in models.items():
        j = metrics.judge(decode(*args, model), ref["out"], base["out"], F32)
        out[name] = (j["ratio"], j["margin"])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.tgemm_emu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="MODE:PART_K8[:TERMS] or SCORES/PV")
    ap.add_argument("--steps", type=int, default=450, help="growth steps (default 450)")
    ap.add_argument("--case", help="one sweep case SHAPE/FIXTURE/sSEED instead of the growth run")
    args = ap.parse_args(argv)
    try:
        models = {m: parse_model(m) for m in args.models}
        if args.case:
            for name, (ratio, margin) in sweep_case(models, args.case).items():
                print(f"{name}: {args.case} ratio {ratio:.2f}, err/bound {margin:.2f}")
            return
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    for name, rows in growth(models, args.steps).items():
        a = np.array(rows)
        over = a[a[:, 2] > 1, 0].astype(int).tolist()
        print(f"{name}: {args.steps} steps, {len(over)} over the bound"
              f"{' (lengths ' + ', '.join(map(str, over[:8])) + ')' if over else ''}, "
              f"worst ratio {a[:, 1].max():.2f}, median {np.median(a[:, 1]):.2f}, "
              f"worst err/bound {a[:, 2].max():.2f}", flush=True)


if __name__ == "__main__":
    main()
