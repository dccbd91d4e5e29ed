"""Latent KV cache for MLA: one plane of rows ``[c_kv | k_pe]`` per layer.

One pooled device buffer ``[n_layers, max_seq, r + d_rope]`` (float32 or
float16). Unused rows are filled with NaN, so a kernel that reads past a
plane's length shows up as NaN in its output instead of as a soft error.

Lengths are kept twice, in step: ``lengths`` on the host (what launchers use
to size their work) and ``device_lengths`` (int32 ``[n_layers]``), written by
the append kernel itself (``lengths[plane] = lo + n``). ``in_step()`` copies
the device lengths back and compares. An append that would pass ``max_seq``
raises ``attention.core.checks.RangeError`` before anything is copied or launched,
and leaves both lengths unchanged.
"""

from __future__ import annotations

import numpy as np

from attention.core import checks
from attention.core.device import device_fill, to_host

from .dims import MlaDims
from .kernels import CACHE_DTYPES, append_latent


class LatentCache:
    """Per-layer latent planes with host/device length bookkeeping.

    n_layers: planes; max_seq: rows per plane; dims: MlaDims (only kv_rank and
    d_rope are used); dtype: float32 or float16.
    """

    def __init__(self, n_layers, max_seq, dims: MlaDims, dtype=np.float32, stream=None):
        checks.check_range("n_layers", int(n_layers), 1, 1 << 16, what="layer count")
        checks.check_range("max_seq", int(max_seq), 1, 1 << 24, what="rows per plane")
        if np.dtype(dtype) not in [np.dtype(d) for d in CACHE_DTYPES]:
            raise checks.DTypeError(f"dtype: expected float32 or float16, got {np.dtype(dtype)}")
        self.dims = dims
        self.n_layers = int(n_layers)
        self.max_seq = int(max_seq)
        self.width = dims.latent_width
        self.dtype = np.dtype(dtype)
        self.buffer = device_fill((self.n_layers, self.max_seq, self.width), self.dtype, np.nan,
                                  stream)
        self.device_lengths = device_fill((self.n_layers,), np.int32, 0, stream)
        self.lengths = [0] * self.n_layers

    def _check_layer(self, layer):
        if not isinstance(layer, (int, np.integer)):
            raise checks.DTypeError(f"layer: expected an int, got {type(layer).__name__}")
        checks.check_range("layer", int(layer), 0, self.n_layers - 1, what="layer")
        return int(layer)

    def length(self, layer):
        """Rows cached in ``layer`` (host bookkeeping)."""
        return self.lengths[self._check_layer(layer)]

    def plane(self, layer):
        """Device view ``[max_seq, r + d_rope]`` of one layer's plane."""
        return self.buffer[self._check_layer(layer)]

    def append(self, layer, c_kv, k_pe, *, stream=None, defect=None):
        """Append ``n`` rows ``[c_kv | k_pe]`` to ``layer`` (c_kv [n, r], k_pe [n, d_rope],
        the cache's dtype). Raises RangeError, changing nothing, if the plane would
        overflow. Returns the new length."""
        layer = self._check_layer(layer)
        lo = self.lengths[layer]
        n = int(c_kv.shape[0]) if len(getattr(c_kv, "shape", ())) else 0
        if lo + n > self.max_seq:
            raise checks.RangeError(
                f"c_kv: appending {n} rows to layer {layer} at length {lo} would overflow "
                f"max_seq={self.max_seq}")
        append_latent(self.buffer, c_kv, k_pe, lo, plane=layer, lengths=self.device_lengths,
                      stream=stream, defect=defect)
        self.lengths[layer] = lo + n
        return self.lengths[layer]

    def rows(self, layer):
        """Host copy of the cached rows ``[length, r + d_rope]`` of ``layer``."""
        layer = self._check_layer(layer)
        return to_host(self.buffer[layer])[: self.lengths[layer]]

    def in_step(self):
        """True when the device lengths equal the host bookkeeping."""
        return list(np.asarray(to_host(self.device_lengths)).tolist()) == self.lengths

    def truncate(self, length):
        """Forget rows ``>= length`` in every layer (length <= each current length).
        The rows stay in the buffer but are never read, and the next append
        overwrites them."""
        length = int(length)
        if length < 0 or any(length > n for n in self.lengths):
            raise checks.RangeError(
                f"length: expected 0 <= length <= {min(self.lengths)}, got {length}")
        self.lengths = [length] * self.n_layers
        self.device_lengths.copy_to_device(np.full(self.n_layers, length, np.int32))

    def reset(self):
        """Forget every row (lengths to 0; rows refilled with NaN)."""
        self.buffer = device_fill((self.n_layers, self.max_seq, self.width), self.dtype, np.nan)
        self.device_lengths = device_fill((self.n_layers,), np.int32, 0)
        self.lengths = [0] * self.n_layers
