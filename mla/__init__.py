"""DeepSeek-style multi-head latent attention (absorbed form) in Numba CUDA.

Modules: ``dims`` (geometry and presets), ``oracle`` (float64 references and
the float32 baseline), ``kernels`` (absorb_q, attn_absorbed, decompress_v,
append_latent, rope_interleaved and their launchers), ``attn_gemm`` (the GEMM
path and its ``Workspace``), ``cache`` (the per-layer latent cache),
``pipeline`` (mla_attend, mla_attend_cached, mla_decode_step, mla_decode, and
``plan_method``: the path and chunking an entry point takes), ``paged`` (the
paged latent cache: its checks, row gather and ``paged_append_latent``;
``mla_decode`` and ``MLADecodeGraph`` read it with ``page_table=``), ``decode_graph``
(``MLADecodeGraph``: batched decode captured as a CUDA graph; both take
``s_q`` new queries a sequence, q ``[B, s_q, nh, .]``: multi-token decode),
``fp8`` (the fp8 latent cache: its row format, scales and numpy reference;
``mla_decode`` and ``MLADecodeGraph`` read it with ``latent_scale=``),
``fp8_append`` (its quantizing append, ``fp8_append_latent``) and
``micro_model`` (a tiny MLA transformer on these kernels).

The public names below are importable from ``mla`` directly. They are loaded
on first use (PEP 562), so ``import mla`` or ``import mla.dims`` does not
import numba: a process can still set ``NUMBA_ENABLE_CUDASIM`` after it.
The budget ``GEMM_WORKSPACE_LIMIT`` is deliberately not re-exported: set
``mla.pipeline.GEMM_WORKSPACE_LIMIT`` (read at each call) or pass
``workspace_limit=``.
"""

from __future__ import annotations

import importlib

# public name -> submodule that defines it
_EXPORTS = {
    # entry points
    "mla_attend": "pipeline",
    "mla_attend_cached": "pipeline",
    "mla_decode_step": "pipeline",
    "mla_decode": "pipeline",
    "plan_method": "pipeline",
    "choose_method": "pipeline",
    "MethodPlan": "pipeline",
    # captured batched decode
    "MLADecodeGraph": "decode_graph",
    # GEMM path scratch
    "Workspace": "attn_gemm",
    # latent cache and appends
    "LatentCache": "cache",
    "append_latent": "kernels",
    "rope_interleaved": "kernels",
    # paged latent cache (mla_decode / MLADecodeGraph take page_table=)
    "paged_append_latent": "paged",
    "DEFAULT_PAGE_SIZE": "paged",
    # fp8 latent cache (mla_decode / MLADecodeGraph take latent_scale=)
    "fp8_append_latent": "fp8_append",
    # geometry
    "MlaDims": "dims",
    "DEEPSEEK_V3": "dims",
    "NOPE_64x256": "dims",
    "PRESETS": "dims",
    "SMALL_SHAPES": "dims",
    # the micro model
    "MicroMlaModel": "micro_model",
    "MicroConfig": "micro_model",
    "SIM_CONFIG": "micro_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mla' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
