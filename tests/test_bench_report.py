"""The benchmark's report code (bench.run), on host arrays: no GPU, no kernels.

The MLA rows' accuracy column compares each output, every sequence of the
batch, with a vectorised float64 absorbed decode; these tests check that it
agrees with the loop oracle (mla.oracle), that it measures what it says (zero
for the oracle itself, the numpy float32 baseline's own error for that
baseline, and a planted perturbation in the last sequence shows up), and that
the summary prints it, gives tensor-core rows as a fraction of the tf32 peak,
and judges the target against the TF32-off einsum row only. The SDPA labels
(bench.sdpa) are checked on kernel names, and every bench module imports
without torch.
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


def test_batch_decode_matches_the_loop_oracle():
    from mla.oracle import mla_attend_absorbed

    qn, qp, cache, uk, uv, lat = _inputs()
    vec = run.mla_decode_batch(qn, qp, cache, uk, uv, lat, np.float64, chunk=2)
    loop = np.stack([mla_attend_absorbed(qn[i:i + 1], qp[i:i + 1], cache[i, :, :lat],
                                         cache[i, :, lat:], uk, uv)[0]
                     for i in range(qn.shape[0])])
    assert vec.dtype == np.float64 and vec.shape == loop.shape
    assert np.abs(vec - loop).max() < 1e-12


def test_mla_check_measures_against_the_oracle():
    qn, qp, cache, uk, uv, lat = _inputs()
    chk = run.MLACheck(qn, qp, cache, uk, uv, lat)
    n = qn.shape[0]
    assert chk.n == n and chk.ref.shape == (n, qn.shape[1], uv.shape[1])
    assert chk.error(chk.ref) == 0.0  # the oracle against itself
    # the float32 baseline: its own error, which is small but not zero; the loop
    # float32 baseline of mla.oracle errs by as much
    base = np.stack([mla_attend_float32(qn[i:i + 1], qp[i:i + 1], cache[i, :, :lat],
                                        cache[i, :, lat:], uk, uv)[0] for i in range(n)])
    assert 0 < chk.base_err < 1e-5
    assert chk.error(base) < 10 * chk.base_err
    # positive control: one perturbed element in the last sequence (every one is checked)
    bad = chk.ref.copy()
    bad[n - 1, 2, 3] += 1e-3
    assert abs(chk.error(bad) - 1e-3) < 1e-9


def _mla_row(kernel, dtype, ms, frac, peak="fp32_fma"):
    return {"kernel": kernel, "dtype": dtype, "batch": 64, "heads": 128, "latent": 512,
            "rope": 64, "seq_len": 4096, "ms": ms, "TFLOPs": 30.0, "peak": peak,
            "frac_of_peak": frac, "max_err": 3e-5, "numpy_fp32_err": 2e-5}


CEILINGS = {"copy_GBps": 4000.0, "fma_TFLOPs": 58.0, "tf32_TFLOPs": 400.0,
            "bf16_TFLOPs": 750.0}


def test_summary_judges_mla_against_the_tf32_off_einsum(tmp_path):
    rows = [_mla_row("mla_decode_graph", "float32", 1.7, 0.6, "tf32_tc"),
            _mla_row("mla_decode_graph_fma", "float32", 2.3, 0.56),
            _mla_row("torch_einsum", "float32", 1.85, 0.70),
            _mla_row("torch_einsum_tf32", "float32", 0.9, 0.2, "tf32_tc")]
    out = tmp_path / "summary.md"
    run.summary(out, {"git_commit": "x"}, CEILINGS, [], rows, [], [], [])
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("- MLA decode")]
    assert any("(mla_decode_graph) float32" in ln and "1.09x torch einsum" in ln
               and "of the tf32 tensor-core peak" in ln and "(met" in ln for ln in lines), lines
    assert any("(mla_decode_graph_fma) float32" in ln and "of the fp32 FMA peak" in ln
               and "MISSED" in ln for ln in lines), lines
    assert "| torch_einsum_tf32 | float32 | 0.900 | 30.00 | 0.200 | tf32 tensor-core peak |" \
        in text
    assert "| 3e-05 | 2e-05 |" in text
    assert "tf32 (fp32 operands, allow_tf32) **400.0 TFLOP/s**" in text
    assert "over all 64 sequences" in text


def test_tensor_core_rows_are_never_a_fraction_of_the_fma_peak():
    peaks = {"fp32_fma": 50.0, "tf32_tc": 400.0, "bf16_tc": None}
    assert run.frac_of_peak(40.0, peaks, "tf32_tc") == 0.1
    assert run.frac_of_peak(40.0, peaks, "fp32_fma") == 0.8
    assert run.frac_of_peak(40.0, peaks, "bf16_tc") is None  # not measured: no fraction


def test_summary_without_tensor_core_peaks_does_not_judge(tmp_path):
    rows = [_mla_row("mla_decode_graph", "float32", 1.7, None, "tf32_tc")]
    out = tmp_path / "summary.md"
    run.summary(out, {"git_commit": "x"}, {"copy_GBps": 4000.0, "fma_TFLOPs": 58.0},
                [], rows, [], [], [])
    text = out.read_text()
    assert "tf32 (fp32 operands, allow_tf32) not measured" in text
    assert "not judged: the tf32 tensor-core peak was not measured" in text
    assert "| n/a | tf32 tensor-core peak |" in text


def test_fp16_mla_is_judged_against_the_fp16_einsum_not_the_upcast(tmp_path):
    # the upcast einsum (fp32 math) is slower than ours and is printed as context;
    # the verdict still compares with the all-fp16 einsum, which is faster here
    rows = [_mla_row("mla_decode_graph", "float16", 1.3, 0.4, "tf32_tc"),
            _mla_row("torch_einsum", "float16", 0.65, 0.2, "bf16_tc"),
            _mla_row("torch_einsum_upcast", "float16", 2.6, 0.5)]
    out = tmp_path / "summary.md"
    run.summary(out, {"git_commit": "x"}, CEILINGS, [], rows, [], [], [])
    lines = [ln for ln in out.read_text().splitlines() if ln.startswith("- MLA decode")]
    assert len(lines) == 1, lines
    assert "0.50x torch einsum speed" in lines[0] and "(MISSED" in lines[0], lines
    assert "context: 2.00x the speed of torch einsum with our roundings" in lines[0], lines
    assert "2 tf32 MMAs a product: at most 0.5 of it" in lines[0], lines


def _decode_row(kernel, dtype, gbps, b=32, seq=4096):
    return {"kernel": kernel, "dtype": dtype, "batch": b, "heads": 32, "kv_heads": 8,
            "head_dim": 128, "seq_len": seq, "ms": 0.1, "GBps": gbps,
            "frac_of_copy": gbps / 4000.0}


def test_sdpa_target_uses_the_gqa_row_not_the_expanded_one(tmp_path):
    rows = [_decode_row("fast", "float16", 3800.0),
            _decode_row("torch_sdpa[flash]", "float16", 4000.0),
            _decode_row("torch_sdpa_expanded[efficient]", "float16", 9000.0),
            _decode_row("torch_sdpa[math]", "float32", 200.0),
            _decode_row("torch_sdpa_expanded[efficient]", "float32", 1500.0)]
    assert run.best(rows, "torch_sdpa", "float16", 32, 4096, exact=True)["GBps"] == 4000.0
    assert run.best(rows, "torch_sdpa", "float16", 32, 4096)["GBps"] == 9000.0  # prefix
    out = tmp_path / "summary.md"
    run.summary(out, {"git_commit": "x"}, CEILINGS, rows, [], [], [], [])
    text = out.read_text()
    assert "- float16 B=32 L=4096: 0.950 of torch_sdpa[flash] (met" in text
    assert "| torch_sdpa[math] | float32 | 32 | 4096 |" in text
    assert "| torch_sdpa_expanded[efficient] | float32 | 32 | 4096 |" in text


def test_sdpa_backend_from_kernel_names():
    from bench import sdpa

    flash = ["void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>",
             "void pytorch_flash::flash_fwd_splitkv_combine_kernel<>"]
    cudnn = ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]
    eff = ["fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)"]
    math_ = ["ampere_sgemm_128x64_nn", "void at::native::(anonymous namespace)::"
             "cunn_SoftMaxForward<4, float, float, float>", "ampere_sgemm_128x64_nn"]
    assert sdpa.classify_kernels(flash) == "flash"
    assert sdpa.classify_kernels(cudnn) == "cudnn"
    assert sdpa.classify_kernels(eff) == "efficient"
    assert sdpa.classify_kernels(math_) == "math"
    assert sdpa.classify_kernels([]) is None
    # without kernel names: the only backend that runs alone, else the candidates
    assert sdpa.choose_label("flash", ["flash", "math"]) == "flash"
    assert sdpa.choose_label(None, ["math"]) == "math"
    assert sdpa.choose_label(None, ["efficient", "math"]) == "default of efficient|math"
    assert sdpa.choose_label(None, []) == "unknown"
    assert sdpa.label("torch_sdpa", "math") == "torch_sdpa[math]"
    assert sdpa.base_name("torch_sdpa_expanded[efficient]") == "torch_sdpa_expanded"


def test_prefill_summary_states_how_rows_are_timed():
    from bench import prefill

    rows = [{"kernel": "torch_sdpa[math]", "seq_len": 512, "heads": 32, "kv_heads": 8,
             "head_dim": 128, "ms": 1.0, "TFLOPs": 1.0, "frac_of_fma_peak": 0.02}]
    text = "\n".join(prefill.summary_lines(rows))
    assert "host work" in text and "enable_gqa" in text
    assert "| torch_sdpa[math] | 512 |" in text


def test_prefill_mma_summary_judges_the_t4096_ratio(tmp_path):
    """The 16-bit prefill section's target lines: the default plan at T 4096 only,
    each dtype, met at x0.5 torch SDPA's speed or more, MISSED below; a run with no
    torch row says "not measured", never met. The rows reach the bench summary and
    their own CSV through write_reports."""
    from bench import prefill_mma

    def row(dtype, t, ratio, default=True, kernel="prefill_mma[w8,n64]"):
        r = {"kernel": kernel, "dtype": dtype, "seq_len": t, "heads": 32, "kv_heads": 8,
             "head_dim": 128, "ms": 0.5, "TFLOPs": 270.0, "default": default,
             "frac_of_bf16_peak": 0.33, "max_err": 1e-3, "bound": 2e-3, "cos_diff": 1e-7,
             "nan_ok": True, "check": "PASS"}
        if ratio is not None:
            r["ratio_to_torch"] = ratio
        return r

    rows = [row("float16", 2048, 0.30), row("float16", 4096, 0.52),
            row("float16", 4096, 0.40, default=False, kernel="prefill_mma[w4,n64]"),
            row("bfloat16", 4096, 0.49), row("float32", 4096, None)]
    text = "\n".join(prefill_mma.summary_lines(rows))
    targets = [line for line in text.splitlines() if line.startswith("- prefill_mma")]
    assert len(targets) == 3, targets  # T 4096 default rows only
    assert "float16 T 4096: x0.52" in targets[0] and targets[0].count("met") == 1
    assert "MISSED" in targets[1] and "bfloat16" in targets[1]
    assert "not measured" in targets[2] and "met" not in targets[2]
    assert "| prefill_mma[w4,n64] | float16 | 4096 |" in text
    t = run.Tables()
    t.prefill_mma.extend(rows)
    out = tmp_path / "bench"
    out.mkdir()
    run.write_reports(out, {"git_commit": "x"}, CEILINGS, t, [])
    assert "## Prefill on 16-bit tensor cores" in (out / "summary.md").read_text()
    header = (out / "prefill_mma.csv").read_text().splitlines()[0]
    assert header == ",".join(prefill_mma.COLUMNS)


def test_bench_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import bench.run, bench.prefill, bench.prefill_mma, bench.sdpa, bench.gpu, "
            "bench.partials\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_partials_rejects_bad_lengths_and_needs_a_gpu():
    import pytest

    from attention.gemm import tgemm
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


def test_page_layout_puts_every_row_where_its_table_says():
    from bench.paged import page_layout

    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 3, 8, 4)).astype(np.float32)
    for layout in ("HND", "NHD"):
        for page in (1, 4, 8):
            pages, table = page_layout(k, page, layout, np.random.default_rng(1))
            assert table.shape == (2, 8 // page) and table.dtype == np.int32
            assert sorted(table.ravel()) == list(range(pages.shape[0]))
            if pages.shape[0] > 1:
                assert not np.array_equal(table.ravel(), np.arange(pages.shape[0]))
            for b in range(2):
                for p in range(8):
                    pg, off = table[b, p // page], p % page
                    row = pages[pg, :, off] if layout == "HND" else pages[pg, off]
                    assert np.array_equal(row, k[b, :, p])


def test_paged_summary_judges_each_target():
    from bench.paged import summary_lines

    def row(kernel, ms, vs=None, dname="float16", b=32, seq=4096, splits=1):
        return {"kernel": kernel, "dtype": dname, "batch": b, "seq_len": seq, "ms": ms,
                "GBps": 1.0, "frac_of_copy": 0.5, "vs_contiguous": vs, "n_split": splits,
                "max_abs_diff": 0.0}

    rows = [row("contiguous", 0.100), row("contiguous_invariant", 0.102, 0.98, splits=4),
            row("paged_HND_p16", 0.104, 0.96), row("paged_HND_p1", 0.120, 0.83),
            row("torch_sdpa[flash]", 0.110),
            row("contiguous", 0.050, b=1, seq=32768, splits=32),
            row("contiguous_invariant", 0.060, b=1, seq=32768, splits=32)]
    text = "\n".join(summary_lines(rows))
    assert "paged_HND_p16 float16 B 32 / L 4096: x0.960 of contiguous (target >= 0.97): MISSED" \
        in text
    assert "paged_HND_p1 float16 B 32 / L 4096: x0.830 of contiguous (target >= 0.8): met" in text
    assert "against torch_sdpa[flash] (contiguous): x1.058 (target >= 1.0): met" in text
    assert "batch-invariant cost float16 B 32 / L 4096: +2.0 %" in text
    assert "batch-invariant cost float16 B 1 / L 32768: +20.0 %" in text and "MISSED" in text


def test_paged_summary_judges_each_fp8_row():
    """Every fp8 row (tensor-core and CUDA-core, both scale modes) is judged by
    the fp8 issue's copy fraction, with its speed against the fp16 plan's and
    torch's; a shape without fp8 rows gives no fp8 line."""
    from bench.paged import FP8_ROWS, summary_lines

    def row(kernel, ms, frac, b=32, seq=4096):
        return {"kernel": kernel, "dtype": "float16", "batch": b, "seq_len": seq, "ms": ms,
                "GBps": 1.0, "frac_of_copy": frac, "vs_contiguous": None, "n_split": 1,
                "max_abs_diff": None}

    rows = [row("contiguous", 0.130, 0.95), row("torch_sdpa[flash]", 0.156, 0.8),
            row("contiguous_fp8", 0.078, 0.91), row("contiguous_fp8_fast", 0.123, 0.51)]
    text = "\n".join(summary_lines(rows))
    assert ("- contiguous_fp8 B 32 / L 4096: 0.910 of copy (target >= 0.9), x1.67 the fp16 "
            "plan's speed, x2.00 torch_sdpa[flash] fp16's: met") in text
    assert "- contiguous_fp8_fast B 32 / L 4096: 0.510 of copy (target >= 0.9)" in text
    assert "contiguous_fp8_fast B 32 / L 4096: 0.510 of copy (target >= 0.9), x1.06 the fp16 " \
        "plan's speed, x1.27 torch_sdpa[flash] fp16's: MISSED" in text
    assert "B 1 / L 32768" not in text
    assert [r[0] for r in FP8_ROWS] == ["contiguous_fp8", "contiguous_fp8_fast",
                                        "contiguous_fp8_tok", "contiguous_fp8_tok_fast"]


