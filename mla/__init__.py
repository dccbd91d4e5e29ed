"""DeepSeek-style multi-head latent attention (absorbed form) in Numba CUDA."""
