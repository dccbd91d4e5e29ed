"""Re-judge GPU-recorded tensor-core decode cases under NORM recip_after (offline).

    python rejudge.py SRC_validation.json OUT.json SECONDS
"""
import json
import sys
import time

from validation import registry, fixtures, baselines, tolerance
from validation.report import read
from validation.sweep import _cast_inputs, _float_names

src, out_path, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
d = read(src)  # validation.json or an archived validation.json.gz
cases = [c for c in d["cases"]
         if c["kernel"].startswith("decode_mma") and c["status"] in ("pass", "fail")]
cases.sort(key=lambda c: -max(c.get("mean_margin") or 0, c.get("margin") or 0))
t0 = time.time()
rows = []
for c in cases:
    if time.time() - t0 > limit:
        break
    spec = registry.KERNELS_BY_NAME[c["kernel"]]
    shape = registry.find_shape(spec.kind, c["shape"], False)
    x = registry.make_inputs(spec.kind, shape, c["fixture"], c["seed"])
    if spec.quantize:
        x = fixtures.fp8_quantize(x, spec.quantize)
    names = spec.storage if c["cast"] == "storage" else _float_names(x)
    used = _cast_inputs(x, names, c["dtype"]) if c["cast"] != "none" else x
    oracle, plain = registry.references(spec.kind, used, c["dtype"])
    storage = used[spec.storage[0]].dtype
    new_label = baselines.resolve(spec.baseline, used, storage)  # the registry's now
    old_label = new_label.replace("/recip_after", "")
    assert new_label != old_label
    row = {"id": c["id"], "status": c["status"], "recorded": c["baseline"], "old": old_label,
           "new": new_label}
    for tag, lab in (("old", old_label), ("new", new_label)):
        base = baselines.baseline(spec.kind, used, lab, plain)
        for name, ref in oracle.items():
            r = c["outputs"][name]
            b, mb = tolerance.budget(ref, base[name]), tolerance.mean_budget(ref, base[name])
            row[f"{tag}_{name}_margin"] = r["max_abs"] / b if b else float("inf")
            row[f"{tag}_{name}_mean_margin"] = r["mean_abs"] / mb if mb else float("inf")
    row["rec_margin"], row["rec_mean_margin"] = c.get("margin"), c.get("mean_margin")
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(out_path, "w"), indent=1)