def test_paged_summary_gives_the_tensor_core_invariance_cost():
    """The T_q 4 (tensor-core) plans' batch-invariant cost is judged beside the
    T_q 1 one's, against its own default plan."""
    from bench.paged import summary_lines

    def row(kernel, ms, b=32, seq=4096, splits=1):
        return {"kernel": kernel, "dtype": "float16", "batch": b, "seq_len": seq, "ms": ms,
                "GBps": 1.0, "frac_of_copy": 0.5, "vs_contiguous": None, "n_split": splits,
                "max_abs_diff": None}

    rows = [row("contiguous_t4", 0.100), row("contiguous_t4_invariant", 0.101, splits=2),
            row("contiguous_t4", 0.050, b=1, seq=32768, splits=32),
            row("contiguous_t4_invariant", 0.055, b=1, seq=32768, splits=32)]
    text = "\n".join(summary_lines(rows))
    assert ("- batch-invariant cost (T_q 4, tensor cores) float16 B 32 / L 4096: +1.0 % "
            "(splits 1 -> 2; default if <= 3 % at both shapes): met") in text
    assert ("- batch-invariant cost (T_q 4, tensor cores) float16 B 1 / L 32768: +10.0 %"
            in text)


def test_a_cut_bench_leaves_a_report_that_says_so(tmp_path):
    """bench.run writes its reports after every section: a run cut by a time limit
    leaves the sections it measured, its provenance saying "interrupted" and which
    sections it did not reach, and --check-fresh reads it as partial."""
    from validation import gpu_reports
    from validation.provenance import criterion_hash, kernel_source_hash

    out = tmp_path / "reports" / "bench"
    out.mkdir(parents=True)
    (out / "paged.csv").write_text("an earlier run's rows\n")
    t = run.Tables()
    t.decode.append(dict(zip(run.COLUMNS, ("fast", "float16", 32, 32, 8, 128, 4096, 0.181,
                                           2970.0, 0.97))))
    prov = {"git_commit": "x", "kernel_source_hash": kernel_source_hash(),
            "interrupted": True, "sections_not_reached": ["paged", "mla_multi"]}
    run.write_reports(out, prov, CEILINGS, t, ["prefill: cut by an interrupt during this "
                                               "section", "paged: not reached"])
    text = (out / "summary.md").read_text()
    assert "## Parts that did not run" in text and "- paged: not reached" in text
    assert (out / "decode.csv").read_text().splitlines()[0] == ",".join(run.COLUMNS)
    assert not (out / "paged.csv").exists(), "a section with no rows keeps no older CSV"
    rows = {r["path"]: r["state"] for r in gpu_reports.inventory(
        tmp_path / "reports", kernel_source_hash(), criterion_hash())}
    assert rows == {"bench/summary.md": "partial"}
    # control: the same report of a finished run is fresh
    run.write_reports(out, dict(prov, interrupted=False, sections_not_reached=[]), CEILINGS, t, [])
    rows = {r["path"]: r["state"] for r in gpu_reports.inventory(
        tmp_path / "reports", kernel_source_hash(), criterion_hash())}
    assert rows == {"bench/summary.md": "fresh"}


