"""``bench/profile.py``'s tensor-core decode form (``mma_decode``), the launch
sequence ncu profiles for the decode's fixed cost.

On the simulator or a GPU (``device``), at B 2 / L 40, H 4, H_kv 1, D 32: over lengths 0 the call
returns zeros and an lse of -inf (no position read); over the full lengths it
returns finite outputs that differ from those zeros, so the empty form is not
the full one by another name (the control).
"""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.device
@pytest.mark.parametrize("cache", ["fp8", "f16"])
def test_mma_decode_form_empty_and_full(cache):
    from bench import profile

    small = dict(heads=4, kv_heads=1, head_dim=32)
    out0, lse0 = profile.mma_decode(cache, 2, 40, empty=True, **small)
    assert out0.shape == (2, 1, 4, 32) and lse0.shape == (2, 1, 4)
    assert not out0.any() and np.isneginf(lse0).all()
    out1, lse1 = profile.mma_decode(cache, 2, 40, **small)
    assert np.isfinite(out1).all() and np.isfinite(lse1).all()
    assert out1.any()
