"""Launch sequences to profile under ncu (scripts/profile runs them):

    ncu --clock-control none -k regex:decode_fast --launch-count 2 \
        python3 -m bench.profile float16 4096 [batch]
    ncu --clock-control none -k "regex:gemm|mla_softmax" --launch-skip 5 \
        --launch-count 4 python3 -m bench.profile mla float32|float16

    ncu --clock-control none --profile-from-start off \
        python3 -m bench.profile einsum float16

    ncu --clock-control none -k "regex:flash|fmha|attention" --launch-count 3 \
        python3 -m bench.profile sdpa float16 4096 [batch]

    ncu --clock-control none -k regex:decode_fast --launch-skip 2 --launch-count 1 \
        python3 -m bench.profile paged float16 4096 16 HND

    ncu --clock-control none -k regex:prefill_ --launch-skip 1 --launch-count 1 \
        python3 -m bench.profile prefill float16|bfloat16|float32 [T]

    ncu --clock-control none -k regex:mla_mma --launch-skip 2 --launch-count 1 \
        python3 -m bench.profile mla_mma fp16|tensor|token [heads]

The first form runs the fast decode at B ``batch`` (default 32), H 32, H_kv 8,
D 128 and length L three times; the second runs ``mla.pipeline.mla_decode``
twice at the MLA benchmark's shape (B 64, 128 heads, latent 512 + 64, L 4096)
by its GEMM path. The regex matches five launches a call (absorb, scores,
softmax, P.V, decompress); skip 5, count 4 profiles the second call's
absorb, scores, softmax and P.V. The third runs the benchmark's torch einsum
absorbed MLA decode (``bench.run.einsum_mla_decode``, every operand in the cache's
dtype: the fp16 comparison the MLA target is judged against) at the same shape:
two calls to warm up, then one between ``cudaProfilerStart`` and
``cudaProfilerStop``, so every kernel of one call is profiled. The fourth runs torch's
``scaled_dot_product_attention`` (GQA) at the decode shape, for the kernel the
fp16/bf16 targets are measured against (skipped, with a message, without torch).
The fifth runs the fast decode over a paged cache (pages of P, HND or NHD, a
shuffled page table) at B 32, q in the cache's dtype, three times. The sixth
runs a tensor-core prefill twice at the prefill benchmark's shape (T 4096, H 32,
H_kv 8, D 128, causal): ``attention.prefill.mma`` for float16 / bfloat16,
``attention.prefill.tf32`` for float32 (skip 1, count 1: the second launch).
The seventh runs the prepared tensor-core MLA call (``mla.mma``) three times at
the MLA benchmark's shape over the fp16 latent cache or its fp8 quantization.
The eighth runs the tensor-core decode (``attention.decode.mma``, its plan at H 32,
H_kv 8, D 128, T_q 1, a pooled cache of fp8 codes with per-tensor scales or of
float16) three times at B ``batch`` and length L, and with ``empty`` over
lengths 0 (no K/V read: the launch, the blocks' set-up and their writes, the
fixed cost ``bench.mma_decode --splits`` times as "empty main"); ncu's default
cache control flushes the caches before the profiled launch, as the bench does:

    ncu --clock-control none --set full --import-source yes -k regex:decode_mma \
        --launch-skip 2 --launch-count 1 python3 -m bench.profile mma_decode fp8 1 32768 empty
"""

import math
import sys

import numpy as np
from numba import cuda

from attention.decode import fast as F

from .gpu import random_array
from .run import np_dtype


def mla(dname):
    from mla.pipeline import mla_decode

    from .run import MLA, mla_inputs

    q_nope, q_pe, cache, lengths, w_uk, w_uv = mla_inputs(dname)
    from mla.attn_gemm import Workspace

    ws = Workspace()
    for _ in range(2):
        mla_decode(q_nope, q_pe, cache, lengths, w_uk, w_uv, stream=cuda.default_stream(),
                   method="gemm", workspace=ws)
    cuda.synchronize()
    print("mla_decode", MLA, dname)


def einsum(dname):
    try:
        import torch
    except Exception as exc:  # optional: the comparison only
        print(f"torch not importable ({type(exc).__name__}): einsum profile skipped")
        return
    from .run import MLA, einsum_mla_decode, mla_inputs

    # the benchmark's inputs, every operand in the cache's dtype as its einsum row
    torch.backends.cuda.matmul.allow_tf32 = False
    q_nope, q_pe, cache, _, w_uk, w_uv = mla_inputs(dname)
    cache = torch.as_tensor(cache, device="cuda")
    qn, qp, uk, uv = (torch.as_tensor(x, device="cuda").to(cache.dtype)
                      for x in (q_nope, q_pe, w_uk, w_uv))
    lat = MLA["latent"]
    for _ in range(2):
        einsum_mla_decode(torch, qn, qp, cache, uk, uv, lat)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    o = einsum_mla_decode(torch, qn, qp, cache, uk, uv, lat)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("torch einsum mla", tuple(o.shape), dname)


