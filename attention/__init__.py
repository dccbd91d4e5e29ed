"""Decode, batched decode, split-KV and prefill attention kernels in Numba CUDA.

Importing this package under ``NUMBA_ENABLE_CUDASIM=1`` adds the warp
intrinsics the stock simulator lacks (``attention.simwarp``).
"""

from . import simwarp as _simwarp

_simwarp.install()

from .checks import (  # noqa: E402
    AttentionInputError,
    DTypeError,
    LayoutError,
    RangeError,
    ShapeError,
)
from .decode import batched_decode_attention, decode_attention  # noqa: E402
from .kv_cache import batched_kv_scatter, kv_scatter  # noqa: E402

__all__ = [
    "AttentionInputError",
    "DTypeError",
    "LayoutError",
    "RangeError",
    "ShapeError",
    "batched_decode_attention",
    "batched_kv_scatter",
    "decode_attention",
    "kv_scatter",
]
