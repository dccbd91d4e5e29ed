"""The simulator's warp intrinsics (attention.core.simwarp) against numpy expectations.

Blocks of several warps (and a partial last warp) are used throughout, so a
shuffle that mixed lanes of different warps, or assumed 32 threads per block,
would fail here. Runs in the simulator process only.
"""

import os

import numpy as np
import pytest
from numba import cuda

from attention.core.simwarp import WarpSyncError

pytestmark = pytest.mark.sim

FULL = 0xFFFFFFFF
BLOCK = 80  # two full warps and a partial one of 16 lanes


def lanes_and_warps(n):
    tid = np.arange(n)
    return tid % 32, tid // 32


def expected_shuffle(values, src_of_lane, n):
    """For each thread: value of the source lane in its own warp, own value if absent."""
    lane, warp = lanes_and_warps(n)
    out = values.copy()
    for t in range(n):
        src = src_of_lane(lane[t])
        if src is None:
            continue
        s = warp[t] * 32 + src
        if 0 <= src < 32 and s < n:
            out[t] = values[s]
    return out


@cuda.jit
def shuffles(vals, delta, idx_out, up_out, down_out, xor_out):
    t = cuda.threadIdx.x
    v = vals[t]
    idx_out[t] = cuda.shfl_sync(FULL, v, delta)
    up_out[t] = cuda.shfl_up_sync(FULL, v, delta)
    down_out[t] = cuda.shfl_down_sync(FULL, v, delta)
    xor_out[t] = cuda.shfl_xor_sync(FULL, v, delta)


@pytest.mark.parametrize("delta", [0, 1, 5, 16, 31, 37])
def test_shuffles_match_numpy_in_multiwarp_block(delta):
    vals = np.arange(BLOCK, dtype=np.float32) * 1.5 + 0.25
    outs = [np.zeros(BLOCK, np.float32) for _ in range(4)]
    shuffles[1, BLOCK](vals, delta, *outs)
    idx, up, down, xor = outs
    np.testing.assert_array_equal(idx, expected_shuffle(vals, lambda l: delta % 32, BLOCK))
    np.testing.assert_array_equal(
        up, expected_shuffle(vals, lambda l: l - delta if l - delta >= 0 else None, BLOCK))
    np.testing.assert_array_equal(
        down, expected_shuffle(vals, lambda l: l + delta if l + delta < 32 else None, BLOCK))
    np.testing.assert_array_equal(
        xor, expected_shuffle(vals, lambda l: (l ^ delta) if (l ^ delta) < 32 else None, BLOCK))


def test_out_of_range_lanes_return_own_value():
    """shfl_up below lane 0 / shfl_down past lane 31 / xor past 31: own value (PTX clamp)."""
    vals = np.arange(64, dtype=np.float32)
    outs = [np.zeros(64, np.float32) for _ in range(4)]
    shuffles[1, 64](vals, 40, *outs)
    _, up, down, xor = outs
    np.testing.assert_array_equal(up, vals)
    np.testing.assert_array_equal(down, vals)
    np.testing.assert_array_equal(xor, vals)


@cuda.jit
def votes(preds, all_out, any_out, ballot_out, active_out, lt_out):
    t = cuda.threadIdx.x
    p = preds[t] != 0
    all_out[t] = cuda.all_sync(FULL, p)
    any_out[t] = cuda.any_sync(FULL, p)
    ballot_out[t] = cuda.ballot_sync(FULL, p)
    cuda.syncwarp(FULL)
    active_out[t] = cuda.activemask()
    lt_out[t] = cuda.lanemask_lt()


def test_votes_per_warp():
    n = BLOCK
    preds = np.zeros(n, np.int32)
    preds[0:32] = 1  # warp 0: all true
    preds[40] = 1  # warp 1: one lane true
    # warp 2 (16 lanes): all false
    outs = [np.zeros(n, np.int64) for _ in range(5)]
    votes[1, n](preds, *outs)
    all_o, any_o, ballot, active, lt = outs
    lane, warp = lanes_and_warps(n)
    np.testing.assert_array_equal(all_o, (warp == 0).astype(np.int64))
    np.testing.assert_array_equal(any_o, (warp <= 1).astype(np.int64))
    want_ballot = np.where(warp == 0, -1, np.where(warp == 1, 1 << 8, 0))  # int32 ballot
    np.testing.assert_array_equal(ballot, want_ballot)
    np.testing.assert_array_equal(active, np.where(warp == 2, 0xFFFF, 0xFFFFFFFF))
    np.testing.assert_array_equal(lt, (1 << lane) - 1)


