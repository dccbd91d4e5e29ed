"""Decode and prefill attention kernels in Numba CUDA: the product path.

    decode(...)         decode attention in one call (numpy or device arrays)
    DecodePlan          decode planned once; ``run(...)`` only enqueues; pooled
                        or paged caches (``page_size=``, HND / NHD layouts),
                        batch-invariant splits (``batch_invariant=True``)
    prefill_attention   causal prefill attention
    kv_scatter, batched_kv_scatter   write new K/V rows into the cache
    paged_append        write 1..T new tokens a sequence into a paged cache
    fp8_append          quantize 1..T new tokens a sequence into an fp8 (e4m3) paged cache
    DecodeState         append-and-attend decode steps over a pooled cache
                        (eager or captured as a CUDA graph)
    errors              AttentionInputError and its subclasses

The reference kernels (the seed designs) are imported from their modules:
``attention.reference.warp_decode`` (``decode_attention``,
``batched_decode_attention``), ``attention.reference.split_decode``
(``flash_decode_attention``, ``choose_decode_method``, the method dispatcher
``decode``); the one-call fast decode of earlier releases is
``attention.decode.fast.batched_decode_attention_fast``.

Importing this package under ``NUMBA_ENABLE_CUDASIM=1`` adds the warp
intrinsics the stock simulator lacks (``attention.core.simwarp``).
"""

from attention.core import simwarp as _simwarp

_simwarp.install()

from attention.core.checks import (  # noqa: E402
    AttentionInputError,
    DTypeError,
    LayoutError,
    RangeError,
    ShapeError,
)
from attention.decode.plan import DecodePlan  # noqa: E402
from attention.decode.api import decode  # noqa: E402
from attention.decode.step import DecodeState  # noqa: E402
from attention.cache.scatter import batched_kv_scatter, kv_scatter  # noqa: E402
from attention.cache.fp8 import fp8_append  # noqa: E402
from attention.cache.paged import paged_append  # noqa: E402
from attention.prefill.kernels import prefill_attention  # noqa: E402

__all__ = [
    "AttentionInputError",
    "DecodePlan",
    "DecodeState",
    "DTypeError",
    "LayoutError",
    "RangeError",
    "ShapeError",
    "batched_kv_scatter",
    "decode",
    "kv_scatter",
    "paged_append",
    "fp8_append",
    "prefill_attention",
]
