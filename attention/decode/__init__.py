"""The product decode path.

    fast    the group-shared split-KV kernel (main + combine), its row
            loaders, planner and launcher
    plan    ``DecodePlan``: planned once, ``run(...)`` only enqueues (no copy,
            no allocation, no sync; lengths and slots checked on the device)
    api     ``decode(...)``: one call that builds (and caches) a plan and runs it
    step    ``DecodeState``: append-and-attend decode steps over a pooled
            cache, eager or captured as a CUDA graph
"""
