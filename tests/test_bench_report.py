"""The benchmark's report code (bench.run), on host arrays: no GPU, no kernels.

The MLA rows' accuracy column compares each output with the float64 absorbed
oracle; these tests check it measures what it says (zero for the oracle itself,
the numpy float32 baseline's own error for that baseline, and a planted
perturbation shows up), and that the summary prints it and judges the target
against the TF32-off einsum row only.
"""

from __future__ import annotations

import numpy as np

from bench import run
from mla.oracle import mla_attend_float32


def _inputs(seed=0, b=3, nh=4, nope=8, rope=4, lat=16, vd=8, seq=33):
    rng = np.random.default_rng(seed)
    f = np.float32
    return (rng.standard_normal((b, nh, nope)).astype(f),
            rng.standard_normal((b, nh, rope)).astype(f),
            rng.standard_normal((b, seq, lat + rope)).astype(f),
            rng.standard_normal((nh, nope, lat)).astype(f) * f(0.3),
            rng.standard_normal((nh, vd, lat)).astype(f) * f(0.3), lat)


def test_mla_check_measures_against_the_oracle():
    qn, qp, cache, uk, uv, lat = _inputs()
    chk = run.MLACheck(qn, qp, cache, uk, uv, lat)
    n = run.MLACheck.N
    assert chk.ref.shape == (n, qn.shape[1], uv.shape[1])
    # the oracle against itself: zero; padding rows past N are ignored
    padded = np.concatenate([chk.ref, np.full((1,) + chk.ref.shape[1:], np.nan)])
    assert chk.error(padded) == 0.0
    # the float32 baseline: its own error, which is small but not zero
    base = np.stack([mla_attend_float32(qn[i:i + 1], qp[i:i + 1], cache[i, :, :lat],
                                        cache[i, :, lat:], uk, uv)[0] for i in range(n)])
    assert chk.error(base) == chk.base_err
    assert 0 < chk.base_err < 1e-5
    # positive control: one perturbed element in the last checked sequence
    bad = chk.ref.copy()
    bad[n - 1, 2, 3] += 1e-3
    assert abs(chk.error(bad) - 1e-3) < 1e-9


def _mla_row(kernel, dtype, ms, frac):
    return {"kernel": kernel, "dtype": dtype, "batch": 64, "heads": 128, "latent": 512,
            "rope": 64, "seq_len": 4096, "ms": ms, "TFLOPs": 30.0, "frac_of_fma_peak": frac,
            "max_err": 3e-5, "numpy_fp32_err": 2e-5}


def test_summary_judges_mla_against_the_tf32_off_einsum(tmp_path):
    rows = [_mla_row("mla_decode_graph", "float32", 1.7, 0.76),
            _mla_row("mla_decode_graph_fma", "float32", 2.3, 0.56),
            _mla_row("torch_einsum", "float32", 1.85, 0.70),
            _mla_row("torch_einsum_tf32", "float32", 0.9, 1.4)]
    out = tmp_path / "summary.md"
    run.summary(out, {"git_commit": "x"}, {"copy_GBps": 4000.0, "fma_TFLOPs": 58.0},
                [], rows, [], [], [])
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("- MLA decode")]
    assert any("(mla_decode_graph) float32" in ln and "1.09x torch einsum" in ln
               and "(met" in ln for ln in lines), lines
    assert any("(mla_decode_graph_fma) float32" in ln and "MISSED" in ln for ln in lines), lines
    assert "| torch_einsum_tf32 | float32 | 0.900 |" in text
    assert "| 3e-05 | 2e-05 |" in text


def test_fp16_mla_is_judged_against_the_fp16_einsum_not_the_upcast(tmp_path):
    # the upcast einsum (fp32 math) is slower than ours and is printed as context;
    # the verdict still compares with the all-fp16 einsum, which is faster here
    rows = [_mla_row("mla_decode_graph", "float16", 1.3, 0.97),
            _mla_row("torch_einsum", "float16", 0.65, 2.0),
            _mla_row("torch_einsum_upcast", "float16", 2.6, 0.5)]
    out = tmp_path / "summary.md"
    run.summary(out, {"git_commit": "x"}, {"copy_GBps": 4000.0, "fma_TFLOPs": 58.0},
                [], rows, [], [], [])
    lines = [ln for ln in out.read_text().splitlines() if ln.startswith("- MLA decode")]
    assert len(lines) == 1, lines
    assert "0.50x torch einsum speed" in lines[0] and "(MISSED" in lines[0], lines
    assert "context: 2.00x the speed of torch einsum with our roundings" in lines[0], lines


def test_partials_rejects_bad_lengths_and_needs_a_gpu():
    import pytest

    from attention import tgemm
    from bench import partials

    ks = tgemm.PLAN[4] // 8  # k8 steps a slice: a partial divides it or is whole slices
    for bad in ("0", str(ks + 2) if ks > 2 else "-1"):
        with pytest.raises(SystemExit, match="part_steps: expected positive divisors"):
            partials.main([bad])
    with pytest.raises(SystemExit, match="--steps: expected 0 or more"):
        partials.main(["--steps", "-1", "4"])
    from numba import cuda

    if not cuda.is_available():
        with pytest.raises(SystemExit, match="needs a GPU"):
            partials.main(["4"])
