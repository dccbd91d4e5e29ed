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
from attention.core.device import SIMULATOR, gpu_available  # noqa: E402
from validation import simfast  # noqa: E402

simfast.install()  # and the simulator's faster machinery (a no-op without the simulator)

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


# Tests that took 7 s or more each on a machine without a GPU, and some cheaper ones
# trimmed for CI time (below): skipped there by default to keep the test command's CI
# run short, with this reason. The seconds are SLOW_SIM's as measured with two workers
# on two cores after validation/simfast.py made the simulator faster (each entry the
# slowest test it matches); SLOW_COMPILE's are older. With a GPU they all run (plain
# process), and without one with ATTN_TEST_FULL=1. What stays: each suite keeps a
# planted defect caught on the simulator; each kernel family keeps compile-only PTX
# checks of its production form; of the per-switch PTX checks, one switch of each
# kind (main-kernel precision, combine, ring) stays. (The tensor-core tests of
# test_mla_mma, test_registry_mma and test_decode_plan_mma run again since the
# simulator's warp collectives and mma stand-in got 5-8x faster, but for the three
# below: each has a sibling that stays.)
SLOW_SIM = {
    "tests/test_mla_mma.py::test_decode_graph_gives_mla_decode_bits": 6,
    "tests/test_mla_mma.py::test_mla_decode_mma_matches_the_oracle[*": 5,
    "tests/test_mla_mma.py::test_contiguous_matches_the_oracle[3-lens2-64-3]": 4,
    "tests/test_decode_paged.py::test_paged_suite_clean_passes": 45,
    "tests/test_decode_fp8.py::test_per_tensor_case_judged_in_the_kernels_order": 22,
    "tests/test_gemm_defects.py::test_suite_clean_run_passes": 19,
    "tests/test_mla_long_bench.py::test_rows_at_a_tiny_shape": 18,
    "tests/test_decode_fast_defects.py::test_gpu_production_plan_on_simulator[f32-lens1]": 10,
    "tests/test_gemm_defects.py::test_gross_defect_caught_by_suite[k_slice_dropped-*": 12,
    "tests/test_gemm_defects.py::test_gross_defect_caught_by_suite[k_tail_dropped-*": 14,
    "tests/test_mla_chunking.py::test_chunked_decode_equals_unchunked[gemm_fma-float32]": 7,
    "tests/test_mla_chunking.py::test_chunked_decode_equals_unchunked[gemm-float32]": 7,
    "tests/test_decode_paged.py::test_batch_invariant_plan_is_the_same_eager_graph_*": 8,
    "tests/test_decode_fast_defects.py::test_suite_catches_gross_defect[combine_drops_split]": 9,
    "tests/test_decode_fast_defects.py::test_suite_catches_gross_defect[one_short]": 10,
    "tests/test_mla_chunking.py::test_chunks_keep_the_tensor_core_gemms[float32]": 7,
    "tests/test_decode_multi.py::test_pooled_multi_token_matches_the_oracle[float16-2]": 7,
    "tests/test_decode_plan.py::test_run_matches_oracle[s22]": 9,
    "tests/test_gemm_defects.py::test_q_bf16_measurable": 7,
    "tests/test_decode_paged.py::test_paged_suite_catches_each_defect[causal_off_by_one]": 10,
    "tests/test_decode_fast_defects.py::test_suite_catches_gross_defect[slot_off_by_one]": 11,
    "tests/test_decode_paged.py::test_batch_invariant_plans_give_a_sequence_the_same_bits[True]":
        4,
    # the paged sibling (the graph too) stays
    "tests/test_mla_mma.py::test_batch_invariant_mma_gives_a_sequence_the_same_bits[False]": 14,
    "tests/test_mla_chunking.py::test_decode_graph_chunked_equals_mla_decode": 11,
    "tests/test_mla_chunking.py::test_chunked_decode_equals_unchunked[gemm-float16]": 9,
    "tests/test_mla_chunking.py::test_chunks_keep_the_tensor_core_gemms[float16]": 6,
    "tests/test_decode_fast.py::test_small_matches_oracle[s6]": 5,
    "tests/test_gemm_defects.py::test_gross_defect_caught_by_suite[softmax_not_normalised-prefill]":
        11,
    "tests/test_decode_fast_defects.py::test_suite_catches_gross_defect[gqa_mod]": 11,
    "tests/test_mla_decode_graph.py::test_runs_match_mla_decode_and_follow_buffers[float16]": 6,
    "tests/test_mla_kernels.py::test_decode_stepwise_through_cache[nh4_dn24_p8_v32_r64]": 5,
    "tests/test_decode_multi.py::test_paged_multi_token_matches_the_oracle[NHD-4]": 6,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float32-16-NHD]":
        3,
    # trimmed for CI time (the siblings that stay: pipeline stages 0 / 2 / 3 once each;
    # the paged plan at pages of 1, 3, 4 and 16 once each, HND and NHD, float32 and
    # float16; five of the paged suite's switches; two registry mma entries; two fp8
    # step modes; the tensor-core MLA GEMM in float32)
    "tests/test_decode_fast.py::test_pipeline_stages_match_oracle[s3-2]": 2,
    "tests/test_decode_fast.py::test_pipeline_stages_match_oracle[s3-3]": 3,
    "tests/test_decode_fast.py::test_pipeline_stages_match_oracle[s9-0]": 5,
    "tests/test_decode_fast.py::test_pipeline_stages_match_oracle[s9-3]": 5,
    "tests/test_decode_fast.py::test_pipeline_stages_match_oracle[s12-0]": 4,
    "tests/test_decode_fast.py::test_pipeline_stages_match_oracle[s12-2]": 3,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float32-1-NHD]":
        2,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float32-3-*":
        2,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float32-4-NHD]":
        2,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float32-16-*":
        3,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float16-1-*":
        3,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float16-3-HND]":
        2,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float16-4-*":
        3,
    "tests/test_decode_paged.py::test_paged_matches_the_oracle_and_the_pooled_plan[float16-16-HND]":
        3,
    "tests/test_decode_paged.py::test_paged_suite_catches_each_defect[page_off_by_one]": 5,
    "tests/test_decode_paged.py::test_paged_suite_catches_each_defect[page_offset_stride]": 5,
    "tests/test_decode_step_fp8.py::test_fp8_steps_track_the_reference_quantizer_and_a_*[tensor-graph]":
        4,
    "tests/test_decode_step_fp8.py::test_fp8_steps_track_the_reference_quantizer_and_a_*[token_head-eager]":
        4,
    "tests/test_mla_gemm.py::test_gemm_path_tensor_cores[float16]": 5,
    "tests/test_decode_multi.py::test_each_query_is_the_one_query_plan_on_its_prefix": 11,
    # the fp8 latent cache: the kernel's bits tests at length 20 stay (both modes; an
    # entry "[tensor]" here matched no test id since the rank and row-group parameters
    # came); the length-130 case (two whole tiles at rank 256 / RG 4) is skipped. Its
    # suite, defects, growth, registry cases and the paged and contiguous per-token
    # bits run again since the simulator got faster (validation/simfast.py: 1 to 5 s
    # each, from 35 to 90)
    "tests/test_mla_fp8.py::test_fp8_kernel_gives_the_fp16_kernel_bits[token-256-4-130]": 16,
    "tests/test_mla_fp8.py::test_fp8_decode_gives_the_fp16_cache_bits_on_whole_tiles[*": 10,
    "tests/test_mla_fp8.py::test_decode_graph_reads_the_scales_in_place": 9,
    # the MLA tensor-core and fp8 kernels (each has the sibling named)
    # rank 256 direct: fp8_kernel_gives_the_fp16_kernel_bits[tensor-256-*] stays
    "tests/test_mla_fp8.py::test_codes_read_in_registers_give_the_fp16_kernel_bits[256-2-None-1]":
        22,
    # pages of 16 (a page-table read a row): pages of 64 ([128-4-64-2]) stay
    "tests/test_mla_fp8.py::test_codes_read_in_registers_give_the_fp16_kernel_bits[128-2-16-1]":
        13,
    # one split: [128-1-None-2] (two) stays
    "tests/test_mla_fp8.py::test_codes_read_in_registers_give_the_fp16_kernel_bits[128-1-None-1]":
        8,
    # the layout switches' bits: the suite catches each under its codes_* name
    # (test_suite_catches_each_defect), fp8_as_e5m2 there too; fp8_no_scale stays
    "tests/test_mla_fp8.py::test_codes_read_in_registers_planted_defects_change_the_bits["
    "ldmatrix_no_trans]": 9,
    "tests/test_mla_fp8.py::test_codes_read_in_registers_planted_defects_change_the_bits["
    "v_block_stride]": 10,
    "tests/test_mla_fp8.py::test_codes_read_in_registers_planted_defects_change_the_bits["
    "swizzle_off_by_one]": 10,
    "tests/test_mla_fp8.py::test_codes_read_in_registers_planted_defects_change_the_bits["
    "fp8_as_e5m2]": 9,
    # level 1 (S on wgmma): level 2 does S on wgmma too, and stays
    "tests/test_mla_wgmma.py::test_wgmma_kernel_gives_the_mma_sync_bits_on_the_simulator[f16-1]":
        19,
    # the swizzle switch: ldmatrix_no_trans at 64 and v_block_stride at 128 stay
    "tests/test_mla_wgmma.py::test_planted_defects_change_the_wgmma_kernel_bits["
    "swizzle_off_by_one-64]": 11,
    # paged (True): the contiguous form (False) stays
    "tests/test_decode_plan_mma.py::test_batch_invariant_mma_plans_give_a_sequence_the_same_"
    "bits[True]": 9,
    # non-causal: the causal case stays; d32 with a partial tile: the other cases stay
    "tests/test_prefill_mma.py::test_warps_a_block_do_not_change_a_bit[False]": 8,
    "tests/test_prefill_mma.py::test_matches_the_oracle[full-d32-partial-tile]": 13,
}
SLOW_COMPILE = {
    "tests/test_decode_plan_mma.py::test_checked_kernel_compiles_with_its_range_check[None]": 8,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[gqa_mod]": 22,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[one_short]": 22,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[slot_off_by_one]":
        23,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[combine_drops_*":
        25,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[split_off_by_*": 24,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[scale_fp16]": 23,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[lse_fp16]": 23,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[max_fp16]": 22,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[q_bf16]": 22,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[p_bf16]": 22,
    "tests/test_decode_fp8.py::test_token_head_kernel_compiles[HND-64-16]": 20,
    "tests/test_decode_fp8.py::test_token_head_kernel_compiles[NHD-128-32]": 18,
    "tests/test_decode_paged.py::test_paged_kernels_compile[f16-cp.async.cg.shared.global-NHD]":
        11,
    "tests/test_decode_fp8.py::test_fp8_kernel_compiles_with_the_e4m3_conversion[None-fp8_*": 8,
    # (both launch forms: one_launch, k_split; float16-znk stays for each)
    "tests/test_mla_gemm.py::test_compile_sgemm[*-float16-zkn]": 6,
    "tests/test_mla_gemm.py::test_compile_sgemm[*-float32-znk]": 6,
    "tests/test_mla_gemm.py::test_compile_sgemm[*-float32-zkn]": 6,
    # the MLA tensor-core kernel's register checks: the paged form of each stays
    "tests/test_mla_mma.py::test_row_groups_4_keep_the_tile_loop_in_registers[tensor-None]": 19,
    "tests/test_mla_mma.py::test_row_groups_4_keep_the_tile_loop_in_registers[token-None]": 7,
    "tests/test_mla_fp8.py::test_fp8_kernel_compiles_without_local_memory[tensor-512-4-False]":
        18,
    "tests/test_decode_fast.py::test_compile_ptx[f32-bf16-128-cp.async.cg.shared.global]": 7,
    "tests/test_gemm_defects.py::test_switch_compiles[sgemm-k_tail_dropped]": 6,
    "tests/test_decode_fast_defects.py::test_production_ptx_has_no_mutant_rounding[buffers]": 20,
    "tests/test_decode_fast_defects.py::test_production_ptx_has_no_mutant_rounding[scalar]": 20,
    "tests/test_decode_fp8.py::test_fp8_kernel_compiles_with_the_e4m3_conversion[HND-None-*": 12,
    "tests/test_decode_multi.py::test_multi_token_kernels_compile[f32]": 7,
    "tests/test_decode_plan.py::test_checked_kernel_compiles_without_spills[bf16]": 7,
    "tests/test_decode_mma.py::test_compiles_to_mma_ldmatrix_and_cp_async_without_local_*NHD]": 7,
    "tests/test_decode_fast.py::test_compile_ptx[f32-f16-128-cp.async.cg.shared.global]": 7,
    "tests/test_decode_fast.py::test_compile_ptx[cache-bf16-128-cp.async.cg.shared.global]": 7,
    "tests/test_decode_fast_defects.py::test_each_switch_compiles_where_it_acts[exp_approx]": 15,
}
TEST_FULL = os.environ.get("ATTN_TEST_FULL") == "1"


def _slow(nodeid, table):
    """The seconds ``table`` gives ``nodeid`` (its keys: node ids, ``*`` a
    wildcard, brackets literal), or None."""
    import fnmatch

    for pattern, seconds in table.items():
        if fnmatch.fnmatchcase(nodeid, pattern.replace("[", "[[]")):
            return seconds
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not GPU and not TEST_FULL:
            seconds = _slow(item.nodeid, SLOW_SIM if SIM else SLOW_COMPILE)
            if seconds is not None:
                item.add_marker(pytest.mark.skip(
                    reason=f"slow without a GPU (~{seconds} s): runs on a GPU, and here with "
                           f"ATTN_TEST_FULL=1"))
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
        xfail = getattr(report, "wasxfail", None)  # an expected failure: its reason
        if xfail is not None:  # pytest reports it as skipped (failed) or passed (passed)
            outcome, detail = ("xfailed" if report.skipped else "xpassed"), xfail
        else:
            outcome = report.outcome
            detail = (str(report.longrepr)[-2000:] if report.outcome == "failed"
                      else (report.longrepr[2] if report.skipped
                            and isinstance(report.longrepr, tuple) else ""))
        _outcomes.append({"test": report.nodeid, "outcome": outcome,
                          "seconds": round(report.duration, 4), "detail": detail})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("ATTN_TEST_REPORT")
    if path and not hasattr(session.config, "workerinput"):  # pytest-xdist: controller only
        with open(path, "w") as f:
            json.dump({"mode": MODE, "exitstatus": int(exitstatus),
                       "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "tests": _outcomes}, f, indent=1)


def storage_dtype(name, why="the CUDA simulator has no bfloat16"):
    """The numpy dtype of a cache dtype name; bfloat16 skips the test on the
    simulator (``why``), which has no bfloat16."""
    import numpy as np

    from attention.core.device import BFLOAT16

    if name == "bfloat16":
        if MODE == "sim":
            pytest.skip(why)
        return BFLOAT16
    return np.dtype(name)


# ---- no host copy, allocation or synchronisation (decode plan and state) ----

FORBIDDEN = []


@pytest.fixture
def no_host_traffic(monkeypatch):
    """Every copy, allocation and synchronisation entry point raises."""
    from numba import cuda

    from attention.core import device
    from attention.decode import api, fast, plan, step

    def forbid(what):
        def raiser(*args, **kwargs):
            FORBIDDEN.append(what)
            raise AssertionError(f"{what} called")
        return raiser

    for name in ("to_device", "synchronize", "device_array", "device_array_like",
                 "pinned_array", "mapped_array", "as_cuda_array"):
        monkeypatch.setattr(cuda, name, forbid(f"numba.cuda.{name}"), raising=False)
    for mod in (device, fast, plan, api, step):
        for name in ("to_device", "to_host", "host_ints", "device_empty", "device_fill",
                     "finish", "as_device_view"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, forbid(f"{mod.__name__}.{name}"))
    names = ["copy_to_host", "copy_to_device", "__array__", "tolist"]
    if SIMULATOR:  # a simulated kernel indexes its arrays on the host: that stays
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as Arr
    else:  # an element read on the host is a copy
        from numba.cuda.cudadrv.devicearray import DeviceNDArrayBase as Arr

        names += ["__getitem__", "__setitem__"]
    for name in names:
        monkeypatch.setattr(Arr, name, forbid(f"device array {name}"), raising=False)
    FORBIDDEN.clear()
    yield FORBIDDEN
