"""Gate 4: the micro MLA model's cached decode equals its stateless forward.

``prime(tokens[:-1])`` + ``decode_step(tokens[-1])`` through a ``LatentCache``
must equal the last row of ``forward(tokens)``: max abs diff <= 5e-3 and the
same argmax (the bar of a whole-stack comparison: the two arms run the host
matmuls over T-1 + 1 rows instead of T, so float32 reassociation separates
them slightly; the attention core itself is held to the derived kernel bound by
gates 1-2). After the prime every layer's plane holds exactly the primed
tokens, and the device lengths agree with the host bookkeeping.

Sizes: on the GPU the default model (vocab 128, 2 layers, d_model 64, 4 heads
of 16 + 8 rope, rank 32) over 20 tokens, as the gate asks. The simulator runs
every CUDA thread as a Python thread, so it uses ``SIM_CONFIG`` (2 heads,
d_model 32) over 6 tokens; the 20-token gate runs on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from attention.core import checks
from mla.micro_model import SIM_CONFIG, MicroConfig, MicroMlaModel
from tests.conftest import small

CONFIG = SIM_CONFIG if small() else MicroConfig()
N_TOKENS = 6 if small() else 20
MAX_ABS = 5e-3


def _tokens(n):
    return (np.arange(n) * 7 + 3) % 128


@pytest.mark.device
def test_prime_then_decode_equals_forward():
    model = MicroMlaModel(CONFIG, seed=0xC0FFEE)
    tokens = _tokens(N_TOKENS)
    full = model.forward(tokens)
    assert full.shape == (N_TOKENS, CONFIG.vocab) and np.isfinite(full).all()
    assert full.max() - full.min() > 1e-2  # not a dead projection
    want = full[-1]

    cache = model.new_cache(N_TOKENS + 4)
    primed = model.prime(tokens[:-1], cache)
    assert cache.lengths == [N_TOKENS - 1] * CONFIG.n_layers and cache.in_step()
    # the prime's own logits are the stateless forward's first T-1 rows
    assert np.abs(primed - full[:-1]).max() <= MAX_ABS

    got = model.decode_step(tokens[-1], cache)
    assert cache.lengths == [N_TOKENS] * CONFIG.n_layers and cache.in_step()
    diff = np.abs(got - want).max()
    assert diff <= MAX_ABS, f"cached vs stateless: max abs diff {diff:.3e} > {MAX_ABS}"
    assert int(got.argmax()) == int(want.argmax())

    # positive control: from the same primed state, another last token misses the bar
    cache.truncate(N_TOKENS - 1)
    assert cache.in_step()
    other = model.decode_step((tokens[-1] + 1) % CONFIG.vocab, cache)
    assert np.abs(other - want).max() > 10 * MAX_ABS


@pytest.mark.device
def test_prime_overflow_raises_before_appending():
    model = MicroMlaModel(CONFIG, seed=1)
    cache = model.new_cache(4)
    model.prime(_tokens(3), cache)
    with pytest.raises(checks.RangeError, match="overflow"):
        model.prime(_tokens(2), cache)
    assert cache.lengths == [3] * CONFIG.n_layers and cache.in_step()


def test_bad_tokens_raise_before_any_launch():
    model = MicroMlaModel(CONFIG, seed=1)
    with pytest.raises(checks.RangeError, match="tokens"):
        model.forward(np.array([1, 128]))
    with pytest.raises(checks.ShapeError, match="tokens"):
        model.forward(np.array([[1, 2]]))
    assert model.forward(np.array([], np.int64)).shape == (0, 128)


def test_seeded_weights_are_reproducible():
    a, b = MicroMlaModel(CONFIG, seed=5), MicroMlaModel(CONFIG, seed=5)
    np.testing.assert_array_equal(a.layers[1]["w_uk"], b.layers[1]["w_uk"])
    assert not np.array_equal(a.embed, MicroMlaModel(CONFIG, seed=6).embed)
    assert CONFIG.vocab == 128 and 2 <= CONFIG.n_layers <= 3
