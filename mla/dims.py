"""MLA geometry: head count and the four widths of multi-head latent attention.

``MlaDims(n_head, d_nope, d_rope, d_v, kv_rank)``:

* ``n_head``   query heads (all read the same latent rows: no KV heads);
* ``d_nope``   per-head query/key width without rotary embedding;
* ``d_rope``   per-head query width with rotary embedding; the rotary key
  ``k_pe`` (``d_rope`` wide) is shared by every head. 0 means "NoPE";
* ``d_v``      per-head value width;
* ``kv_rank``  width ``r`` of the compressed latent ``c_kv``.

One cached latent row per token is ``[c_kv | k_pe]``, ``latent_width =
kv_rank + d_rope`` wide. The default softmax scale is ``1/sqrt(d_nope +
d_rope)`` (the width of the un-absorbed query/key dot product).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MlaDims:
    n_head: int
    d_nope: int
    d_rope: int
    d_v: int
    kv_rank: int

    def __post_init__(self):
        for name in ("n_head", "d_nope", "d_v", "kv_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.d_rope, int) or self.d_rope < 0 or self.d_rope % 2:
            raise ValueError(f"d_rope: expected an even int >= 0, got {self.d_rope!r}")

    @property
    def latent_width(self) -> int:
        """Width of one cached latent row ``[c_kv | k_pe]``."""
        return self.kv_rank + self.d_rope

    @property
    def qk_width(self) -> int:
        """Width of the un-absorbed query/key dot product."""
        return self.d_nope + self.d_rope

    def scale(self) -> float:
        """Default softmax scale ``1/sqrt(d_nope + d_rope)``."""
        return 1.0 / math.sqrt(self.qk_width)


# DeepSeek-V3 attention (128 heads, 128 nope + 64 rope, value 128, rank 512).
DEEPSEEK_V3 = MlaDims(n_head=128, d_nope=128, d_rope=64, d_v=128, kv_rank=512)
# A NoPE geometry: no rotary part, 64 heads of width 256, rank 512.
NOPE_64x256 = MlaDims(n_head=64, d_nope=256, d_rope=0, d_v=256, kv_rank=512)

PRESETS = (DEEPSEEK_V3, NOPE_64x256)

# Shrunk shapes that make a layout bug obvious: rope on (two sizes, one with
# d_nope != d_v and rank 48, not a multiple of 32) and NoPE.
SMALL_SHAPES = (
    MlaDims(n_head=4, d_nope=24, d_rope=8, d_v=32, kv_rank=64),
    MlaDims(n_head=3, d_nope=12, d_rope=4, d_v=20, kv_rank=48),
    MlaDims(n_head=4, d_nope=32, d_rope=0, d_v=32, kv_rank=64),
)
