"""The fp8 e4m3 cache's quantization error: a property of the format, not of a kernel.

For each decode shape case and score fixture of the sweep (the first seed's
inputs, ``registry.make_inputs``), the float64 attention over the cache
quantized by the reference encoder and dequantized (``fixtures.fp8_quantize``:
per tensor, and per (token, kv head)) against the float64 attention over the
unquantized cache: max and mean |error| of ``out``, with max |out| for scale.
No kernel runs here: the kernels are judged over the dequantized cache (the
sweep's ``decode_fp8`` / ``decode_fp8_tok``), and this table says what the
format itself costs.

``mla_table`` is the same for the fp8 latent cache (``mla.fp8``; the sweep's
``mla_fp8`` / ``mla_fp8_tok``): per MLA shape the fp8 entries run and fixture,
the float64 MLA attention over the quantized and dequantized c_kv (and k_pe
stored as float16, the format's RoPE part) against the float64 attention over
the float32 inputs, per tensor and per token side by side.
"""

from __future__ import annotations

import numpy as np

from validation import fixtures, registry


def table(*, small, seed=0, quick=False):
    """[{shape, fixture, max_out, tensor_max, tensor_mean, token_head_max,
    token_head_mean}]: one row a (decode shape, fixture)."""
    from attention.oracle import decode_attention_ref

    rows = []
    for shape in registry.shapes("decode", small):
        if quick and not shape.quick:
            continue
        for fixture in shape.fixtures:
            x = registry.make_inputs("decode", shape, fixture, seed)
            args = (x["seq_lens"], x["slot_table"])
            exact, _ = decode_attention_ref(x["q"], x["k_cache"], x["v_cache"], *args)
            row = {"shape": shape.name, "fixture": fixture,
                   "max_out": float(np.max(np.abs(exact), initial=0.0))}
            for mode in fixtures.FP8_MODES:
                y = fixtures.fp8_quantize(x, mode)
                out, _ = decode_attention_ref(y["q"], y["k_cache"], y["v_cache"], *args)
                err = np.abs(out - exact)
                row[f"{mode}_max"] = float(np.max(err, initial=0.0))
                row[f"{mode}_mean"] = float(np.mean(err)) if err.size else 0.0
            rows.append(row)
    return rows


def mla_table(*, small, seed=0, quick=False):
    """[{kind: "mla", shape, fixture, max_out, tensor_max, tensor_mean, token_max,
    token_mean}]: one row a (MLA shape the fp8 entries run, fixture)."""
    from mla.oracle import mla_attend_absorbed

    spec = registry.KERNELS_BY_NAME["mla_fp8"]
    rows = []
    for shape in registry.all_shapes("mla", small):
        if (quick and not shape.quick) or (shape.families and spec.family not in
                                           shape.families):
            continue
        for fixture in shape.fixtures:
            x = registry.make_inputs("mla", shape, fixture, seed)
            args = [x[n] for n in registry.MLA_ARGS]
            exact = mla_attend_absorbed(*args)
            row = {"kind": "mla", "shape": shape.name, "fixture": fixture,
                   "max_out": float(np.max(np.abs(exact), initial=0.0))}
            for mode in fixtures.MLA_FP8_MODES:
                y = fixtures.mla_fp8_quantize(x, mode)
                y["k_pe"] = fixtures.cast(x["k_pe"], "float16")
                err = np.abs(mla_attend_absorbed(*[y[n] for n in registry.MLA_ARGS]) - exact)
                row[f"{mode}_max"] = float(np.max(err, initial=0.0))
                row[f"{mode}_mean"] = float(np.mean(err)) if err.size else 0.0
            rows.append(row)
    return rows
