"""The seed designs, kept as readable references and as carriers of planted
defects (README.md in this folder gives each one's speed against the product
path). The product path never imports from here (tests/test_layering.py).

    warp_decode      one warp per (head, sequence), the reference design's decode
    split_decode     split-KV over warp chunks + combine, and the ``method=`` dispatcher
    prefill_paths    the per-head and batched prefill paths,
                     ``prefill_attention_reference(..., method="batched" | "per_head")``
    prefill_layout   their layout kernels (interleaved <-> head-major, transposes)
    prefill_softmax  their warp-per-row softmax over materialised scores
    tiled_gemm       their shared-memory tiled batched GEMM and scale
"""
