"""Test modes and markers.

The suite runs in two pytest processes (``scripts/test``):

* plain: oracle tests, compile-only PTX tests (``compile``), bad-input tests,
  and, on a GPU machine, every kernel-executing test (``device``, ``gpu``);
* simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is imported):
  ``device`` tests at small shapes and ``sim`` tests of the warp intrinsics.

``MODE`` is "sim", "gpu", "gpu-small" (a GPU with ATTN_SMALL_SHAPES=1) or "cpu".
Tests that size themselves use ``small()`` (or ``MODE == "gpu"`` for full shapes).
When ``ATTN_TEST_REPORT`` names a file, per-test outcomes are written there as
JSON (``scripts/gpu_test`` reads it).
"""

from __future__ import annotations

import json
import os
import time

import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

import attention  # noqa: E402,F401  (installs the simulator's warp intrinsics)
from attention.core.device import gpu_available  # noqa: E402

GPU = gpu_available()
# ATTN_SMALL_SHAPES=1 on a GPU runs the device tests at the simulator's small
# shapes ("gpu-small": for compute-sanitizer, which slows kernels 10-100x);
# `gpu`-marked full-shape tests are skipped then.
SMALL_ON_GPU = GPU and os.environ.get("ATTN_SMALL_SHAPES") == "1"
MODE = "sim" if SIM else ("gpu-small" if SMALL_ON_GPU else ("gpu" if GPU else "cpu"))


def small():
    """True where kernels run on the simulator: use the reduced shapes."""
    return MODE != "gpu"


def pytest_report_header(config):
    from attention.core.device import device_name

    return f"attention test mode: {MODE} (device: {device_name()})"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "compile" in item.keywords and SIM:
            item.add_marker(pytest.mark.skip(
                reason="compile-only: compile_ptx does not exist under the simulator; "
                       "runs in the plain process"))
        if "sim" in item.keywords and not SIM:
            item.add_marker(pytest.mark.skip(
                reason="tests the simulator's warp intrinsics: runs in the simulator process"))
        if "gpu" in item.keywords and MODE != "gpu":
            item.add_marker(pytest.mark.skip(
                reason="full-shape GPU test: skipped with ATTN_SMALL_SHAPES=1" if SMALL_ON_GPU
                else "needs a CUDA GPU (none here); the simulator process covers the "
                     "small-shape versions"))
        elif "device" in item.keywords and MODE == "cpu":
            item.add_marker(pytest.mark.skip(
                reason="executes kernels: no GPU here, so it runs in the simulator process"))


_outcomes = []


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes.append({
            "test": report.nodeid,
            "outcome": report.outcome,
            "seconds": round(report.duration, 4),
            "detail": (str(report.longrepr)[-2000:] if report.outcome == "failed"
                       else (report.longrepr[2] if report.skipped
                             and isinstance(report.longrepr, tuple) else "")),
        })


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("ATTN_TEST_REPORT")
    if path and not hasattr(session.config, "workerinput"):  # pytest-xdist: controller only
        with open(path, "w") as f:
            json.dump({"mode": MODE, "exitstatus": int(exitstatus),
                       "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "tests": _outcomes}, f, indent=1)