def _fake_gpu_bench(monkeypatch, device="Fake GPU 141GB"):
    """bench.run.main with its GPU parts replaced: the ceilings, every section
    (each records that it ran; host adds a row, decode a spot check) and the GPU's
    name. Returns the list the sections append their names to."""
    import sys

    from numba import cuda

    import attention.core.device as device_mod
    from bench import gpu

    class FakeTimer:
        hold_us, raised = 0.0, []

    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not importable
    monkeypatch.setattr(gpu, "Timer", FakeTimer)
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda timer: (3000.0, 2.8))
    monkeypatch.setattr(gpu, "fma_peak", lambda timer: (58.0, 1.0))
    monkeypatch.setattr(device_mod, "device_name", lambda: device)
    calls = []

    def host(timer, torch, rows, checks):
        calls.append("host")
        rows.append({"call": "DecodePlan.run (numba device arrays)", "dtype": "float16",
                     "batch": 32, "heads": 32, "kv_heads": 8, "head_dim": 128,
                     "seq_len": 4096, "host_us_median": 12.0, "host_us_min": 10.1,
                     "host_us_back_to_back": 11.0, "kernel_ms": 0.18, "note": ""})
        checks.append(("DecodePlan.run", "float16", 32, 4096, 1.5e-4))

    def decode(timer, copy_gbps, torch, variants, rows, checks, quick):
        calls.append("decode")
        checks.append(("fast", "float16", 1, 32768, 2.5e-4))

    def returns_rows(name):
        def fn(*a, **k):
            calls.append(name)
            return []
        return fn

    def appends(name):
        def fn(*a, **k):
            calls.append(name)
        return fn

    monkeypatch.setattr(run, "bench_host", host)
    monkeypatch.setattr(run, "bench_decode", decode)
    for name, fn in (("bench_mla", appends("mla")), ("bench_mla_mma", returns_rows("mla_mma")),
                     ("bench_step", appends("step")), ("bench_long_mla", appends("mla_long")),
                     ("bench_prefill", appends("prefill")), ("bench_paged", appends("paged")),
                     ("bench_mla_multi", returns_rows("mla_multi")),
                     ("bench_prefill_mma", returns_rows("prefill_mma"))):
        monkeypatch.setattr(run, name, fn)
    return calls


