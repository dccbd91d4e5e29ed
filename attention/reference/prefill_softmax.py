"""Warp-per-row softmax over materialised attention scores (the prefill reference
paths, ``attention.reference.prefill_paths``).

``scores [G, T, N]`` holds G groups (heads) of T rows of N scaled scores; one
warp normalises one row in place, three passes with lanes striding the
columns ``lane, lane+32, ...``:

1. the row maximum (``attention.core.warp.warp_max``),
2. the sum of ``exp(x - max)`` (``attention.core.warp.warp_sum``),
3. ``p = exp(x - max) / sum`` written back.

Row ``t`` sees columns ``0 .. t`` when ``causal`` (its later columns are
written 0), all ``N`` columns otherwise. ``lse[g, t] = max + log(sum)``
(natural log) is written beside it; a row that sees nothing gets zeros and
``-inf``. Block of ``ROWS_PER_BLOCK`` warps, grid ``ceil(G*T / ROWS_PER_BLOCK)``.

Planted defects (``defect=``, falsification suite only; same source, one
closure constant flipped):
    "softmax_not_normalised"  pass 3 skips the division by the sum
    "causal_off_by_one"       a causal row sees one column too many (0 .. t+1)
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from attention.core.device import jit
from attention.core.warp import warp_max, warp_sum
from attention.prefill.kernels import PREFILL_DEFECTS

WARP = 32
ROWS_PER_BLOCK = 4
# the same planted defects as the fused product kernel's, so the falsification
# suite asks every path for each one
SOFTMAX_DEFECTS = PREFILL_DEFECTS  # ("softmax_not_normalised", "causal_off_by_one")


@functools.lru_cache(maxsize=None)
def softmax_kernel(defect=None):
    """The warp-per-row softmax kernel; ``defect`` None is the correct one."""
    if defect not in (None,) + SOFTMAX_DEFECTS:
        raise ValueError(f"defect: expected one of {SOFTMAX_DEFECTS} or None, got {defect!r}")
    NORMALISE = defect != "softmax_not_normalised"
    CAUSAL_SHIFT = 1 if defect == "causal_off_by_one" else 0

    def kernel(scores, causal, lse):
        """Row softmax in place.

        scores: [G, T, N] float32, scaled scores in, probabilities out
        causal: int32, nonzero: row t sees columns 0..t only
        lse:    [G, T] float32 out, natural-log log-sum-exp of each row
        """
        groups, t_len, n_cols = scores.shape
        lane = cuda.threadIdx.x % WARP
        row = cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.x // WARP
        # a warp owns one row; rows past the end skip everything (warp-uniform,
        # so the collectives below always run with all 32 lanes)
        if row < groups * t_len:
            g = row // t_len
            t = row % t_len
            visible = n_cols
            if causal != 0:
                visible = min(n_cols, t + 1 + CAUSAL_SHIFT)

            # -- pass 1: row max --
            m = float32(-math.inf)
            for col in range(lane, visible, WARP):
                m = max(m, scores[g, t, col])
            m = warp_max(m)

            # -- pass 2: sum of exponentials --
            total = float32(0.0)
            for col in range(lane, visible, WARP):
                total += math.exp(scores[g, t, col] - m)
            total = warp_sum(total)

            # -- pass 3: probabilities; masked columns become 0 --
            inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
            if not NORMALISE:
                inv = float32(1.0)
            for col in range(lane, n_cols, WARP):
                if col < visible:
                    scores[g, t, col] = math.exp(scores[g, t, col] - m) * inv
                else:
                    scores[g, t, col] = float32(0.0)
            if lane == 0:
                lse[g, t] = m + math.log(total) if total > float32(0.0) else float32(-math.inf)

    kernel.__name__ = "row_softmax" + ("" if defect is None else "_" + defect)
    return jit(kernel)


def row_softmax(scores, causal, lse, stream, defect=None):
    """Launch the softmax kernel over ``scores [G, T, N]`` in place, writing ``lse [G, T]``."""
    rows = int(scores.shape[0]) * int(scores.shape[1])
    grid = (rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    softmax_kernel(defect)[grid, ROWS_PER_BLOCK * WARP, stream](
        scores, np.int32(1 if causal else 0), lse)