@cuda.jit
def tree_sums(vals, out, n_rounds):
    """Many consecutive shuffles: rounds must never mix values of different calls."""
    t = cuda.threadIdx.x
    v = vals[t]
    for r in range(n_rounds):
        v = v + cuda.shfl_xor_sync(FULL, v, 1 << (r % 5))
    out[t] = v


def test_consecutive_rounds_stay_separate():
    vals = np.arange(64, dtype=np.float64)
    out = np.zeros(64, np.float64)
    tree_sums[2, 64](vals, out, 10)
    ref = vals.reshape(2, 32).copy()
    for r in range(10):
        ref = ref + ref[:, np.arange(32) ^ (1 << (r % 5))]
    np.testing.assert_array_equal(out, ref.reshape(-1))


@cuda.jit
def partial_mask(vals, out):
    t = cuda.threadIdx.x
    if t < 16:  # only the lower half-warp takes part, as its mask says
        out[t] = cuda.shfl_xor_sync(0x0000FFFF, vals[t], 8)
    else:
        out[t] = -1.0


def test_partial_mask_rendezvous_of_named_lanes_only():
    vals = np.arange(32, dtype=np.float32)
    out = np.zeros(32, np.float32)
    partial_mask[1, 32](vals, out)
    want = np.full(32, -1.0, np.float32)
    want[:16] = vals[:16][np.arange(16) ^ 8]
    np.testing.assert_array_equal(out, want)


@cuda.jit
def caller_not_in_mask(vals, out):
    t = cuda.threadIdx.x
    out[t] = cuda.shfl_sync(0x1, vals[t], 0)


@cuda.jit
def exited_lane_in_mask(vals, out):
    t = cuda.threadIdx.x
    if t == 3:
        return
    out[t] = cuda.shfl_sync(FULL, vals[t], 0)


@pytest.mark.parametrize("kernel", [caller_not_in_mask, exited_lane_in_mask])
def test_inconsistent_masks_raise(kernel):
    """Positive control: masks the hardware would hang or garble on are reported."""
    vals = np.arange(32, dtype=np.float32)
    out = np.zeros(32, np.float32)
    with pytest.raises(WarpSyncError):
        kernel[1, 32](vals, out)


@cuda.jit
def barrier_then_shuffle(vals, out):
    shared = cuda.shared.array(96, np.float32)
    t = cuda.threadIdx.x
    shared[t] = vals[t]
    cuda.syncthreads()  # every warp's writes visible before any warp reads
    v = shared[95 - t]
    out[t] = v + cuda.shfl_down_sync(FULL, v, 1)


def test_syncthreads_and_shuffles_together():
    vals = np.arange(96, dtype=np.float32)
    out = np.zeros(96, np.float32)
    barrier_then_shuffle[1, 96](vals, out)
    rev = vals[::-1]
    want = rev + expected_shuffle(rev, lambda l: l + 1 if l + 1 < 32 else None, 96)
    np.testing.assert_array_equal(out, want)


def test_warp_helpers_reduce_every_lane():
    """attention.core.warp's helpers on the simulator: the sums and max land in every lane."""
    from attention.core.warp import warp_max, warp_sum, warp_sum_down

    @cuda.jit
    def reduce(vals, s, m, sd):
        t = cuda.threadIdx.x
        s[t] = warp_sum(vals[t])
        m[t] = warp_max(vals[t])
        sd[t] = warp_sum_down(vals[t])

    rng = np.random.default_rng(1)
    vals = rng.standard_normal(64)
    s, m, sd = (np.zeros(64) for _ in range(3))
    reduce[1, 64](vals, s, m, sd)
    w = vals.reshape(2, 32)
    np.testing.assert_allclose(s, np.repeat(w.sum(1), 32), rtol=1e-12)
    np.testing.assert_array_equal(m, np.repeat(w.max(1), 32))
    np.testing.assert_allclose(sd, np.repeat(w.sum(1), 32), rtol=1e-12)


