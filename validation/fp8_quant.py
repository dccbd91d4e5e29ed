"""The fp8 e4m3 cache's quantization error: a property of the format, not of a kernel.

For each decode shape case and score fixture of the sweep (the first seed's
inputs, ``registry.make_inputs``), the float64 attention over the cache
quantized by the reference encoder and dequantized (``fixtures.fp8_quantize``:
per tensor, and per (token, kv head)) against the float64 attention over the
unquantized cache: max and mean |error| of ``out``, with max |out| for scale.
No kernel runs here (the rows are host work units of the validation run,
``QuantUnit``): the kernels are judged over the dequantized cache (the
sweep's ``decode_fp8`` / ``decode_fp8_tok``), and this table says what the
format itself costs.

The MLA rows (``QuantUnit`` kind "mla") are the same for the fp8 latent cache
(``mla.fp8``; the sweep's ``mla_fp8`` / ``mla_fp8_tok``): per MLA shape the fp8
entries run and fixture, the float64 MLA attention over the quantized and dequantized c_kv (and k_pe
stored as float16, the format's RoPE part) against the float64 attention over
the float32 inputs, per tensor and per token side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from validation import fixtures, registry


@dataclass(frozen=True)
class QuantUnit:
    """One row of the quantization table as a work unit of the validation run (it
    runs in a worker process beside the sweep, is sharded with it and obeys its
    deadline): ``kind`` "decode" or "mla", a shape case of that kind, a fixture,
    the seed of the inputs and the shape set (``small``)."""

    kind: str
    shape: str
    fixture: str
    seed: int
    small: bool

    @property
    def id(self):
        return f"fp8_quant/{self.kind}/{self.shape}/{self.fixture}"

    def run(self):
        """The row: ``table``'s dict, or for "mla" the same with ``token_*`` keys."""
        shape = registry.find_shape(self.kind, self.shape, self.small)
        return (_decode_row if self.kind == "decode" else _mla_row)(shape, self.fixture,
                                                                    self.seed)

    def failed(self, detail):
        """The row of a unit that did not run (worker crash, deadline)."""
        return {"kind": self.kind, "shape": self.shape, "fixture": self.fixture,
                "detail": detail}


def units(*, decode, mla, small, seed=0, quick=False):
    """The table's rows as ``QuantUnit`` s: decode rows when ``decode``, MLA rows
    (the shapes the fp8 MLA entries run) when ``mla``."""
    out = []
    if decode:
        out += [QuantUnit("decode", s.name, f, seed, small)
                for s in registry.shapes("decode", small) if not quick or s.quick
                for f in s.fixtures]
    if mla:
        family = registry.KERNELS_BY_NAME["mla_fp8"].family
        out += [QuantUnit("mla", s.name, f, seed, small)
                for s in registry.all_shapes("mla", small)
                if (not quick or s.quick) and (not s.families or family in s.families)
                for f in s.fixtures]
    return out


def table(*, small, seed=0, quick=False):
    """[{kind: "decode", shape, fixture, max_out, tensor_max, tensor_mean,
    token_head_max, token_head_mean}]: one row a (decode shape, fixture)."""
    return [u.run() for u in units(decode=True, mla=False, small=small, seed=seed,
                                   quick=quick)]


def _decode_row(shape, fixture, seed):
    from attention.oracle import decode_attention_ref

    x = registry.make_inputs("decode", shape, fixture, seed)
    args = (x["seq_lens"], x["slot_table"])
    exact, _ = decode_attention_ref(x["q"], x["k_cache"], x["v_cache"], *args)
    row = {"kind": "decode", "shape": shape.name, "fixture": fixture,
           "max_out": float(np.max(np.abs(exact), initial=0.0))}
    for mode in fixtures.FP8_MODES:
        y = fixtures.fp8_quantize(x, mode)
        out, _ = decode_attention_ref(y["q"], y["k_cache"], y["v_cache"], *args)
        err = np.abs(out - exact)
        row[f"{mode}_max"] = float(np.max(err, initial=0.0))
        row[f"{mode}_mean"] = float(np.mean(err)) if err.size else 0.0
    return row


def _mla_row(shape, fixture, seed):
    from mla.oracle import mla_attend_absorbed

    x = registry.make_inputs("mla", shape, fixture, seed)
    exact = mla_attend_absorbed(*[x[n] for n in registry.MLA_ARGS])
    row = {"kind": "mla", "shape": shape.name, "fixture": fixture,
           "max_out": float(np.max(np.abs(exact), initial=0.0))}
    for mode in fixtures.MLA_FP8_MODES:
        y = fixtures.mla_fp8_quantize(x, mode)
        y["k_pe"] = fixtures.cast(x["k_pe"], "float16")
        err = np.abs(mla_attend_absorbed(*[y[n] for n in registry.MLA_ARGS]) - exact)
        row[f"{mode}_max"] = float(np.max(err, initial=0.0))
        row[f"{mode}_mean"] = float(np.mean(err)) if err.size else 0.0
    return row
