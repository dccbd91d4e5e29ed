"""``bench/mla_long.py``: the long-context MLA decode benchmark's rows.

* plain process: bad method / dtype names raise before any device work; the
  cache sizes the module states (fp16 2.42 GB, fp32 4.83 GB at L 32768);
* simulator / GPU (``device``): at a tiny shape with a stand-in timer, every
  method gives a row naming the path taken and its chunks (the gemm rows
  chunked under a tiny budget, "gemm_unchunked" in one launch set), the
  work counts, and nothing is printed; a dtype whose cache does not fit the
  free memory gives a skipped row.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import mla_long as ML

TINY = dict(batch=3, heads=4, latent=64, rope=8, nope=24, v_dim=32, seq=9)


def test_bad_names_raise_and_sizes():
    with pytest.raises(ValueError, match="methods"):
        ML.bench_mla_long(object(), methods=("cublas",))
    with pytest.raises(ValueError, match="dtypes"):
        ML.bench_mla_long(object(), dtypes=("bfloat16",))
    assert ML.cache_bytes("float16") == 64 * 32768 * 576 * 2  # 2.42 GB
    assert ML.cache_bytes("float32") == 64 * 32768 * 576 * 4  # 4.83 GB
    assert ML.cache_bytes("float32") + (2 << 30) < 139 << 30  # fits an H200


class _OneCall:
    """A stand-in for ``bench.gpu.Timer``: runs ``fn`` once, reports 2 ms."""

    def time(self, fn, reps=1, warmup=0, host=False):
        fn()
        return 2.0


@pytest.mark.device
def test_rows_at_a_tiny_shape(monkeypatch, capsys):
    from numba import cuda

    from bench import gpu
    from mla import attn_gemm as G
    from mla import pipeline as P

    rng = np.random.default_rng(0)

    def random_array(shape, dtype, seed):
        return cuda.to_device((rng.random(shape) - 0.5).astype(dtype))

    monkeypatch.setattr(gpu, "random_array", random_array)
    limit = G.workspace_bytes(2, 4, 72, 9)  # two sequences a chunk
    monkeypatch.setattr(P, "GEMM_WORKSPACE_LIMIT", limit)
    rows = ML.bench_mla_long(_OneCall(), dtypes=("float16",), shape=TINY, free_bytes=1 << 40)
    assert capsys.readouterr().out == ""
    by = {r["method"]: r for r in rows}
    assert list(by) == list(ML.METHODS)
    assert (by["auto"]["path"], by["auto"]["chunks"], by["auto"]["chunk"]) == ("gemm", 2, 2)
    assert (by["gemm"]["path"], by["gemm"]["chunks"]) == ("gemm", 2)
    assert (by["gemm_unchunked"]["path"], by["gemm_unchunked"]["chunks"]) == ("gemm", 1)
    assert by["flash"]["path"] == "flash" and by["flash"]["scratch_bytes"] == 0
    assert by["auto"]["scratch_bytes"] <= limit < by["gemm_unchunked"]["scratch_bytes"]
    flop = 3 * 4 * (2 * 24 * 64 + 2 * 9 * 72 + 2 * 9 * 64 + 2 * 64 * 32)
    for r in rows:
        assert r["ms"] == 2.0 and r["flop"] == flop and r["bytes"] == 3 * 9 * 72 * 2
        assert r["TFLOPs"] == round(flop / 2e-3 / 1e12, 2)
        assert r["GBps"] == round(r["bytes"] / 2e-3 / 1e9, 1)
        assert r["reason"]
    skipped = ML.bench_mla_long(_OneCall(), dtypes=("float32",), methods=("auto",),
                                shape=TINY, free_bytes=1 << 20)
    assert len(skipped) == 1 and math.isnan(skipped[0]["ms"])
    assert "skipped" in skipped[0]["note"]