def _butterflies(vals, forms, lanes):
    """Each of ``forms`` (four reductions: sum, max, then group sum and max over
    ``lanes``) over ``vals``, one thread each, in a block of ``len(vals)``."""
    warp_sum, warp_max, group_sum, group_max = forms

    @cuda.jit
    def reduce(vals, out):
        t = cuda.threadIdx.x
        v = vals[t]
        out[0, t] = warp_sum(v)
        out[1, t] = warp_max(v)
        out[2, t] = group_sum(v, lanes)
        out[3, t] = group_max(v, lanes)

    out = np.zeros((4, len(vals)), vals.dtype)
    reduce[1, len(vals)](vals, out)
    return out


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf + -inf, on purpose
@pytest.mark.parametrize("lanes", [1, 4, 8, 32])
def test_fused_butterflies_give_the_shuffles_bits(lanes):
    """On the simulator warp_sum / warp_max / group_sum / group_max run as one
    rendezvous (validation.simfast.butterfly); each lane must get the bits the step-by-step
    shuffle forms (what the GPU runs) give: float32 values of mixed magnitudes
    (so the order of the additions shows in the bits), NaN, +-inf and -0.0, in a
    block whose last warp is partial. Control: the same butterfly with its steps
    in the other order gives other bits, so the comparison can fail."""
    import operator

    from attention.core import warp
    from validation import simfast

    names = ("warp_sum", "warp_max", "group_sum", "group_max")
    fused = tuple(getattr(warp, name) for name in names)
    assert all(f.fn is simfast.FUSED_FORMS[n] for f, n in zip(fused, names)), \
        "the simulator runs the shuffle forms"
    shuffles = tuple(cuda.jit(device=True)(simfast.SHUFFLE_FORMS[n]) for n in names)
    rng = np.random.default_rng(lanes)
    vals = (rng.standard_normal(BLOCK) * 10.0 ** rng.integers(-6, 7, BLOCK)).astype(np.float32)
    special = vals.copy()
    special[[3, 40, 41, 70]] = [np.nan, np.inf, -np.inf, -0.0]
    for data in (vals, special):
        got, want = _butterflies(data, fused, lanes), _butterflies(data, shuffles, lanes)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

    def backwards_sum(v):
        return simfast.butterfly(v, (1, 2, 4, 8, 16), operator.add)

    control = _butterflies(vals, (backwards_sum,) + fused[1:], lanes)
    assert (control[0].view(np.uint32) != _butterflies(vals, shuffles, lanes)[0].view(
        np.uint32)).any()


def test_block_helpers_reduce_every_thread_and_reuse_their_scratch():
    """attention.core.warp.block_max / block_sum over a block of 4 warps: the block's
    max and sum in every thread, three reductions in a row through the same
    shared array. (The simulator's threads rarely interleave enough to expose a
    missing barrier before a reuse; racecheck on the GPU covers that, through
    the MLA softmax tests.)"""
    from numba import float64

    from attention.core.warp import block_max, block_sum

    @cuda.jit
    def reduce(vals, m, s, m2):
        red = cuda.shared.array(4, float64)
        t = cuda.threadIdx.x
        m[t] = block_max(vals[t], red)
        s[t] = block_sum(vals[t], red)
        m2[t] = block_max(-vals[t], red)

    rng = np.random.default_rng(2)
    vals = rng.standard_normal(128)
    m, s, m2 = (np.zeros(128) for _ in range(3))
    reduce[1, 128](vals, m, s, m2)
    np.testing.assert_array_equal(m, np.full(128, vals.max()))
    want = vals.reshape(4, 32).sum(1)  # warp by warp, then in warp order
    np.testing.assert_allclose(s, np.full(128, want.sum()), rtol=1e-12)
    np.testing.assert_array_equal(m2, np.full(128, (-vals).max()))


@cuda.jit
def divergent_activemask(out):
    t = cuda.threadIdx.x
    if t % 2 == 0:
        out[t] = cuda.activemask()  # only the even lanes run this
    else:
        out[t] = 0


