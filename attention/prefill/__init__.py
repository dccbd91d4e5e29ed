"""Multi-head prefill attention.

    kernels  the fused online-softmax kernel (the product path), the
             per-head and batched reference paths, ``prefill_attention``
    layout   interleaved rows <-> head-major copies, transposes
    softmax  warp-per-row softmax over materialised scores (reference paths)
"""
