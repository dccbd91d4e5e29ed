"""Falsification suite of the MLA GEMM path (``mla.attn_gemm``, ``method="gemm"``).

The checks of ``validation.suite_mla`` (chunked prefill and decode through the
latent cache against the float64 oracles, rope) run through the GEMM path.
Its planted defects are the MLA ones that exist in it: ``stuck_rescale`` has
no counterpart (the GEMM path keeps no running softmax state).
"""

from __future__ import annotations

from mla.attn_gemm import GEMM_DEFECTS
from mla.kernels import APPEND_DEFECTS, ROPE_DEFECTS
from validation import suite_mla

FAMILY = "mla_gemm"
DEFECTS = ROPE_DEFECTS + APPEND_DEFECTS + GEMM_DEFECTS


def run_suite(defect=None, *, small=True):
    return suite_mla.run_suite(defect, small=small, method="gemm", defects=DEFECTS)
