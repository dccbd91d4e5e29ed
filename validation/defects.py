"""Planted-defect score: run every family's falsification suite, clean and with
each of its planted defects, and count what was caught.

Suites follow ``validation/suite.py``: a module ``validation/suite_<family>.py``
with ``FAMILY``, ``DEFECTS`` and ``run_suite(defect=None, *, small=True) ->
list[Check]``. They are discovered by file name (``discover``); more can be
named by import path (``--suite-module``).

For each family:

* the clean run ``run_suite(None)`` must return only passing checks (else the
  suite, or the kernel, is wrong and nothing it says about defects counts);
* each defect ``d`` is *caught* when ``run_suite(d)`` returns at least one
  failing check (``validation.suite.caught``) and *escaped* when every check
  passes. A suite that raises instead of returning checks is an *error*: a
  crash is not a detection (it may come from the harness, not the defect).

A family passes when its clean run passes and every defect is caught; any
escaped defect, error or failing clean run fails the whole validation run.
The work is split into units ``(module, defect-or-None)`` so shards and worker
processes can share it.
"""

from __future__ import annotations

import importlib
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from validation.suite import caught

SUITE_DIR = Path(__file__).resolve().parent
SUITE_PREFIX = "suite_"


def discover(directory=SUITE_DIR, package="validation"):
    """Import paths of the suite modules in ``directory`` (sorted by name)."""
    return [f"{package}.{p.stem}" for p in sorted(Path(directory).glob(f"{SUITE_PREFIX}*.py"))]


@dataclass(frozen=True)
class DefectUnit:
    module: str
    defect: object  # None: the clean run
    small: bool

    @property
    def id(self):
        return f"defects/{self.module}/{self.defect or 'clean'}"


def load(module):
    """(module object, None) or (None, traceback text)."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a suite that does not import fails the run
        return None, traceback.format_exc(limit=4)
    missing = [a for a in ("FAMILY", "DEFECTS", "run_suite") if not hasattr(mod, a)]
    if missing:
        return None, f"{module} does not follow validation/suite.py: missing {', '.join(missing)}"
    return mod, None


def units(modules, *, small, family_filter=None):
    """(units, broken): the units of every suite module; ``broken`` holds a family
    record for each module that could not be loaded."""
    out, broken = [], []
    for name in modules:
        mod, err = load(name)
        if mod is None:
            broken.append({"family": name.rsplit(".", 1)[-1].removeprefix(SUITE_PREFIX),
                           "module": name, "status": "broken", "planted": 0, "caught": 0,
                           "escaped": [], "errors": [err], "clean_ok": False, "defects": {},
                           "passed": False, "seconds": 0.0})
            continue
        if family_filter and not family_filter(mod.FAMILY):
            continue
        out.append(DefectUnit(name, None, small))
        out.extend(DefectUnit(name, d, small) for d in mod.DEFECTS)
    return out, broken


def run_unit(unit):
    """Run one suite call; returns {module, family, defect, status, failing, seconds}.

    status: "clean" (all checks pass with no defect), "clean-fail", "caught",
    "escaped" or "error"."""
    rec = {"id": unit.id, "module": unit.module, "defect": unit.defect}
    mod, err = load(unit.module)
    if mod is None:
        rec.update(family=unit.module, status="error", failing=[], detail=err, seconds=0.0)
        return rec
    rec["family"] = mod.FAMILY
    start = time.perf_counter()
    try:
        checks = list(mod.run_suite(unit.defect, small=unit.small))
    except Exception:  # noqa: BLE001
        rec.update(status="error", failing=[], detail=traceback.format_exc(limit=6)[-3000:],
                   seconds=time.perf_counter() - start)
        return rec
    rec["seconds"] = time.perf_counter() - start
    failing = [{"name": c.name, "detail": str(c.detail)[:300]} for c in checks if not c.passed]
    rec["n_checks"] = len(checks)
    rec["failing"] = failing
    if unit.defect is None:
        rec["status"] = "clean" if checks and not failing else "clean-fail"
        rec["detail"] = "" if checks else "the suite returned no checks"
    else:
        rec["status"] = "caught" if caught(checks) else "escaped"
        rec["detail"] = ""
    return rec


def aggregate(unit_records, broken=()):
    """Per-family score from unit records: list of family dicts with planted,
    caught, escaped, errors, clean_ok, passed, defects {name: status}, seconds."""
    families = {}
    for r in unit_records:
        fam = families.setdefault(r["family"], {
            "family": r["family"], "module": r["module"], "planted": 0, "caught": 0,
            "escaped": [], "errors": [], "clean_ok": None, "defects": {}, "seconds": 0.0})
        fam["seconds"] += r.get("seconds", 0.0)
        if r["defect"] is None:
            fam["clean_ok"] = r["status"] == "clean"
            if r["status"] == "clean-fail":
                fam["errors"].append("clean run: " + (r.get("detail") or "; ".join(
                    f"{c['name']}: {c['detail']}" for c in r["failing"][:5])))
            elif r["status"] == "error":
                fam["errors"].append("clean run raised: " + r.get("detail", "")[-800:])
            continue
        fam["planted"] += 1
        fam["defects"][r["defect"]] = r["status"]
        if r["status"] == "caught":
            fam["caught"] += 1
        elif r["status"] == "escaped":
            fam["escaped"].append(r["defect"])
        else:
            fam["errors"].append(f"{r['defect']} raised: " + r.get("detail", "")[-800:])
    out = []
    for fam in families.values():
        fam["status"] = "pass" if (fam["clean_ok"] and not fam["escaped"]
                                   and not fam["errors"]) else "fail"
        fam["passed"] = fam["status"] == "pass"
        out.append(fam)
    out.extend(dict(b) for b in broken)
    return sorted(out, key=lambda f: f["family"])
