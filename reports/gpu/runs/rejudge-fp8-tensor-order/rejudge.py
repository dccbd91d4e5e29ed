"""Re-judge GPU-recorded ``decode_fp8`` cases (the fast decode over an fp8 cache,
one scale per tensor) under the kernel's order ``decode_fast_c`` (offline).

    PYTHONPATH=<repo> python rejudge.py SRC_validation.json OUT.json

For each recorded case (pass or fail) the case's inputs are rebuilt
(``registry.make_inputs`` + ``fixtures.fp8_quantize``), and the max and mean
bounds of both orders are computed on the CPU: ``old`` (``decode_fast``: the
sum over the dequantized rows, the label the run recorded) and ``new`` (the
registry's label now). The kernel's recorded errors are divided by each;
``old`` reproducing the recorded margins checks the method.
"""
import json
import sys

import numpy as np

from validation import baselines, fixtures, registry, tolerance
from validation.report import read  # validation.json or an archived .json.gz
from validation.sweep import _cast_inputs, _float_names

src, out_path = sys.argv[1], sys.argv[2]
cases = [c for c in read(src)["cases"]
         if c["kernel"] == "decode_fp8" and c["status"] in ("pass", "fail")]
rows = []
for c in cases:
    spec = registry.KERNELS_BY_NAME[c["kernel"]]
    shape = registry.find_shape(spec.kind, c["shape"], False)
    x = fixtures.fp8_quantize(registry.make_inputs(spec.kind, shape, c["fixture"], c["seed"]),
                              spec.quantize)
    names = spec.storage if c["cast"] == "storage" else _float_names(x)
    used = _cast_inputs(x, names, c["dtype"]) if c["cast"] != "none" else x
    oracle, plain = registry.references(spec.kind, used, c["dtype"])
    new_label = baselines.resolve(spec.baseline, used, np.uint8)
    old_label = baselines.resolve("decode_fast/before/recip_after/ex2", used, np.uint8)
    row = {"id": c["id"], "status": c["status"], "recorded": c["baseline"], "old": old_label,
           "new": new_label}
    verdict = {}
    for tag, lab in (("old", old_label), ("new", new_label)):
        base = baselines.baseline(spec.kind, used, lab, plain)
        ok = True
        for name, ref in oracle.items():
            r = c["outputs"][name]
            b, mb = tolerance.budget(ref, base[name]), tolerance.mean_budget(ref, base[name])
            row[f"{tag}_{name}_margin"] = r["max_abs"] / b if b else 0.0 if not r["max_abs"] \
                else float("inf")
            row[f"{tag}_{name}_mean_margin"] = r["mean_abs"] / mb if mb else 0.0 \
                if not r["mean_abs"] else float("inf")
            ok &= r["max_abs"] <= b and r["mean_abs"] <= mb and r["nonfinite_ok"]
        verdict[tag] = "pass" if ok else "fail"
    row["old_verdict"], row["new_verdict"] = verdict["old"], verdict["new"]
    row["rec_margin"], row["rec_mean_margin"] = c.get("margin"), c.get("mean_margin")
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(out_path, "w"), indent=1)
moved = [r["id"] for r in rows if r["old_verdict"] != r["new_verdict"]]
print(f"{len(rows)} cases; verdicts moved: {moved or 'none'}")
