"""Prefill benchmark: the fused product kernel (``attention.prefill.kernels``), the
float32 tensor-core kernel (``attention.prefill.tf32``, split tf32 operands,
``prefill_attention(method="tf32")``), the batched and per-head reference paths
(``attention.reference.prefill_paths``) and torch SDPA.

Shapes: T in {512, 2048, 4096}, H 32, H_kv 8, D 128, causal, float32.
FLOP count: the two matrix products Q.K^T and P.V, 2 * 2 * T * T * H * D for
full attention, half of it for causal (only the visible scores are needed), so
the rate of a method that computes the masked half anyway is understated the
same way for all. Softmax, scale and layout work are not counted. TFLOP/s is
set against the fp32 FMA peak measured in the same run.

Timing: every row the same way: CUDA events around one call, host work
included (``host=True``: ours are public launchers that may allocate and free
scratch; torch's rows are timed with their host work too), the L2 flushed
before each repeat, median of 5.
GQA: as in the decode benchmark, torch gets K/V unexpanded ([H_kv, T, D]) with
``enable_gqa`` (row ``torch_sdpa[<backend>]``, the backend that ran:
bench/sdpa.py), as ours do; ``torch_sdpa_expanded[efficient]`` runs the
memory-efficient backend on K/V repeat_interleave'd to all H heads before
timing (the expansion is not timed).
"""

from __future__ import annotations

import math

import numpy as np

PREFILL_SHAPES = [(512, 32, 8, 128), (2048, 32, 8, 128), (4096, 32, 8, 128)]
# fused and tf32: the product's two kernels; the others: reference paths
METHODS = ("fused", "tf32", "batched", "per_head")
# other plans of the tf32 kernel timed beside its default (row name -> plan keywords):
# 8 warps a block (128 query rows) took 9 % off the 16-bit kernel's time at D 128
# (notes/bench.md); whether the tf32 kernel gains the same is what this row measures
TF32_PLANS = {"tf32[w8]": {"warps": 8}}
COLUMNS = ["kernel", "dtype", "seq_len", "heads", "kv_heads", "head_dim", "causal", "ms",
           "TFLOPs", "frac_of_fma_peak", "frac_of_bf16_peak"]


def prefill_flops(t_len, heads, head_dim, causal=True):
    full = 4.0 * t_len * t_len * heads * head_dim
    return full / 2 if causal else full


