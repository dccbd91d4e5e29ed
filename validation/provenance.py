"""Provenance stamped on every report: which code, which machine, which packages.

``kernel_source_hash()`` hashes the kernel packages' Python sources
(``attention/`` and ``mla/``, sorted by path, path and bytes both hashed), so a
report can be matched to the code it measured: a committed report whose hash
differs from the working tree's is stale. ``criterion_hash()`` does the same
for the code that judges (``CRITERION_FILES``: the rule, the baselines, the
metrics, the fixtures, the registry and the runs that apply them): a
validation report judged under another rule is stale too. ``suites_hash()``
hashes the defect suites the validation runs (``validation/suite.py``,
``validation/suite_*.py``, ``validation/defects.py``: their cases and checks,
clean and with each planted defect). A change there does not make a report
stale (the sweep and growth it holds are still the tree's), but
``scripts/validate --check-fresh`` notes it.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_PACKAGES = ("attention", "mla")
CRITERION_FILES = ("validation/tolerance.py", "validation/baselines.py", "validation/metrics.py",
                   "validation/fixtures.py", "validation/registry.py", "validation/sweep.py",
                   "validation/growth.py")


def kernel_sources(root=ROOT):
    files = []
    for pkg in KERNEL_PACKAGES:
        files.extend(sorted((root / pkg).rglob("*.py")))
    return files


def _hash_files(paths, root):
    h = hashlib.sha256()
    for path in paths:
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def kernel_source_hash(root=ROOT):
    return _hash_files(kernel_sources(root), root)


def criterion_hash(root=ROOT):
    return _hash_files([root / f for f in CRITERION_FILES], root)


def suite_files(root=ROOT):
    """The defect suites' sources: the contract, the runner and every family's suite."""
    v = root / "validation"
    return [v / "suite.py", v / "defects.py", *sorted(v.glob("suite_*.py"))]


def suites_hash(root=ROOT):
    return _hash_files(suite_files(root), root)


def git_commit(root=ROOT):
    """HEAD (+dirty when kernel sources differ from it); ``ATTN_GIT_COMMIT``
    stands in where the tree was copied without its .git (the GPU machine)."""
    import os

    if os.environ.get("ATTN_GIT_COMMIT"):
        return os.environ["ATTN_GIT_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *KERNEL_PACKAGES],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions():
    import numpy

    out = {"python": platform.python_version(), "numpy": numpy.__version__}
    try:
        import numba

        out["numba"] = numba.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        out["numba-cuda"] = version("numba-cuda")
    except Exception:
        pass
    try:
        import torch

        out["torch"] = torch.__version__
    except Exception:
        pass
    return out


def provenance(**extra):
    from attention.core.device import device_name

    rec = {
        "git_commit": git_commit(),
        "kernel_source_hash": kernel_source_hash(),
        "criterion_hash": criterion_hash(),
        "suites_hash": suites_hash(),
        "device": device_name(),
        "versions": versions(),
        "host": platform.node(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    rec.update(extra)
    return rec


LOG_HEADER = "# gpu_all "


def log_header(stage):
    """The first line ``scripts/gpu_all`` writes to a stage's log: the stage and
    this run's provenance, one JSON line (``validation.gpu_reports`` reads it)."""
    import json

    return f"{LOG_HEADER}{stage}: {json.dumps(provenance(), sort_keys=True)}"


if __name__ == "__main__":  # python -m validation.provenance [--log-header STAGE]
    import json
    import sys

    if sys.argv[1:2] == ["--log-header"] and len(sys.argv) == 3:
        print(log_header(sys.argv[2]))
    elif len(sys.argv) == 1:
        print(json.dumps(provenance(), indent=1))
    else:
        sys.exit("usage: python -m validation.provenance [--log-header STAGE]")
