"""The PTX property that tells a correct online softmax from a stuck rescale.

Compile-only (no GPU): ``validation.ptx_check`` on the PTX NVVM emits for our
kernels, plus hand-written PTX controls so the checker is shown able to fire,
able to pass, and unable to pass vacuously.
"""

from __future__ import annotations

import pytest

from validation.ptx_check import check_rescale, exponent_terms, parse

# The correct update as NVVM spells it (fastmath): max, then exp(old - new) and exp(s - new).
GOOD = """
\tmax.ftz.f32 \t%f129, %f114, %f81;
\tsub.ftz.f32 \t%f82, %f114, %f129;
\tmul.ftz.f32 \t%f83, %f82, 0f3FB8AA3B;
\tex2.approx.ftz.f32 \t%f24, %f83;
\tsub.ftz.f32 \t%f84, %f81, %f129;
\tmul.ftz.f32 \t%f85, %f84, 0f3FB8AA3B;
\tex2.approx.ftz.f32 \t%f25, %f85;
"""
# The defect: the max overwrote the old max, the rescale subtracts the new max from itself.
SELF_SUB = GOOD.replace("%f129, %f114, %f81", "%f129, %f129, %f81").replace(
    "%f82, %f114, %f129", "%f82, %f129, %f129")
# The defect constant-folded: exp(0) == 1 leaves only the score's chain.
FOLDED = "\n".join(line for line in SELF_SUB.splitlines()
                   if "%f82" not in line and "%f83" not in line and "%f24" not in line)


def test_parse_reads_the_four_float_ops():
    ops = [op for op, *_ in parse(GOOD)]
    assert ops == ["max", "sub", "mul", "ex2.approx", "sub", "mul", "ex2.approx"]
    assert sorted(exponent_terms(parse(GOOD))) == [("%f114", "%f129"), ("%f81", "%f129")]


def test_accepts_the_correct_update():
    result = check_rescale(GOOD)
    assert result.passed and result.inspected == 1, result.detail


@pytest.mark.parametrize("ptx", [SELF_SUB, FOLDED], ids=["self_subtraction", "folded"])
def test_fires_on_the_stuck_rescale(ptx):
    result = check_rescale(ptx)
    assert not result.passed and "stuck rescale" in result.detail, result.detail


@pytest.mark.parametrize("ptx", [
    "",
    "\tadd.f32 \t%f1, %f2, %f3;\n",
    "\tmax.ftz.f32 \t%f1, %f2, %f3;\n",  # a max but no exponential
    "\tex2.approx.ftz.f32 \t%f1, %f2;\n",  # an exponential but no max
    # a max (a warp reduction) and an exponential that do not meet
    "\tmax.ftz.f32 \t%f1, %f2, %f3;\n\tmul.ftz.f32 \t%f5, %f4, 0f3FB8AA3B;\n"
    "\tex2.approx.ftz.f32 \t%f6, %f5;\n",
], ids=["empty", "no_softmax", "max_only", "ex2_only", "unrelated"])
def test_nothing_to_inspect_fails(ptx):
    result = check_rescale(ptx)
    assert not result.passed and "nothing to inspect" in result.detail, result.detail


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["batched_decode", "flash_decode_chunk"])
@pytest.mark.parametrize("pointers", [False, True], ids=["pooled", "pointer_table"])
def test_correct_kernels_pass(kind, pointers):
    """The batched kernel and its split-KV sibling stay green."""
    from validation.ptx_check import kernel_ptx

    result = check_rescale(kernel_ptx(kind, None, pointers=pointers))
    assert result.passed and result.inspected >= 1, result.detail


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["batched_decode", "flash_decode_chunk"])
def test_planted_stuck_rescale_fails(kind):
    """Positive control on real PTX: the defect's kernel, same source, one switch."""
    from validation.ptx_check import kernel_ptx

    result = check_rescale(kernel_ptx(kind, "stuck_rescale"))
    assert not result.passed and "stuck rescale" in result.detail, result.detail


@pytest.mark.compile
@pytest.mark.parametrize("defect", ["gqa_mod", "slot_off_by_one", "batch_max_len"])
def test_other_defects_do_not_trip_the_ptx_property(defect):
    """The property is about the rescale only: indexing defects keep a correct update."""
    from validation.ptx_check import kernel_ptx

    assert check_rescale(kernel_ptx("batched_decode", defect)).passed


@pytest.mark.compile
def test_combine_kernel_has_nothing_to_inspect():
    """The combine kernel (no fastmath: libdevice exp, range-reduced) is not in
    the property's shape: the check says so rather than passing it."""
    from numba import cuda, float32

    from attention.reference.split_decode import flash_decode_combine_kernel

    kernel = flash_decode_combine_kernel(4)
    ptx, _ = cuda.compile_ptx(kernel.py_func, (
        float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, ::1],
        float32[:, ::1]), cc=(9, 0))
    result = check_rescale(ptx)
    assert not result.passed and "nothing to inspect" in result.detail, result.detail