def bench_prefill(timer, fma_tflops, torch, rows, log, bf16_tflops=None):
    """Prefill rows into ``rows``: each method of ``METHODS`` and torch SDPA at
    ``PREFILL_SHAPES``; ``fma_tflops``: the fp32 FMA peak of the run,
    ``bf16_tflops``: its bf16 tensor-core peak (None: not measured, the column
    left empty)."""
    from numba import cuda

    from attention.prefill.kernels import prefill_attention
    from attention.reference.prefill_paths import prefill_attention_reference

    from .gpu import random_array

    from attention.prefill.tf32 import prefill_attention_tf32

    entry = {"fused": prefill_attention, "tf32": prefill_attention,
             "batched": prefill_attention_reference, "per_head": prefill_attention_reference}
    for name, plan_kw in TF32_PLANS.items():
        entry[name] = (lambda q, k, v, h, method=None, plan_kw=plan_kw, **kw:
                       prefill_attention_tf32(q, k, v, h, **plan_kw, **kw))

    for t_len, h, kv, d in PREFILL_SHAPES:
        flops = prefill_flops(t_len, h, d)
        q = random_array((t_len, h * d), np.float32, 31)
        k = random_array((t_len, kv * d), np.float32, 32)
        v = random_array((t_len, kv * d), np.float32, 33)

        def record(name, ms, note=""):
            tf = flops / (ms * 1e-3) / 1e12
            rows.append({"kernel": name, "dtype": "float32", "seq_len": t_len, "heads": h,
                         "kv_heads": kv, "head_dim": d, "causal": True, "ms": round(ms, 4),
                         "TFLOPs": round(tf, 2), "frac_of_fma_peak": round(tf / fma_tflops, 3),
                         "frac_of_bf16_peak": round(tf / bf16_tflops, 3) if bf16_tflops
                         else None})
            log(f"  prefill {name:<10} T={t_len:<5} {ms:9.3f} ms {tf:7.2f} TFLOP/s {note}")

        st = cuda.default_stream()
        for method in METHODS + tuple(TF32_PLANS):
            try:
                def run(method=method):
                    entry[method](q, k, v, h, n_kv_heads=kv, causal=True, method=method,
                                  stream=st)

                # a public launcher (host work included): it may allocate and free
                # scratch, and a free waits for the device, which the timer's
                # cover check would take for a late start
                record(method, timer.time(run, reps=5, warmup=1, host=True),
                       "(public launcher: host work included)")
            except Exception as exc:  # an optional part: recorded, never fatal
                log(f"  prefill {method} T={t_len}: skipped ({type(exc).__name__}: "
                    f"{str(exc)[:160]})")
        if torch is not None:
            try:
                from .gpu import TorchTimer
                from .sdpa import backend_of, label, run_with

                tt = TorchTimer(torch)
                tq = torch.as_tensor(q, device="cuda").view(t_len, h, d).transpose(0, 1)
                tk = torch.as_tensor(k, device="cuda").view(t_len, kv, d).transpose(0, 1)
                tv = torch.as_tensor(v, device="cuda").view(t_len, kv, d).transpose(0, 1)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                scale = 1.0 / math.sqrt(d)

                def run_sdpa():
                    sdpa(tq[None], tk[None], tv[None], is_causal=True, scale=scale,
                         enable_gqa=True)

                backend, how = backend_of(torch, run_sdpa)
                record(label("torch_sdpa", backend),
                       tt.time(run_sdpa, reps=5, warmup=1, host=True),
                       f"(enable_gqa, K/V [H_kv, T, D]; backend from {how}; host work "
                       "included)")
                ek = tk.repeat_interleave(h // kv, dim=0)  # each query head's kv head
                ev = tv.repeat_interleave(h // kv, dim=0)

                def run_expanded():
                    run_with(torch, "efficient",
                             lambda: sdpa(tq[None], ek[None], ev[None], is_causal=True,
                                          scale=scale))

                record(label("torch_sdpa_expanded", "efficient"),
                       tt.time(run_expanded, reps=5, warmup=1, host=True),
                       "(K/V expanded to H heads before timing; host work included)")
            except Exception as exc:
                log(f"  prefill torch_sdpa T={t_len}: skipped ({type(exc).__name__}: {exc})")


def summary_lines(rows):
    lines = ["", "## Prefill (causal, float32; T x T FLOPs of QK^T and PV, halved for causal)",
             "", "Every row: CUDA events around one call with its host work, L2 flushed "
             "before each repeat. torch gets K/V unexpanded with `enable_gqa` as ours do "
             "(`torch_sdpa[backend]`: the backend that ran); `torch_sdpa_expanded[efficient]`: "
             "K/V expanded to all H heads before timing, memory-efficient backend.",
             "The `tf32` row's TFLOP/s counts the attention's FLOPs, not the three or four "
             "tf32 mmas it spends a product. Speed vs torch: the `torch_sdpa` row's ms over "
             "the row's, at the same T.",
             "", "| kernel | T | H | H_kv | D | ms | TFLOP/s | of fp32 FMA peak | "
             "of bf16 tensor-core peak | speed vs torch_sdpa |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    torch_ms = {r["seq_len"]: r["ms"] for r in rows
                if str(r["kernel"]).startswith("torch_sdpa[")}
    for r in rows:
        ref = torch_ms.get(r["seq_len"])
        ratio = f"{ref / r['ms']:.2f}x" if ref and r["ms"] else "-"
        bf16 = r.get("frac_of_bf16_peak")
        lines.append(f"| {r['kernel']} | {r['seq_len']} | {r['heads']} | {r['kv_heads']} | "
                     f"{r['head_dim']} | {r['ms']:.3f} | {r['TFLOPs']:.2f} | "
                     f"{r['frac_of_fma_peak']:.3f} | {'-' if bf16 is None else f'{bf16:.3f}'} | "
                     f"{ratio} |")
    return lines
