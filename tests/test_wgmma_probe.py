"""The wgmma probe (``bench.wgmma_probe``): its host-side layouts, its PTX and ptxas
on ``sm_90a``, and, on a compute-capability-9.0 GPU, the descriptor reading that
gives A @ B exactly."""

from __future__ import annotations

import numpy as np
import pytest

from bench import wgmma_probe as W
from tests.conftest import GPU, SIM


def test_core_layout_puts_each_element_where_the_docstring_says():
    x = np.arange(32 * 16, dtype=np.int64).reshape(32, 16)
    flat = W.core_layout(x)
    for r, k in [(0, 0), (7, 7), (8, 0), (0, 8), (13, 11), (31, 15)]:
        assert flat[(r // 8) * 128 + (k // 8) * 64 + (r % 8) * 8 + k % 8] == x[r, k]
    assert sorted(flat) == sorted(x.ravel())  # a permutation: nothing lost or doubled
    with pytest.raises(ValueError, match=r"x: expected \[8 r, 16 k\]"):
        W.core_layout(np.zeros((12, 16)))
    x = np.arange(16 * 64, dtype=np.int64).reshape(16, 64)  # four K steps: rows 1 KB apart
    flat = W.core_layout(x)
    assert flat[(9 // 8) * 512 + (37 // 8) * 64 + (9 % 8) * 8 + 37 % 8] == x[9, 37]
    assert W.offsets(64) == (128, 1024) and W.offsets(16) == (W.LBO, W.SBO)


@pytest.mark.parametrize("n", [8, 64, 256])
def test_accumulator_index_covers_the_tile_once(n):
    rows, cols = W.accumulator_index(n)
    cells = rows * n + cols
    assert rows.shape == (128, n // 2)
    assert np.array_equal(np.sort(cells.ravel()), np.arange(64 * n))
    # a warp's rows: warp w holds rows 16 w .. 16 w + 15 (the m16n8 layout a warp)
    assert set(rows[32:64].ravel()) == set(range(16, 32))


def test_descriptor_bit_fields():
    d = W.descriptor(0x1230, 128, 256)
    assert d & 0x3FFF == 0x123 and (d >> 16) & 0x3FFF == 8 and (d >> 32) & 0x3FFF == 16
    assert d >> 62 == 0  # no swizzle


def _ptx(kernel, argtypes, cc=(9, 0, "a")):
    from numba import cuda

    return cuda.compile_ptx(kernel.py_func, argtypes, cc=cc)[0]


def _link(ptx, arch):
    from tests.test_prefill_mma import _ptxas_report

    report = _ptxas_report(ptx, arch)
    if report is None:
        pytest.skip("no ptxas: cuda.core (nvJitLink) is not installed")
    return report


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("n", [8, 256])
@pytest.mark.parametrize("a_regs,trans_b", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("kt", [16, 64])
def test_check_kernel_issues_its_wgmma_and_assembles_for_sm90a(kind, n, a_regs, trans_b, kt):
    """The layout kernel's PTX holds the proxy fence and a wgmma of the shape, type,
    A source (a descriptor or four registers) and B transpose asked for (one, or at K
    64 the first and the loop's, which LLVM may unroll), and ptxas
    takes it for sm_90a with no local memory. Control: the same kernel compiled for
    plain sm_90 is rejected by ptxas for its wgmma (which exists on sm_90a only), so
    the check does reach the assembler."""
    from numba import types

    from tests.test_prefill_mma import spill_bytes

    kernel, sig = (W.check_kernel(n, kind, *W.offsets(kt), a_regs, trans_b, kt),
                   (types.uint16[:], types.uint32[:, :, :], types.uint16[:],
                    types.float32[:, :]))
    ptx = _ptx(kernel, sig)
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert len(mmas) == 1 if kt == 16 else len(mmas) in (2, kt // 16), mmas  # rolled or not
    assert all(f".m64n{n}k16.f32.{kind}.{kind} " in m for m in mmas), mmas
    a_operand = mmas[0].split("}, ")[1]
    assert a_operand.startswith("{") == a_regs, mmas[0]  # four registers, or a descriptor
    assert all(m.rstrip().endswith(f", {trans_b};") for m in mmas), mmas
    assert "fence.proxy.async.shared::cta;" in ptx
    assert "wgmma.wait_group.sync.aligned 0;" in ptx
    # the device-side descriptor carries the host form's offset bits
    assert f", {W.descriptor(0, *W.offsets(kt))};" in ptx
    report = _link(ptx, "sm_90a")
    assert spill_bytes(report) == 0, report
    with pytest.raises(Exception, match="wgmma.* not supported on .target 'sm_90'"):
        _link(_ptx(kernel, sig, cc=(9, 0)), "sm_90")


def test_mn_layout_and_a_fragment_place_what_the_docstrings_say():
    x = np.arange(16 * 24, dtype=np.int64).reshape(16, 24)
    flat = W.mn_layout(x)
    for k, c in [(0, 0), (7, 7), (8, 0), (0, 8), (11, 13), (15, 23)]:
        assert flat[(c // 8) * 128 + (k // 8) * 64 + (k % 8) * 8 + c % 8] == x[k, c]
    assert sorted(flat) == sorted(x.ravel())
    words = np.arange(64 * 16, dtype=np.uint16).reshape(64, 16)
    frag = W.a_fragment(words)
    assert frag.shape == (1, 128, 4)
    lo, hi = frag[0] & 0xFFFF, frag[0] >> 16
    assert np.array_equal(hi, lo + 1)  # the next K in the upper half
    t = 32 + 5  # warp 1, lane 5: row 16 + 1, K 2
    assert [int(v) for v in lo[t]] == [words[17, 2], words[25, 2], words[17, 10], words[25, 10]]
    assert sorted(lo.ravel().tolist() + hi.ravel().tolist()) == sorted(words.ravel().tolist())
    wide = np.arange(64 * 32, dtype=np.uint16).reshape(64, 32)
    assert int(W.a_fragment(wide)[1, t, 0] & 0xFFFF) == wide[17, 16 + 2]  # K step 1


@pytest.mark.compile
def test_throughput_kernels_keep_their_accumulators_in_registers():
    """m64n256k16 (128 accumulators a thread) and the mma.sync loop assemble for
    sm_90a without spilling; the wgmma loop issues STEPS wgmma a step."""
    from numba import types

    from tests.test_prefill_mma import spill_bytes

    sig = (types.float32[:], types.int32)
    ptx = _ptx(W.throughput_kernel(256, "f16"), sig)
    assert sum("wgmma.mma_async" in line for line in ptx.splitlines()) >= 1 + W.STEPS
    assert spill_bytes(_link(ptx, "sm_90a")) == 0
    ptx = _ptx(W.mma_sync_kernel("f16"), sig)
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert spill_bytes(_link(ptx, "sm_90a")) == 0


def _cc90():
    if SIM or not GPU:
        return False
    from numba import cuda

    return cuda.get_current_device().compute_capability == (9, 0)


@pytest.mark.skipif(not _cc90(), reason="wgmma runs only on a compute-capability-9.0 GPU "
                    "(sm_90a); the simulator has no inline PTX")
@pytest.mark.parametrize("kind,n,kt", W.LAYOUT_SHAPES)
@pytest.mark.parametrize("a_regs,trans_b", [(False, 0), (True, 0), (True, 1)])
def test_wgmma_gives_a_times_b_exactly(kind, n, kt, a_regs, trans_b):
    """One of the two readings of the descriptors' byte offsets (128 bytes between
    the core matrices along K and 256 along M / N, or the two swapped) makes one warp
    group's wgmma give A @ B bit for bit (exact operands), with A from shared memory
    or registers and B K-major or MN-major, over one K step or four; the other reading
    gives another product,
    which is the control that the comparison can fail. Which one is right for each
    operand form is what the probe prints (notes/bench.md). Each check runs in a
    child process: a kernel fault is sticky in a CUDA context and would fail every
    later test of this worker (the first GPU run of the probe faulted)."""
    res = W.case_in_child(W.case_index(n=n, kind=kind, a_regs=a_regs, trans_b=trans_b, kt=kt))
    assert sorted(ok for ok, _ in res.values()) == [False, True], res


def test_swizzle128_layout_xors_the_chunk_with_the_row():
    x = np.arange(16 * 64, dtype=np.int64).reshape(16, 64)
    flat = W.swizzle128_layout(x)
    for r, k in [(0, 0), (1, 0), (3, 17), (7, 63), (9, 40), (15, 5)]:
        assert flat[r * 64 + ((k // 8) ^ (r % 8)) * 8 + k % 8] == x[r, k]
    assert flat[1 * 64 + 1 * 8] == x[1, 0]  # row 1's first chunk moved to chunk 1
    assert sorted(flat) == sorted(x.ravel())
    with pytest.raises(ValueError, match=r"x: expected \[8 r, 64\]"):
        W.swizzle128_layout(np.zeros((8, 32)))
    assert W.descriptor(0, 16, 1024, W.SWIZZLE_128B) >> 62 == 1


@pytest.mark.compile
@pytest.mark.parametrize("a_regs", [False, True])
def test_swizzled_check_kernel_carries_the_mode_bits(a_regs):
    """With the 128-byte swizzle the descriptor's mode bits are set (the host form's
    constant is in the PTX), and the kernel assembles for sm_90a without local
    memory. Control: the no-swizzle kernel's constant differs, so the assertion can
    fail. (The 32-byte K step is checked by the GPU test's products.)"""
    from numba import types

    from tests.test_prefill_mma import spill_bytes

    sig = (types.uint16[:], types.uint32[:, :, :], types.uint16[:], types.float32[:, :])
    ptx = _ptx(W.check_kernel(64, "f16", 16, W.SWIZZLE_SBO, a_regs, 0, 64, W.SWIZZLE_128B),
               sig)
    want = W.descriptor(0, 16, W.SWIZZLE_SBO, W.SWIZZLE_128B)
    assert f", {want};" in ptx
    assert f", {W.descriptor(0, 16, W.SWIZZLE_SBO)};" not in ptx
    assert spill_bytes(_link(ptx, "sm_90a")) == 0
    plain = _ptx(W.check_kernel(64, "f16", 16, W.SWIZZLE_SBO, a_regs, 0, 64, 0), sig)
    assert f", {want};" not in plain


@pytest.mark.skipif(not _cc90(), reason="wgmma runs only on a compute-capability-9.0 GPU "
                    "(sm_90a); the simulator has no inline PTX")
@pytest.mark.parametrize("a_regs,kind,n", W.SWIZZLE_CASES)
def test_swizzled_wgmma_gives_a_times_b_exactly(a_regs, kind, n):
    """Operands in the 128-byte swizzle, read with it, give A @ B bit for bit over four
    K steps; the same bytes read without the swizzle do not (the control). In a
    child process, as above."""
    res = W.case_in_child(W.case_index(n=n, kind=kind, a_regs=a_regs, kt=64, swizzle=True))
    ok = [ok for ok, _ in res.values()]
    assert ok == [True, False], res


def test_cases_cover_every_form_once():
    names = [name for name, _ in W.cases()]
    assert len(names) == len(set(names))
    assert len(names) == len(W.LAYOUT_CASES) * len(W.LAYOUT_SHAPES) + len(W.SWIZZLE_CASES)


def test_each_check_runs_in_its_own_process(monkeypatch, capsys):
    """A kernel fault is sticky in a CUDA context: the first GPU run's first check
    faulted and every later one then failed in the same process. The parent runs
    each check (and the throughput rows) as a child: a child that fails is
    reported and the next ones still run. Control: the failing child is the
    second of all, and the run's status says so."""
    import subprocess
    import types

    from numba import cuda

    fake_dev = types.SimpleNamespace(compute_capability=(9, 0), MULTIPROCESSOR_COUNT=132,
                                     name=b"fake H100")
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "get_current_device", lambda: fake_dev)
    seen = []

    def run(cmd, timeout, capture_output, text):
        seen.append(cmd[3:])
        if cmd[3:] == ["--case", "1"]:
            return subprocess.CompletedProcess(cmd, 1, "", "CudaAPIError: illegal address")
        return subprocess.CompletedProcess(cmd, 0, f"ran {' '.join(cmd[3:])}", "")

    monkeypatch.setattr(subprocess, "run", run)
    assert W.main([]) == 1
    n = len(W.cases())
    # case 1 failed: its second reading runs alone next, then the other cases
    want = [["--case", "0"], ["--case", "1"], ["--case", "1", "--reading", "1"]]
    want += [["--case", str(i)] for i in range(2, n)]
    assert seen[:n + 1] == want
    assert seen[n + 1][0] == "--throughput" and len(seen) == n + 2
    out = capsys.readouterr().out
    assert "case 1: exit 1" in out and "CudaAPIError" in out and f"ran --case {n - 1}" in out
    assert "ran --case 1 --reading 1" in out


def test_case_index_finds_the_tests_cases():
    """The GPU tests look their checks up in ``cases()`` by keywords: each
    parametrisation has its case (control: an unknown one raises)."""
    for kind, n, kt in W.LAYOUT_SHAPES:
        for a_regs, trans_b, _ in W.LAYOUT_CASES:
            W.case_index(n=n, kind=kind, a_regs=a_regs, trans_b=trans_b, kt=kt)
    for a_regs, kind, n in W.SWIZZLE_CASES:
        W.case_index(n=n, kind=kind, a_regs=a_regs, kt=64, swizzle=True)
    with pytest.raises(KeyError):
        W.case_index(n=48, kind="f16", a_regs=False, trans_b=0, kt=16)
