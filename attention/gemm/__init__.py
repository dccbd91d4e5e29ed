"""GEMMs: tensor cores with split tf32 operands (``tgemm``), fp32 FMA with
two-level partial sums (``sgemm``), and the shared-memory tiled GEMM of the
prefill reference paths (``tiled``)."""
