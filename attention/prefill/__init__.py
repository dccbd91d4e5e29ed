"""Multi-head prefill attention, the product path.

    kernels  the fused online-softmax kernel and ``prefill_attention``
    tf32     float32 q / k / v on tensor cores, operands split in tf32 terms
             (``prefill_attention(method="tf32")``)
    mma      fp16 / bf16 q / k / v on tensor cores (``prefill_attention_mma``)
    frame    the launchers' shared host frame (checks, output buffers, results)
    debug    the ``ATTN_PREFILL_DEBUG`` tracing helpers (shared with the
             reference paths)

The per-head and batched designs are references, in
``attention.reference.prefill_paths``; nothing here imports them.
"""
