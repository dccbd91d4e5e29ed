"""A codegen property of the online softmax, checked on PTX with no GPU.

The defect this project exists to catch is an online-softmax update whose
rescale factor is stuck at 1.0: the running max is overwritten before
``exp(old_max - new_max)`` is formed, so the rescale computes
``exp(new_max - new_max)``. In the PTX NVVM emits for our kernels (fastmath)
the correct update reads::

    max.ftz.f32  %N, %A, %B          new max of the old max and the score
    sub.ftz.f32  %D, %A, %N          old max - new max
    mul.ftz.f32  %X, %D, 0f3FB8AA3B  * log2(e)
    ex2.approx.ftz.f32 %Y, %X        the rescale factor alpha
    (and the same chain from %B: the new score's weight p)

With the defect, the first chain is ``sub %D, %N, %N`` (a self-subtraction)
or is constant-folded away entirely, leaving only the score's chain.

The property: locate every ``max`` whose result ``N`` is subtracted in a
``sub -> mul -> ex2`` chain (an exponent relative to the new max); for each,
*both* operands of the ``max`` must have their own chain ``exp(operand - N)``,
and neither operand may be ``N`` itself. A PTX text with no such ``max``
(nothing to inspect) fails: the check never passes vacuously.

``kernel_ptx(kind, defect=None, head_dim=128)`` compiles our kernels
(``cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), fastmath=True)``);
``check_rescale(ptx)`` returns a ``RescaleCheck``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# `[@%p1 ]op[.ftz].f32 dst, a[, b];` for the four float ops the property reads.
_INSTR = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(max|sub|mul|ex2\.approx)(?:\.ftz)?\.f32\s+"
    r"(%f\d+)\s*,\s*([^,;\s]+)\s*(?:,\s*([^,;\s]+)\s*)?;")


@dataclass(frozen=True)
class RescaleCheck:
    passed: bool
    detail: str
    inspected: int = 0  # running-max updates whose exponent chains were checked
    findings: tuple = field(default_factory=tuple)


def parse(ptx):
    """The float32 ``max``/``sub``/``mul``/``ex2.approx`` instructions of ``ptx``:
    a list of ``(op, dst, a, b)`` (``b`` None for ``ex2``)."""
    out = []
    for line in ptx.splitlines():
        match = _INSTR.match(line)
        if match:
            op, dst, a, b = match.groups()
            out.append((op, dst, a, b))
    return out


def exponent_terms(instrs):
    """Every ``(x, y)`` such that PTX computes ``ex2((x - y) * c)``: the
    exponentials of differences, i.e. ``exp(x - y)`` under fastmath."""
    ex2_args = {a for op, _, a, _ in instrs if op == "ex2.approx"}
    subs = {dst: (a, b) for op, dst, a, b in instrs if op == "sub"}
    terms = []
    for op, dst, a, b in instrs:
        if op != "mul" or dst not in ex2_args:
            continue
        for operand in (a, b):
            if operand in subs:
                terms.append(subs[operand])
    return terms


def check_rescale(ptx):
    """Does every online-softmax max update rescale by ``exp(saved_old_max - new_max)``?"""
    instrs = parse(ptx)
    maxes = [(dst, a, b) for op, dst, a, b in instrs if op == "max"]
    has_ex2 = any(op == "ex2.approx" for op, *_ in instrs)
    if not maxes or not has_ex2:
        return RescaleCheck(False, (
            f"nothing to inspect: {len(maxes)} max.f32 and "
            f"{'some' if has_ex2 else 'no'} ex2.approx.f32 instructions; this PTX has no "
            f"online-softmax update, so the property cannot be asserted"))
    terms = exponent_terms(instrs)
    findings, failures = [], []
    for new_max, a, b in maxes:
        against = [x for x, y in terms if y == new_max]
        if not against:
            continue  # a max not used as a softmax reference (e.g. a reduction)
        problems = []
        for operand in (a, b):
            if operand == new_max:
                problems.append(f"operand {operand} is the new max itself: the old max was "
                                f"overwritten before the rescale read it")
            elif operand not in against:
                problems.append(f"no exp({operand} - {new_max}) chain: the rescale (or "
                                f"weight) of {operand} against the new max is missing, "
                                f"e.g. folded to a constant")
        if new_max in against:
            problems.append(f"exp({new_max} - {new_max}) is formed: a self-subtraction, "
                            f"the rescale factor is exp(0) == 1")
        finding = (new_max, a, b, tuple(sorted(set(against))), tuple(problems))
        findings.append(finding)
        if problems:
            failures.append(f"max {new_max} = max({a}, {b}): " + "; ".join(problems))
    if not findings:
        return RescaleCheck(False, (
            f"nothing to inspect: {len(maxes)} max.f32 found but none is the reference of an "
            f"exp(x - max) chain (sub -> mul -> ex2.approx); the rescale term was not "
            f"located, so nothing was asserted"))
    if failures:
        return RescaleCheck(False, "stuck rescale: " + " | ".join(failures), len(findings),
                            tuple(findings))
    return RescaleCheck(True, (
        f"{len(findings)} running-max update(s), each rescaling by exp(saved old max - new "
        f"max) and weighting the score by exp(score - new max)"), len(findings), tuple(findings))


# -- our kernels' PTX --------------------------------------------------------

KINDS = ("batched_decode", "flash_decode_chunk")


def kernel_ptx(kind="batched_decode", defect=None, head_dim=128, pointers=False):
    """PTX (sm_90, fastmath) of one of our decode kernels, compiled with no GPU.

    kind: "batched_decode" (``attention.reference.warp_decode.batched_decode_kernel``) or
    "flash_decode_chunk" (``attention.reference.split_decode.flash_decode_chunk_kernel``);
    defect: a planted defect of that kernel; pointers: the per-slot pointer-table
    variant (H_kv 2, max_seq 2048).
    """
    from numba import cuda, float32, int32, uint64

    from attention.reference.warp_decode import batched_decode_kernel, n_chunks
    from attention.reference.split_decode import flash_decode_chunk_kernel

    if cuda.compile_ptx is None:
        raise RuntimeError("kernel_ptx: compile_ptx is unavailable under the CUDA simulator")
    geometry = (2, 2048) if pointers else None
    cache = uint64[::1] if pointers else float32[:, :, :, ::1]
    common = (float32[:, :, ::1], cache, cache, int32[::1], int32[::1], float32)
    if kind == "batched_decode":
        kernel = batched_decode_kernel(n_chunks(head_dim), defect, geometry)
        sig = common + (float32[:, :, ::1], float32[:, ::1])
    elif kind == "flash_decode_chunk":
        kernel = flash_decode_chunk_kernel(n_chunks(head_dim), defect, geometry)
        sig = common + (int32, float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1])
    else:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), fastmath=True)
    return ptx
