"""DeepSeek-style multi-head latent attention (absorbed form) in Numba CUDA.

Modules: ``dims`` (geometry and presets), ``oracle`` (float64 references and
the float32 baseline), ``kernels`` (absorb_q, attn_absorbed, decompress_v,
append_latent, rope_interleaved and their launchers), ``cache`` (the per-layer
latent cache), ``pipeline`` (mla_attend, mla_attend_cached, mla_decode_step,
mla_decode) and ``micro_model`` (a tiny MLA transformer on these kernels).
"""
