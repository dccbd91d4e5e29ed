"""The product decode path: the group-shared split-KV kernel (``fast``), its
planner and launcher, and the decode step over a pooled cache (``state``,
``graph``).

    fast    kernels (main + combine), row loaders, planner, launcher, the
            one-call ``batched_decode_attention_fast``
    state   ``DecodeBatch``: decode state with lengths on the host
    graph   ``DecodeStep``: scatter + attention captured as a CUDA graph
"""
