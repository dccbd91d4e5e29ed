"""Multi-head prefill attention, the product path.

    kernels  the fused online-softmax kernel and ``prefill_attention``
    debug    the ``ATTN_PREFILL_DEBUG`` tracing helpers (shared with the
             reference paths)

The per-head and batched designs are references, in
``attention.reference.prefill_paths``; nothing here imports them.
"""
