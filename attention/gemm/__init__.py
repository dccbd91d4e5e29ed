"""GEMMs: tensor cores with split tf32 operands (``tgemm``), fp32 FMA with
two-level partial sums (``sgemm``): the MLA GEMM path's. (The prefill
reference paths' tiled GEMM is ``attention.reference.tiled_gemm``.)"""