def test_activemask_in_a_divergent_branch_names_that_branch():
    out = np.zeros(32, np.int64)
    divergent_activemask[1, 32](out)
    evens = sum(1 << lane for lane in range(0, 32, 2))
    np.testing.assert_array_equal(out[0::2], evens)


@cuda.jit
def divergent_syncthreads(out):
    t = cuda.threadIdx.x
    if t < 40:
        cuda.syncthreads()
    else:
        out[t] = cuda.shfl_sync(FULL, 1.0, 0)


def test_deadlock_is_reported_not_hung():
    """A barrier and a shuffle that wait on each other would hang a GPU: raise here."""
    out = np.zeros(64, np.float32)
    with pytest.raises(WarpSyncError, match="deadlock"):
        divergent_syncthreads[1, 64](out)


def test_device_function_modules_get_the_real_cuda_back_after_a_launch():
    """Device functions of another module (attention.core.warp's block_sum reads
    cuda.threadIdx and calls cuda.syncthreads) run on the fake cuda module during
    a launch, and that module has numba's cuda again once the launch returns, and
    once a launch that raises has ended (validation.simfast holds a module's swap
    for the whole launch)."""
    from numba import cuda as real_cuda
    from numba import float64

    from attention.core import warp

    @cuda.jit
    def total(vals, out, fail):
        red = cuda.shared.array(4, float64)
        t = cuda.threadIdx.x
        out[t] = warp.block_sum(vals[t], red)
        if fail and t == 0:
            raise ValueError("planted")

    n = 64  # whole warps: a partial warp's butterfly is undefined on the hardware
    vals = np.arange(n, dtype=np.float64)
    out = np.zeros(n)
    total[1, n](vals, out, False)
    np.testing.assert_array_equal(out, vals.sum())
    assert warp.cuda is real_cuda
    with pytest.raises(Exception):
        total[1, n](vals, out, True)
    assert warp.cuda is real_cuda
    total[1, n](vals * 2, out, False)  # and the next launch swaps it in again
    np.testing.assert_array_equal(out, 2 * vals.sum())


def test_the_faster_machinery_is_what_runs():
    """validation.simfast is installed in this process (tests/conftest.py) and its
    replacements are the ones the simulator, the mma stand-in and numba's scalar
    types call."""
    from numba.cuda.simulator import kernel, kernelapi

    from attention.core import warp
    from attention.gemm import mma16
    from validation import simfast

    assert simfast.installed()
    assert kernel.FakeCUDAKernel.__call__ is simfast._kernel_call
    assert kernelapi.FakeCUDAShared.array is simfast._shared_array
    assert mma16._halves is simfast._halves
    assert warp.group_sum.fn is simfast.FUSED_FORMS["group_sum"]
    from numba import float32, int32, types

    assert types.Number.__call__ is simfast._number_call
    # the fast cast gives numba's answer; a type argument still makes a signature
    assert type(float32(1.1)) is np.float32 and float32(1.1) == np.float32(1.1)
    assert type(int32(np.float64(-2.7))) is np.int32 and int32(np.float64(-2.7)) == -2
    assert str(float32(float32, int32)) == "(float32, int32) -> float32"


def test_the_mma_stand_in_runs_in_a_process_that_ran_no_kernel_before():
    """The mma stand-in (``mma16.k_step_sum``) imports ``attention.gemm.tgemm`` on
    its first call; a module's first import inside a simulated kernel fails (its
    ``device_fn`` definitions meet the simulator's fake ``cuda``, which has no
    ``jit``), so ``simfast.install`` imports it first. Checked in a fresh process
    whose first simulated kernel is a tensor-core one (the fp8 decode's check,
    which failed so when run alone); control: that process had not imported
    tgemm before ``install``."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys\n"
        "import attention\n"
        "before = 'attention.gemm.tgemm' in sys.modules\n"
        "from validation import simfast\n"
        "simfast.install()\n"
        "from validation import suite_decode_fp8 as S\n"
        "assert all(c.passed for c in S.check_mma_token_head(None))\n"
        "print('before', before)\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "before False" in run.stdout  # the import came from install, not earlier