def sdpa(dname, seq, b):
    try:
        import torch
    except Exception as exc:  # optional: the comparison only
        print(f"torch not importable ({type(exc).__name__}): sdpa profile skipped")
        return
    h, kv, d = 32, 8, 128
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dname]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, h, 1, d, device="cuda", dtype=tdt, generator=gen)
    k = torch.randn(b, kv, seq, d, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(b, kv, seq, d, device="cuda", dtype=tdt, generator=gen)
    for _ in range(3):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    print("torch sdpa", tuple(o.shape), dname, "L", seq)


def paged(dname, seq, page, layout, b=32):
    """The fast decode over a paged cache (pages of ``page`` positions, a
    shuffled table) at the decode shape, three launches."""
    h, kv, d = 32, 8, 128
    dt = np_dtype(dname)
    n_pages = b * seq // page
    shape = (n_pages, kv, page, d) if layout == "HND" else (n_pages, page, kv, d)
    k, v = random_array(shape, dt, 1), random_array(shape, dt, 2)
    q = random_array((b, h, d), dt, 3)
    table = cuda.to_device(np.random.default_rng(0).permutation(n_pages).astype(np.int32)
                           .reshape(b, seq // page))
    lens = cuda.to_device(np.full(b, seq, np.int32))
    out, lse = cuda.device_array((b, h, d), np.float32), cuda.device_array((b, h), np.float32)
    pl = F.plan(b, h, kv, d, seq, F.dtype_kind(dt), paging=layout)
    pa, pm = F.scratch(b, h, d, pl["n_split"])
    for _ in range(3):
        F.launch(pl, q, k, v, lens, table, np.float32(1 / math.sqrt(d)), out, lse, pa, pm, 0)
    cuda.synchronize()
    print("paged plan", layout, "P", page, {k_: v_ for k_, v_ in pl.items() if k_ != "kernel"})


def prefill(dname, seq=4096):
    """A tensor-core prefill at T ``seq``, H 32, H_kv 8, D 128, causal, two
    launches of its default plan (16-bit: ``attention.prefill.mma``; float32:
    ``attention.prefill.tf32``)."""
    h, kv, d = 32, 8, 128
    dt = np_dtype(dname)
    q = random_array((seq, h * d), dt, 1)
    k, v = random_array((seq, kv * d), dt, 2), random_array((seq, kv * d), dt, 3)
    if dt == np.float32:
        from attention.prefill.tf32 import prefill_attention_tf32 as run
    else:
        from attention.prefill.mma import prefill_attention_mma as run
    for _ in range(2):
        run(q, k, v, h, kv, causal=True, stream=cuda.default_stream())
    cuda.synchronize()
    print("prefill", dname, "T", seq, run.__module__)


def mla_mma(mode="fp16", heads=128):
    """The prepared tensor-core MLA call (``mla.mma.launch_prepared``) three times
    at B 64 / L 4096 / latent 512 + 64 and ``heads`` heads, over the fp16 cache
    (``mode`` "fp16") or its fp8 quantization ("tensor" / "token" scales)."""
    from mla import mma as MM

    from .mla_mma import COMPUTE, _fp8_prepared, _prepared
    from .run import mla_inputs

    c = dict(COMPUTE, heads=int(heads))
    inputs = mla_inputs("float16", c)
    st = cuda.default_stream()
    p = _prepared(inputs, st) if mode == "fp16" else _fp8_prepared(inputs, mode, st)[0]
    for _ in range(3):
        MM.launch_prepared(p, st)
    cuda.synchronize()
    print("mla_mma", mode, heads, {k_: v_ for k_, v_ in p["plan"].items() if k_ != "kernel"})


def mma_decode(cache="fp8", b=1, seq=32768, empty=False, heads=32, kv_heads=8, head_dim=128):
    """The tensor-core decode's plan three times at B ``b`` / L ``seq`` (H 32, H_kv 8,
    D 128 unless given, T_q 1), over an fp8 (per-tensor scales) or float16 pooled
    cache; with ``empty`` every length is 0. The combine of a split plan is launched too.
    Returns the last call's (out [B, 1, H, D], lse [B, 1, H]) on the host."""
    from attention.decode import mma

    from .mma_decode import fp8_cache, fp8_scales

    h, kv, d = int(heads), int(kv_heads), int(head_dim)
    shape = (b, h, kv, d, seq)
    rng = np.random.default_rng(9)
    if cache == "fp8":
        k, v, lens, slots = fp8_cache(shape, rng)
        ks, vs = fp8_scales(shape, "tensor", rng)
        kind = mma.FP8_KIND
    else:  # drawn on the host (a simulated random_array launch takes minutes)
        k, v = (cuda.to_device(rng.standard_normal((b, kv, seq, d)).astype(np.float16))
                for _ in range(2))
        lens = cuda.to_device(np.full(b, seq, np.int32))
        slots = cuda.to_device(np.arange(b, dtype=np.int32))
        ks = vs = None
        kind = "f16"
    if empty:
        lens = cuda.to_device(np.zeros(b, np.int32))
    q = cuda.to_device(rng.standard_normal((b, 1, h, d)).astype(np.float16))
    out, lse = cuda.device_array((b, 1, h, d), np.float32), cuda.device_array((b, 1, h),
                                                                              np.float32)
    pl = mma.plan(b, h, kv, d, seq, kind)
    pa, pm = F.scratch(b, h, d, pl["n_split"])
    for _ in range(3):
        mma.launch(pl, q, k, v, lens, slots, np.float32(1 / math.sqrt(d)), out, lse, pa, pm,
                   0, d_k_scale=ks, d_v_scale=vs)
    cuda.synchronize()
    print("mma_decode", cache, "B", b, "L", seq, "empty" if empty else "",
          {k_: v_ for k_, v_ in pl.items() if k_ != "kernel"})
    return out.copy_to_host(), lse.copy_to_host()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "mma_decode":  # mma_decode fp8|f16 B L [empty]
        return mma_decode(sys.argv[2] if len(sys.argv) > 2 else "fp8",
                          int(sys.argv[3]) if len(sys.argv) > 3 else 1,
                          int(sys.argv[4]) if len(sys.argv) > 4 else 32768,
                          len(sys.argv) > 5 and sys.argv[5] == "empty")
    if len(sys.argv) > 1 and sys.argv[1] == "mla_mma":  # mla_mma fp16|tensor|token [heads]
        return mla_mma(sys.argv[2] if len(sys.argv) > 2 else "fp16",
                       int(sys.argv[3]) if len(sys.argv) > 3 else 128)
    if len(sys.argv) > 1 and sys.argv[1] == "prefill":  # prefill DTYPE [T]
        return prefill(sys.argv[2] if len(sys.argv) > 2 else "float16",
                       int(sys.argv[3]) if len(sys.argv) > 3 else 4096)
    if len(sys.argv) > 1 and sys.argv[1] == "paged":  # paged DTYPE L PAGE LAYOUT
        return paged(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    if len(sys.argv) > 1 and sys.argv[1] == "mla":
        return mla(sys.argv[2] if len(sys.argv) > 2 else "float32")
    if len(sys.argv) > 1 and sys.argv[1] == "einsum":
        return einsum(sys.argv[2] if len(sys.argv) > 2 else "float16")
    if len(sys.argv) > 1 and sys.argv[1] == "sdpa":
        return sdpa(sys.argv[2] if len(sys.argv) > 2 else "float16",
                    int(sys.argv[3]) if len(sys.argv) > 3 else 4096,
                    int(sys.argv[4]) if len(sys.argv) > 4 else 32)
    dname = sys.argv[1] if len(sys.argv) > 1 else "float16"
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    b = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    h, kv, d = 32, 8, 128
    dt = np_dtype(dname)
    k, v = random_array((b, kv, seq, d), dt, 1), random_array((b, kv, seq, d), dt, 2)
    q = random_array((b, h, d), np.float32, 3)
    lens = cuda.to_device(np.full(b, seq, np.int32))
    slots = cuda.to_device(np.arange(b, dtype=np.int32))
    out, lse = cuda.device_array((b, h, d), np.float32), cuda.device_array((b, h), np.float32)
    pl = F.plan(b, h, kv, d, seq, F.dtype_kind(dt))
    pa, pm = F.scratch(b, h, d, pl["n_split"])
    for _ in range(3):
        F.launch(pl, q, k, v, lens, slots, np.float32(1 / math.sqrt(d)), out, lse, pa, pm, 0)
    cuda.synchronize()
    print("plan", {k_: v_ for k_, v_ in pl.items() if k_ != "kernel"})


if __name__ == "__main__":
    main()
