"""Decode, batched decode, split-KV and prefill attention kernels in Numba CUDA.

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
from attention.reference.warp_decode import batched_decode_attention, decode_attention  # noqa: E402
from attention.decode.fast import batched_decode_attention_fast  # noqa: E402
from attention.decode.graph import DecodeStep  # noqa: E402
from attention.decode.state import DecodeBatch  # noqa: E402
from attention.reference.split_decode import choose_decode_method, decode, flash_decode_attention  # noqa: E402
from attention.cache.scatter import batched_kv_scatter, kv_scatter  # noqa: E402
from attention.prefill.kernels import prefill_attention  # noqa: E402

__all__ = [
    "AttentionInputError",
    "DecodeBatch",
    "DecodeStep",
    "DTypeError",
    "LayoutError",
    "RangeError",
    "ShapeError",
    "batched_decode_attention",
    "batched_decode_attention_fast",
    "batched_kv_scatter",
    "choose_decode_method",
    "decode",
    "decode_attention",
    "flash_decode_attention",
    "kv_scatter",
    "prefill_attention",
]
