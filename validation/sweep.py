"""Run one sweep case: inputs -> kernel -> float64 oracle and float32 baselines -> metrics.

``run_case(case)`` returns a JSON-ready record:

    id, kernel, family, kind, shape, fixture, seed, dtype, dims
    status    "pass" | "fail" | "error" (the kernel raised) | "unsupported"
              (the kernel rejects the dtype with checks.DTypeError) |
              "not available" (its module does not exist yet) | "broken"
              (its module exists but does not import)
    passed    bool; ratio, margin, max_abs, max_rel, cos_diff (worst over outputs)
    outputs   {"out": judge record, "lse": judge record} (``validation.metrics``)
    baseline  the order of the same-precision baseline (``validation.baselines``)
    cast      which inputs were stored in the case dtype ("storage" or "all")
    seconds   kernel wall time (first call includes compilation)
    detail    why it failed / was skipped

fp8 kernels (``KernelSpec.quantize``) take the case's caches quantized by the
reference encoder (``fixtures.fp8_quantize``), and their oracle and baseline
the dequantized values: the kernel is judged by the same rule as the others.

References are cached per (kind, shape, fixture, seed, dtype, cast, fp8 mode): every
kernel of a kind sees the same inputs, so the oracle runs once for all of them,
and each baseline order once for the kernels that share it.
"""

from __future__ import annotations

import time
import traceback
from collections import OrderedDict

import numpy as np

from validation import baselines, fixtures, metrics, registry
from validation.tolerance import MEAN_RATIO, RATIO

# a mutant is detectable on a case when its max error is over RATIO x the
# baseline's, or its mean error over DETECTABLE x the baseline's mean
DETECTABLE = 2.0

_REF_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_REF_CACHE_SIZE = 6
FAILING = ("fail", "error", "broken")


def _simulator():
    from attention.core.device import SIMULATOR

    return SIMULATOR


def _cast_inputs(inputs, names, dtype):
    dt = fixtures.resolve_dtype(dtype)
    out = dict(inputs)
    for n in names:
        out[n] = fixtures.cast(inputs[n], dt)
    return out


def _float_names(inputs):
    return tuple(n for n, v in inputs.items()
                 if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating))


def call_with_dtype(spec, fn, inputs, dtype):
    """Run the kernel on inputs stored in ``dtype``: the storage inputs first, then
    every floating input. Returns (outputs, inputs used, cast mode); raises
    ``checks.DTypeError`` when the kernel rejects both."""
    from attention.core.checks import DTypeError

    if dtype == "float32":
        return spec.run(fn, inputs), inputs, "none"
    storage = _cast_inputs(inputs, spec.storage, dtype)
    try:
        return spec.run(fn, storage), storage, "storage"
    except DTypeError as first:
        everything = _cast_inputs(inputs, _float_names(inputs), dtype)
        try:
            return spec.run(fn, everything), everything, "all"
        except DTypeError as second:
            raise DTypeError(f"{first} (cached tensors in {dtype}); {second} "
                             f"(every input in {dtype})") from None


def _refs(spec, case, used, cast):
    """(oracle, plain, label, base): the float64 oracle, the oracle code in
    float32 (context), the kernel's baseline order (resolved for the case) and
    that baseline; {output name: array} each. Cached per input data, every
    order computed once for the kernels that share it."""
    key = (spec.kind, case.shape, case.fixture, case.seed, case.dtype, cast, case.small,
           spec.quantize)
    if key in _REF_CACHE:
        _REF_CACHE.move_to_end(key)
    else:
        oracle, plain = registry.references(spec.kind, used, case.dtype)
        _REF_CACHE[key] = {"oracle": oracle, "plain": plain, "orders": {}}
        while len(_REF_CACHE) > _REF_CACHE_SIZE:
            _REF_CACHE.popitem(last=False)
    entry = _REF_CACHE[key]
    storage = used[spec.storage[0]].dtype if spec.storage else np.float32
    if spec.quantize and "k_codes" in used and baselines.parse(spec.baseline)[0] in \
            ("decode_fast", "decode_fast_c"):  # the fast fp8 decode: the fp8 lane layout
        storage = used["k_codes"].dtype
    label = baselines.resolve(spec.baseline, used, storage)
    if label not in entry["orders"]:
        entry["orders"][label] = baselines.baseline(spec.kind, used, label, entry["plain"])
    return entry["oracle"], entry["plain"], label, entry["orders"][label]


def _dims_text(shape):
    d = dict(shape.dims)
    if "dims" in d:  # MLA geometry
        g = d.pop("dims")
        d = {"nh": g.n_head, "d_nope": g.d_nope, "d_rope": g.d_rope, "d_v": g.d_v,
             "r": g.kv_rank, **d}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def base_record(case, spec=None):
    spec = spec or registry.KERNELS_BY_NAME[case.kernel]
    return {"id": case.id, "kernel": case.kernel, "family": spec.family, "kind": spec.kind,
            "shape": case.shape, "fixture": case.fixture, "seed": case.seed,
            "dtype": case.dtype, "passed": False, "detail": ""}


