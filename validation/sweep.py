"""Run one sweep case: inputs -> kernel -> float64 oracle and float32 baselines -> metrics.

``run_case(case)`` returns a JSON-ready record:

    id, kernel, family, kind, shape, fixture, seed, dtype, dims
    status    "pass" | "fail" | "error" (the kernel raised) | "unsupported"
              (the kernel rejects the dtype with checks.DTypeError) |
              "not available" (its module does not exist yet) | "broken"
              (its module exists but does not import)
    passed    bool; ratio, margin, max_abs, max_rel, cos_diff (worst over outputs)
    outputs   {"out": judge record, "lse": judge record} (``validation.metrics``)
    cast      which inputs were stored in the case dtype ("storage" or "all")
    seconds   kernel wall time (first call includes compilation)
    detail    why it failed / was skipped

References are cached per (kind, shape, fixture, seed, dtype, cast): every
kernel of a kind sees the same inputs, so the oracle runs once for all of them.
"""

from __future__ import annotations

import time
import traceback
from collections import OrderedDict

import numpy as np

from validation import baselines, fixtures, metrics, registry

_REF_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_REF_CACHE_SIZE = 6
FAILING = ("fail", "error", "broken")


def _simulator():
    from attention.device import SIMULATOR

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
    from attention.checks import DTypeError

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


def _refs(spec, case, shape, used, cast):
    key = (spec.kind, case.shape, case.fixture, case.seed, case.dtype, cast, case.small)
    if key in _REF_CACHE:
        _REF_CACHE.move_to_end(key)
        return _REF_CACHE[key]
    oracle, plain = registry.references(spec.kind, used, case.dtype)
    got = oracle, baselines.variants(spec.kind, used, plain)
    _REF_CACHE[key] = got
    while len(_REF_CACHE) > _REF_CACHE_SIZE:
        _REF_CACHE.popitem(last=False)
    return got


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
    from attention.checks import DTypeError

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
    oracle, base = _refs(spec, case, shape, used, cast)
    judged = {}
    for name, ref in oracle.items():
        got = outputs.get(name)
        if got is None:
            continue
        judged[name] = metrics.judge(np.asarray(got), ref, base[name], fixtures.resolve_dtype(
            case.dtype))
    verdict = metrics.combine(judged)
    rec.update(outputs=judged, status="pass" if verdict["passed"] else "fail", **verdict)
    if not verdict["passed"]:
        rec["detail"] = "; ".join(
            f"{name}: " + (r["nonfinite_detail"] or
                           f"max abs err {r['max_abs']:.3e} > bound {r['bound']:.3e} "
                           f"(2 x baseline {r['baseline_abs']:.3e} "
                           f"[{r.get('baseline_variant', '')}] + floor {r['floor']:.2e}), "
                           f"worst at {r['worst_index']}")
            for name, r in judged.items() if not r["passed"])
    return rec


def not_available_record(spec, status, why):
    """One record standing for every case of a kernel that cannot run."""
    return {"id": f"{spec.name}/*", "kernel": spec.name, "family": spec.family,
            "kind": spec.kind, "shape": "*", "fixture": "*", "seed": None, "dtype": "*",
            "status": status, "passed": False, "detail": str(why)[-2000:]}
