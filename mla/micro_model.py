"""A tiny MLA transformer whose attention runs on the kernels of ``mla.kernels``.

Seeded random weights (no checkpoint): token embedding (vocab 128), then
``n_layers`` blocks of

    h = RMSNorm(x)
    [q_nope | q_pe] = h W_q                     per head, q_pe rotated (interleaved RoPE)
    [c_kv_raw | k_pe] = h W_dkv;  c_kv = RMSNorm(c_kv_raw);  k_pe rotated
    x += MLA(q_nope, q_pe, c_kv, k_pe; W_UK, W_UV) W_o
    x += (silu(RMSNorm(x) W_gate) * (RMSNorm(x) W_up)) W_down

and a final RMSNorm and LM head. Projections, norms and the MLP are float32
numpy on the host; RoPE (``rope_interleaved``), the latent rows
(``append_latent``) and the attention (absorb_q -> attn_absorbed ->
decompress_v) run on the device.

Two arms share every line but the attention's source of latent rows:

* ``forward(tokens)``: stateless prefill, logits ``[T, vocab]`` for every position;
* ``prime(tokens, cache)`` then ``decode_step(token, cache)``: rows appended to
  a ``LatentCache`` (one plane per layer) and attention read back from it.

``decode_step`` after ``prime(tokens[:-1])`` must equal the last row of
``forward(tokens)`` up to float32 reassociation (the host matmuls see T-1 + 1
rows instead of T).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attention.core import checks

from .cache import LatentCache
from .dims import MlaDims
from .kernels import rope_interleaved
from .pipeline import mla_attend, mla_attend_cached


@dataclass(frozen=True)
class MicroConfig:
    vocab: int = 128
    d_model: int = 64
    n_layers: int = 2
    dims: MlaDims = field(default_factory=lambda: MlaDims(4, 16, 8, 16, 32))
    d_ff: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-6


# The simulator's configuration: two heads and narrow widths keep a prime + decode
# of a handful of tokens within seconds (every CUDA thread is a Python thread there).
SIM_CONFIG = MicroConfig(d_model=32, dims=MlaDims(2, 8, 8, 8, 32), d_ff=64)


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis (float32)."""
    x = np.asarray(x, np.float32)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv * weight).astype(np.float32)


def silu(x):
    return (x / (1.0 + np.exp(-x))).astype(np.float32)


class MicroMlaModel:
    """Tiny MLA transformer with seeded random float32 weights."""

    def __init__(self, config: MicroConfig = MicroConfig(), seed: int = 0):
        self.config = c = config
        d = c.dims
        rng = np.random.default_rng(seed)

        def mat(*shape, fan_in):
            return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

        def norm_weight(n):
            return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

        self.embed = rng.standard_normal((c.vocab, c.d_model)).astype(np.float32)
        self.layers = []
        for _ in range(c.n_layers):
            self.layers.append({
                "attn_norm": norm_weight(c.d_model),
                "w_q": mat(c.d_model, d.n_head * d.qk_width, fan_in=c.d_model),
                "w_dkv": mat(c.d_model, d.latent_width, fan_in=c.d_model),
                "kv_norm": norm_weight(d.kv_rank),
                "w_uk": mat(d.n_head, d.d_nope, d.kv_rank, fan_in=d.kv_rank),
                "w_uv": mat(d.n_head, d.d_v, d.kv_rank, fan_in=d.kv_rank),
                "w_o": mat(d.n_head * d.d_v, c.d_model, fan_in=d.n_head * d.d_v),
                "mlp_norm": norm_weight(c.d_model),
                "w_gate": mat(c.d_model, c.d_ff, fan_in=c.d_model),
                "w_up": mat(c.d_model, c.d_ff, fan_in=c.d_model),
                "w_down": mat(c.d_ff, c.d_model, fan_in=c.d_ff),
            })
        self.final_norm = norm_weight(c.d_model)
        self.lm_head = mat(c.d_model, c.vocab, fan_in=c.d_model)

    def new_cache(self, max_seq, dtype=np.float32):
        """A latent cache with one plane per layer."""
        return LatentCache(self.config.n_layers, max_seq, self.config.dims, dtype)

    def _tokens(self, tokens):
        tok = np.asarray(tokens)
        if tok.ndim != 1 or (tok.size and not np.issubdtype(tok.dtype, np.integer)):
            raise checks.ShapeError(f"tokens: expected a 1-D array of ints, got {tok.shape}")
        if tok.size and (tok.min() < 0 or tok.max() >= self.config.vocab):
            raise checks.RangeError(f"tokens: expected ids in [0, {self.config.vocab})")
        return tok

    def _run(self, tokens, start, cache):
        c = self.config
        d = c.dims
        t_len = tokens.shape[0]
        positions = np.arange(start, start + t_len, dtype=np.int32)
        x = self.embed[tokens]  # [T, d_model]
        for index, w in enumerate(self.layers):
            # -- attention --
            h = rms_norm(x, w["attn_norm"], c.eps)
            q = (h @ w["w_q"]).reshape(t_len, d.n_head, d.qk_width)  # [T, nh, dn + dr]
            q_nope = np.ascontiguousarray(q[:, :, : d.d_nope])  # [T, nh, d_nope]
            q_pe = np.ascontiguousarray(q[:, :, d.d_nope:])  # [T, nh, d_rope]
            kv = h @ w["w_dkv"]  # [T, r + d_rope]
            c_kv = rms_norm(kv[:, : d.kv_rank], w["kv_norm"], c.eps)  # [T, r]
            k_pe = np.ascontiguousarray(kv[:, d.kv_rank:])  # [T, d_rope]
            rope_interleaved(q_pe, positions, base=c.rope_base)
            rope_interleaved(k_pe, positions, base=c.rope_base)
            if cache is None:
                att = mla_attend(q_nope, q_pe, c_kv, k_pe, w["w_uk"], w["w_uv"])
            else:
                cache.append(index, c_kv.astype(cache.dtype), k_pe.astype(cache.dtype))
                att = mla_attend_cached(q_nope, q_pe, cache, index, w["w_uk"], w["w_uv"])
            x = x + att.reshape(t_len, d.n_head * d.d_v) @ w["w_o"]
            # -- gated MLP --
            h = rms_norm(x, w["mlp_norm"], c.eps)
            x = x + (silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return (rms_norm(x, self.final_norm, c.eps) @ self.lm_head).astype(np.float32)

    def forward(self, tokens):
        """Stateless prefill: logits [T, vocab] float32 for every position."""
        tok = self._tokens(tokens)
        if tok.size == 0:
            return np.zeros((0, self.config.vocab), np.float32)
        return self._run(tok, 0, None)

    def prime(self, tokens, cache: LatentCache):
        """Run ``tokens`` after what ``cache`` holds, appending their latent rows to
        every layer's plane. Returns logits [T, vocab]."""
        tok = self._tokens(tokens)
        lengths = set(cache.lengths)
        if len(lengths) != 1 or cache.n_layers != self.config.n_layers:
            raise checks.RangeError(
                f"cache: expected {self.config.n_layers} planes of one length, got "
                f"{cache.lengths}")
        start = cache.lengths[0]
        if start + tok.size > cache.max_seq:
            raise checks.RangeError(
                f"tokens: {tok.size} more tokens after {start} would overflow "
                f"max_seq={cache.max_seq}")
        if tok.size == 0:
            return np.zeros((0, self.config.vocab), np.float32)
        return self._run(tok, start, cache)

    def decode_step(self, token, cache: LatentCache):
        """One token after the cached ones: logits [vocab]."""
        return self.prime(np.array([int(token)]), cache)[0]
