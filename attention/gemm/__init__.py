"""GEMMs: tensor cores with split tf32 operands (``tgemm``), fp32 FMA with
two-level partial sums (``sgemm``), the same sums split over ``k`` for few rows
(``skinny``: MLA's absorb and decompress at small batches), 16-bit mma building
blocks (``mma16``). (The prefill reference paths' tiled GEMM is
``attention.reference.tiled_gemm``.)"""