def run_case(case):
    spec = registry.KERNELS_BY_NAME[case.kernel]
    rec = base_record(case, spec)
    status, fn = registry.resolve(spec)
    if status != "ok":
        rec.update(status=status, detail=str(fn)[-2000:])
        return rec
    shape = registry.find_shape(spec.kind, case.shape, case.small)
    rec["dims"] = _dims_text(shape)
    if case.dtype == "bfloat16" and _simulator():
        rec.update(status="unsupported", detail="the CUDA simulator has no bfloat16")
        return rec
    inputs = registry.make_inputs(spec.kind, shape, case.fixture, case.seed)
    if spec.quantize:  # fp8: the oracle and the baseline see the dequantized cache
        inputs = fixtures.fp8_quantize(inputs, spec.quantize)
    from attention.core.checks import DTypeError

    start = time.perf_counter()
    try:
        outputs, used, cast = call_with_dtype(spec, fn, inputs, case.dtype)
    except DTypeError as exc:
        rec.update(status="unsupported", detail=f"DTypeError: {exc}")
        return rec
    except Exception:  # noqa: BLE001 - a kernel that raises on valid input fails the case
        rec.update(status="error", detail=traceback.format_exc(limit=6)[-3000:],
                   seconds=time.perf_counter() - start)
        return rec
    rec["seconds"] = time.perf_counter() - start
    rec["cast"] = cast
    oracle, plain, label, base = _refs(spec, case, used, cast)
    rec["baseline"] = label
    judged = {}
    for name, ref in oracle.items():
        got = outputs.get(name)
        if got is None:
            continue
        judged[name] = metrics.judge(np.asarray(got), ref, base[name], label)
        judged[name]["plain_abs"] = metrics.max_abs_error(plain[name], ref)
    verdict = metrics.combine(judged)
    rec.update(outputs=judged, status="pass" if verdict["passed"] else "fail", **verdict)
    if not verdict["passed"]:
        rec["detail"] = "; ".join(f"{name}: {describe_failure(r)}"
                                  for name, r in judged.items() if not r["passed"])
    if case.mutants:
        rec["mutants"] = run_mutants(spec, fn, used, outputs, oracle, base, label)
    return rec


def mutant_record(got, clean, oracle, base, label):
    """How one mutant's outputs compare (``run_mutants``): inert, exceeds,
    detectable, caught, and the worst ratios and margins over outputs."""
    inert = all(np.array_equal(np.asarray(got[n]), np.asarray(clean[n]), equal_nan=True)
                for n in oracle if n in got)
    judged = {n: metrics.judge(np.asarray(got[n]), ref, base[n], label)
              for n, ref in oracle.items() if n in got}
    exceeds = detectable = False
    for r in judged.values():
        broken = not r["nonfinite_ok"]
        exceeds |= broken or r["max_abs"] > r["baseline_abs"] or r["mean_abs"] > r[
            "baseline_mean"]
        detectable |= broken or r["max_abs"] > RATIO * r["baseline_abs"] or r["mean_abs"] > \
            DETECTABLE * r["baseline_mean"]
    verdict = metrics.combine(judged)
    return {"inert": inert, "exceeds": bool(exceeds), "detectable": bool(detectable),
            "caught": not verdict["passed"], "failed_by": verdict["failed_by"],
            "ratio": verdict["ratio"], "margin": verdict["margin"],
            "mean_margin": verdict["mean_margin"],
            "mean_ratio": max((r["mean_ratio"] for r in judged.values()), default=0.0)}


def run_mutants(spec, fn, used, clean, oracle, base, label):
    """Run each precision mutant of ``spec`` (``registry.mutants_of``) on the
    case's inputs and judge it like the kernel: {mutant: ``mutant_record``}, or
    {mutant: {"error": text}} where the mutant raised (a crash is recorded, never
    counted as caught)."""
    out = {}
    for name in registry.mutants_of(spec.name):
        try:
            got = spec.run(fn, used, defect=name)
        except Exception:  # noqa: BLE001 - recorded as an error, not a catch
            out[name] = {"error": traceback.format_exc(limit=4)[-1500:], "caught": False,
                         "inert": False, "exceeds": False, "detectable": False}
            continue
        out[name] = mutant_record(got, clean, oracle, base, label)
    return out


def describe_failure(r):
    """One line saying which rules a judged output breaks, with the numbers."""
    if "nonfinite" in r["failed_by"]:
        return r["nonfinite_detail"]
    parts = []
    if "max" in r["failed_by"]:
        parts.append(f"max abs err {r['max_abs']:.3e} > bound {r['bound']:.3e} "
                     f"({RATIO:g} x baseline {r['baseline_abs']:.3e} [{r['baseline']}] + floor "
                     f"{r['floor']:.2e}), worst at {r['worst_index']}")
    if "mean" in r["failed_by"]:
        parts.append(f"mean abs err {r['mean_abs']:.3e} > bound {r['mean_bound']:.3e} "
                     f"({MEAN_RATIO:g} x baseline mean {r['baseline_mean']:.3e})")
    return "; ".join(parts)


def not_available_record(spec, status, why):
    """One record standing for every case of a kernel that cannot run."""
    return {"id": f"{spec.name}/*", "kernel": spec.name, "family": spec.family,
            "kind": spec.kind, "shape": "*", "fixture": "*", "seed": None, "dtype": "*",
            "status": status, "passed": False, "detail": str(why)[-2000:]}