def _run_cut_by_an_interrupt(out):
    """bench.run.main into ``out``, which a section's interrupt ends (exit status
    130, as scripts/gpu_all's time limit leaves it); the summary's text."""
    import pytest

    with pytest.raises(SystemExit) as stop:
        run.main(["--out", str(out)])
    assert stop.value.code == 130
    return (out / "summary.md").read_text()


def test_an_interrupt_in_a_section_writes_the_sections_before_it(tmp_path, monkeypatch):
    """bench.run.main's own loop, its GPU parts replaced: the host section runs, the
    decode section is interrupted (scripts/gpu_all's time limit sends SIGINT), and
    the report says so, with the sections after it not reached; exit status 130."""
    _fake_gpu_bench(monkeypatch)

    def decode(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "bench_decode", decode)
    text = _run_cut_by_an_interrupt(tmp_path)
    assert '"interrupted": true' in text and '"section_cut": "decode"' in text
    assert "- decode: cut by an interrupt during this section" in text
    for later in ("mla", "mla_mma", "step", "mla_long", "prefill", "paged", "mla_multi"):
        assert f"- {later}: not reached (the run was cut before it)" in text, later
    assert "host: not reached" not in text and (tmp_path / "host.csv").exists()


def test_skip_then_resume_makes_one_whole_report(tmp_path, monkeypatch):
    """The whole bench in two runs: ``--skip`` leaves sections out and the report says
    so (partial for --check-fresh); ``--resume`` runs only those, keeps the first run's
    rows, names both runs, and the report is then whole (fresh). Controls: a resume
    refuses a report of other kernel sources or another GPU, before running anything
    and without touching it; an unknown section name in --skip is an error."""
    import json

    import pytest

    from validation import gpu_reports, provenance
    from validation.provenance import criterion_hash, kernel_source_hash

    out = tmp_path / "reports" / "bench"
    calls = _fake_gpu_bench(monkeypatch)
    later = ",".join(run.SECTIONS[2:])
    run.main(["--out", str(out), "--skip", later])
    assert calls == ["host", "decode"]
    text = (out / "summary.md").read_text()
    for name in run.SECTIONS[2:]:
        assert f"- {name}: skipped (--skip" in text, name

    def state():
        return {r["path"]: r["state"] for r in gpu_reports.inventory(
            tmp_path / "reports", kernel_source_hash(), criterion_hash())}
    assert state() == {"bench/summary.md": "partial"}

    # controls: another GPU model, other kernel sources: refused, report untouched
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls.clear()
    _fake_gpu_bench(monkeypatch, device="Another GPU")
    with pytest.raises(SystemExit) as stop:
        run.main(["--out", str(out), "--resume"])
    assert stop.value.code == 2
    monkeypatch.setattr(provenance, "kernel_source_hash", lambda: "0123456789abcdef")
    calls = _fake_gpu_bench(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        run.main(["--out", str(out), "--resume"])
    assert stop.value.code == 2 and calls == []
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()

    calls = _fake_gpu_bench(monkeypatch)
    run.main(["--out", str(out), "--resume"])
    assert calls == list(run.SECTIONS[2:]), "a resume runs only the missing sections"
    text = (out / "summary.md").read_text()
    assert "skipped (--skip" not in text and "not reached" not in text
    assert "| DecodePlan.run (numba device arrays)" in text, "the first run's host row"
    assert text.index("| DecodePlan.run | float16") < text.index("| fast | float16"), \
        "the spot checks keep the order of their sections"
    assert "- measured in 2 runs on this GPU (`--resume`)" in text
    doc = json.loads((out / "tables.json").read_text())
    assert doc["sections_done"] == list(run.SECTIONS)
    parts = doc["provenance"]["parts"]
    assert [p["sections"] for p in parts] == [["host", "decode"], list(run.SECTIONS[2:])]
    assert state() == {"bench/summary.md": "fresh"}

    with pytest.raises(SystemExit) as stop:  # a section name not in the bench
        run.main(["--out", str(out), "--skip", "decode,pagd"])
    assert stop.value.code == 2


def test_resume_runs_a_cut_section_again_without_its_partial_rows(tmp_path, monkeypatch):
    """A section cut by the time limit may have appended rows before the interrupt;
    ``--resume`` runs it from an empty table, so its rows are not doubled, and the
    cut line leaves the report."""
    import json


    calls = _fake_gpu_bench(monkeypatch)

    row = {"batch": 1, "heads": 128, "latent": 512, "rope": 64, "seq_len": 32768,
           "dtype": "float16", "method": "auto", "path": "half a section", "chunks": 4,
           "ms": 1.0, "TFLOPs": 1.0, "GBps": 1.0, "note": ""}

    def cut_long(timer, rows):
        rows.append(row)
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "bench_long_mla", cut_long)
    text = _run_cut_by_an_interrupt(tmp_path)
    assert "- mla_long: cut by an interrupt" in text and "| half a section |" in text
    done = json.loads((tmp_path / "tables.json").read_text())["sections_done"]
    assert "mla_long" not in done and "step" in done

    seen = []

    def long_mla(timer, rows):
        seen.append(list(rows))

    calls = _fake_gpu_bench(monkeypatch)
    monkeypatch.setattr(run, "bench_long_mla", long_mla)
    run.main(["--out", str(tmp_path), "--resume"])
    assert seen == [[]], "the resumed section starts from an empty table"
    assert calls == ["prefill", "paged", "mla_multi", "prefill_mma"]
    text = (tmp_path / "summary.md").read_text()
    assert "cut by an interrupt" not in text and "not reached" not in text
    assert "half a section" not in text, "the cut run's rows are not kept"
