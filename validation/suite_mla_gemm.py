"""Falsification suite of the MLA GEMM path (``mla.attn_gemm``, ``method="gemm"``).

The checks of ``validation.suite_mla`` (chunked prefill and decode through the
latent cache against the float64 oracles, rope) run through the GEMM path,
plus two checks that reach the kernels the small shapes leave out:

* tensor cores: a chunked prefill through method "gemm" at more heads than
  half a ``tgemm`` tile and 16-byte latent rows, so the score and P.V GEMMs
  run on ``attention.gemm.tgemm`` (the check fails if they would not qualify);
* FMA GEMMs: a chunked prefill through method "gemm_fma" (``attention.gemm.sgemm``
  throughout).

Planted defects (``DEFECTS``): the GEMM path's own glue (``GEMM_DEFECTS``:
``w_uk_transposed``, ``causal_offset_off_by_one``, ``k_pe_ignored``; the rope
and append defects belong to ``validation.suite_mla``, same code sites) and
its kernels' gross defects, each routed by ``mla.attn_gemm.mutant_applies``
to the method that runs its kernel: ``tgemm.GROSS_DEFECTS``
(``k_slice_dropped``) on "gemm", ``sgemm.GROSS_DEFECTS`` (``k_tail_dropped``)
on "gemm_fma", ``SOFTMAX_DEFECTS`` (``softmax_not_normalised``) on both.
``stuck_rescale`` has no counterpart (the GEMM path keeps no running softmax
state). Every check runs for every defect; each defect reaches only the
calls of its method.
"""

from __future__ import annotations

from attention.gemm import tgemm
from mla import attn_gemm as G
from mla.attn_gemm import GEMM_DEFECTS, GROSS_DEFECTS
from mla.dims import MlaDims, SMALL_SHAPES
from validation import suite_mla

FAMILY = "mla_gemm"
DEFECTS = GEMM_DEFECTS + GROSS_DEFECTS


def _routed(defect, method):
    """The defect if ``method``'s kernels carry it (``mutant_applies``), else None."""
    return defect if defect is not None and G.mutant_applies(defect, method) else None


def tensor_dims(small=True):
    """MLA dims whose attention GEMMs qualify for ``tgemm`` (more heads than
    half a tile, latent rows of 32 words)."""
    heads = tgemm.tile_shape()[0] // 2 + (4 if small else 8)
    return MlaDims(n_head=heads, d_nope=8, d_rope=4, d_v=8, kv_rank=28)


def _tensor_check(defect, small):
    from mla.pipeline import mla_attend

    dims = tensor_dims(small)
    t_q, t_kv = 3, 9

    def run():
        bm = tgemm.tile_shape()[0]
        if dims.n_head <= bm // 2 or dims.latent_width % 4:
            return False, f"{dims.n_head} heads / width {dims.latent_width}: tgemm not used"
        args = suite_mla.make_case(dims, t_q, t_kv, 0x7C0)
        got = mla_attend(*args, defect=_routed(defect, "gemm"), method="gemm")
        p = suite_mla.parity(got, args, method="gemm")
        return p["ok"], suite_mla._detail(p)

    return suite_mla._check(f"tensor cores nh{dims.n_head} r{dims.kv_rank} t_q{t_q} "
                            f"t_kv{t_kv}", run)


def _fma_check(defect):
    from mla.pipeline import mla_attend

    dims, t_q, t_kv = SMALL_SHAPES[0], 3, 11

    def run():
        args = suite_mla.make_case(dims, t_q, t_kv, 0xF3A)
        got = mla_attend(*args, defect=_routed(defect, "gemm_fma"), method="gemm_fma")
        p = suite_mla.parity(got, args, method="gemm_fma")
        return p["ok"], suite_mla._detail(p)

    return suite_mla._check(f"fma gemms nh{dims.n_head} r{dims.kv_rank} t_q{t_q} t_kv{t_kv}",
                            run)


def run_suite(defect=None, *, small=True):
    if defect is not None and defect not in DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS} or None, got {defect!r}")
    results = suite_mla.run_suite(_routed(defect, "gemm"), small=small, method="gemm",
                                  defects=DEFECTS)
    results.append(_tensor_check(defect, small))
    results.append(_fma_check(defect))
    return results
