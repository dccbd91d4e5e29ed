"""Paged-cache and batch-invariant decode benchmark (``scripts/bench``'s ``paged`` section).

Every row is one ``attention.decode.plan.DecodePlan.run`` (the product path,
device time: CUDA events with the L2 flushed and the host cover of
``bench.gpu.Timer``), fp16 and bf16 caches with q in the cache's dtype:

* ``contiguous``: the pooled cache ``[B, H_kv, L, D]`` (slot m = sequence m);
* ``contiguous_invariant``: the same with ``batch_invariant=True`` (split length
  ``fast.invariant_chunk``, a combine whenever a sequence spans more chunks);
* ``contiguous_chunk<c>``: the pooled kernel with a fixed split length ``c``
  (``fast.plan(chunk=c)``, raw launches): the costs a batch-invariant plan
  could choose between;
* ``paged_<layout>_p<P>``: the same values in pages of P positions
  (``[num_pages, H_kv, P, D]`` HND, ``[num_pages, P, H_kv, D]`` NHD), pages in a
  shuffled order, the page table ``[B, L / P]``; ``_invariant`` with
  ``batch_invariant=True``;
* ``contiguous_fp8`` / ``contiguous_fp8_tok`` (fp16 rows only): the same shape
  with an fp8 e4m3 cache (random finite codes, q fp16), per-tensor scales /
  per-(token, kv head) scales, by the plan's default method (the tensor-core
  kernel); ``_fast``: by ``method="fast"`` (the CUDA-core kernel), its diff
  against the default's output; the bytes are the fp8 cache's (1 a K/V
  element), q, out, lse and the scales (``fp8_rows``);
* ``contiguous_t4``: a multi-token plan (``t_q=4``, q ``[B, 4, H, D]``), the
  same K/V bytes; its last query sees every position, so its diff is
  against the one-query output (the ratio to the T_q = 1 row is the cost of
  the three more queries). The plan's default kernel (``method="auto"``: the
  tensor-core one at 16-bit T > 1; the note names it); ``contiguous_t4_fast``
  the CUDA-core kernel's (``method="fast"``) for comparison;
  ``contiguous_t4_invariant`` the default kernel with ``batch_invariant=True``
  (its ``x contiguous`` against ``contiguous_t4``: the cost of invariance on
  the tensor-core plans); at both shapes (``MULTI``);
* ``paged_<layout>_p<P>_ordered`` / ``_split2`` (probes, ``PROBES``): the same
  pages in logical order (no shuffle: the access pattern's share of the
  paged rows' cost), and a plan of two splits a sequence;
* ``torch_sdpa[<backend>]``: torch's SDPA on the contiguous data
  (``[B, H_kv, L, D]``, ``enable_gqa``; it has no paging), the backend that ran named.

Shapes (``SHAPES``): B 32 / H 32 / H_kv 8 / D 128 / L 4096 and B 1 / L 32768.
Bytes counted (``bench.run.decode_bytes``): K and V once
(``2 * B * H_kv * L * D * 2``), q (2 bytes an element), out (fp32) and lse;
the page table (4 bytes a page) is left out, it is at most 1/256 of a
page-1 row's bytes at D 128 (8 bytes for 2 * 256 bytes of K and V rows).
Each paged row's ``max_abs_diff`` is its largest difference from the
contiguous plan's output (0.0: bit-identical; the kernels are the same
arithmetic on the same values), each invariant row's from the invariant
contiguous plan's.

``bench_paged(timer, copy_gbps, torch, rows, log)`` appends dict rows
(``COLUMNS``); ``summary_lines(rows)`` gives the summary's section with the
targets of the paged-cache issue.
"""

from __future__ import annotations

import math

import numpy as np

SHAPES = [(32, 32, 8, 128, 4096), (1, 32, 8, 128, 32768)]
DTYPES = ("float16", "bfloat16")
PAGES = {(32, 4096): (("HND", 16), ("NHD", 16), ("HND", 64), ("HND", 1), ("NHD", 1)),
         (1, 32768): (("HND", 16), ("HND", 1))}
# probes of where the paged rows lose time (B 32 / L 4096): the same pages in logical
# order (the access pattern without the shuffle), and two splits a sequence (more
# blocks, more bytes in flight an SM)
PROBES = {(32, 4096): (("HND", 16), ("HND", 1))}
CHUNKS = (512, 1024, 2048)
# T_q of the multi-token rows (their diff: the last query's, vs T_q 1)
MULTI = {(32, 4096): 4, (1, 32768): 4}
COLUMNS = ["kernel", "dtype", "batch", "heads", "kv_heads", "head_dim", "seq_len", "ms",
           "GBps", "frac_of_copy", "vs_contiguous", "n_split", "chunk", "max_abs_diff", "note"]
TARGETS = {"p16": 0.97, "p1": 0.80, "sdpa": 1.0, "invariant_cost": 0.03, "t4": 1.2}


def page_layout(k_host, page, layout, rng, shuffle=True):
    """A contiguous cache ``[B, H_kv, L, D]`` (host array) as pages of ``page``
    positions in a shuffled physical order (never the identity where there are two
    pages or more; ``shuffle=False``: in logical order): (pages, table [B, L / page]
    int32)."""
    b, kv, seq, d = k_host.shape
    per = seq // page
    blocks = k_host.reshape(b, kv, per, page, d)
    if layout == "HND":
        logical = blocks.transpose(0, 2, 1, 3, 4).reshape(b * per, kv, page, d)
    else:
        logical = blocks.transpose(0, 2, 3, 1, 4).reshape(b * per, page, kv, d)
    perm = rng.permutation(b * per).astype(np.int32) if shuffle else np.arange(
        b * per, dtype=np.int32)
    if shuffle and b * per > 1 and np.array_equal(perm, np.arange(b * per)):
        perm = perm[::-1].copy()  # never the identity order
    pages = np.empty(logical.shape, logical.dtype)  # C order (empty_like keeps the view's)
    pages[perm] = logical
    return pages, perm.reshape(b, per)


def bench_paged(timer, copy_gbps, torch, rows, log):
    from numba import cuda

    from attention.decode import fast as F
    from attention.decode.plan import DecodePlan

    from .gpu import TorchTimer, random_array
    from .run import decode_bytes, np_dtype
    from .sdpa import backend_of as sdpa_backend_of
    from .sdpa import label as sdpa_label

    rng = np.random.default_rng(5)
    for (b, h, kv, d, seq) in SHAPES:
        for dname in DTYPES:
            dt = np_dtype(dname)
            kind = F.dtype_kind(dt)
            k = random_array((b, kv, seq, d), dt, 31)
            v = random_array((b, kv, seq, d), dt, 32)
            q = random_array((b, h, d), dt, 33)
            lens = cuda.to_device(np.full(b, seq, np.int32))
            nbytes = decode_bytes(b, h, kv, d, seq, dt.itemsize, dt.itemsize)
            base = {}

            def record(name, ms, pl=None, diff=None, note="", ref="contiguous", moved=None):
                gbps = (nbytes if moved is None else moved) / (ms * 1e-3) / 1e9
                vs = base[ref] / ms if ref in base else None
                row = {"kernel": name, "dtype": dname, "batch": b, "heads": h,
                       "kv_heads": kv, "head_dim": d, "seq_len": seq, "ms": round(ms, 5),
                       "GBps": round(gbps, 1), "frac_of_copy": round(gbps / copy_gbps, 3),
                       "vs_contiguous": None if vs is None else round(vs, 3),
                       "n_split": None if pl is None else pl.n_split,
                       "chunk": None if pl is None else pl.kernel_plan.get("chunk"),
                       "max_abs_diff": diff, "note": note}
                rows.append(row)
                log(f"  {name:<28} {dname:<9} B={b:<3} L={seq:<6} {ms * 1e3:8.1f} us "
                    f"{gbps:7.1f} GB/s {gbps / copy_gbps:5.3f} of copy"
                    + ("" if vs is None else f"  x{vs:.3f} of {ref}")
                    + ("" if pl is None else f"  splits {pl.n_split}")
                    + ("" if diff is None else f"  diff {diff:.1e}") + f" {note}")
                return row

            def plan_row(name, plan, args, table, ref_out=None, ref="contiguous", qq=None):
                qq = q if qq is None else qq

                def run():
                    plan.run(qq, *args, lens, table)

                ms = timer.time(run, reps=20)
                plan.check()
                out = plan.out.copy_to_host()
                if plan.t_q > 1:  # the last query sees every position: the T_q = 1 result
                    out = np.ascontiguousarray(out[:, -1])
                diff = None if ref_out is None else float(np.abs(out - ref_out).max())
                record(name, ms, plan, diff, ref=ref,
                       note=f"({plan.method} kernel, {plan.registers} registers)")
                return ms, out

            mk = dict(cache_dtype=dt, q_dtype=dt)
            pl = DecodePlan(b, h, kv, d, b, seq, **mk)
            base["contiguous"], ref_out = plan_row("contiguous", pl, (k, v), None)
            pli = DecodePlan(b, h, kv, d, b, seq, batch_invariant=True, **mk)
            base["contiguous_invariant"], inv_out = plan_row(
                "contiguous_invariant", pli, (k, v), None, ref_out)
            if dname == "float16":
                fp8_rows(timer, record, q, lens, (b, h, kv, d, seq))
            if (b, seq) in MULTI:
                t_q = MULTI[(b, seq)]
                # every query is q (the timing does not depend on the values); the
                # last one sees every position, so it is the T_q = 1 result
                q_bits = np.repeat(q.view(np.uint16).copy_to_host()[:, None], t_q, axis=1)
                q_multi = cuda.to_device(q_bits).view(dt)
                plm = DecodePlan(b, h, kv, d, b, seq, t_q=t_q, **mk)  # "auto": the mma kernel
                base[f"contiguous_t{t_q}"], _ = plan_row(f"contiguous_t{t_q}", plm, (k, v), None,
                                                         ref_out, qq=q_multi)
                del plm
                # the batch-invariant tensor-core plan (mma.invariant_chunk): its cost
                # against the default T_q plan, and its last query against T_q 1's
                pmi = DecodePlan(b, h, kv, d, b, seq, t_q=t_q, batch_invariant=True, **mk)
                plan_row(f"contiguous_t{t_q}_invariant", pmi, (k, v), None, ref_out,
                         ref=f"contiguous_t{t_q}", qq=q_multi)
                del pmi
                plf = DecodePlan(b, h, kv, d, b, seq, t_q=t_q, method="fast", **mk)
                plan_row(f"contiguous_t{t_q}_fast", plf, (k, v), None, ref_out, qq=q_multi)
                del plf
            for c in CHUNKS:
                if c >= seq:
                    continue
                fp = F.plan(b, h, kv, d, seq, kind, chunk=c)
                pa, pm = F.scratch(b, h, d, fp["n_split"])
                out = cuda.device_array((b, h, d), np.float32)
                lse = cuda.device_array((b, h), np.float32)
                slots = cuda.to_device(np.arange(b, dtype=np.int32))
                scale = np.float32(1.0 / math.sqrt(d))

                def run_chunk():
                    F.launch(fp, q, k, v, lens, slots, scale, out, lse, pa, pm, 0)

                ms = timer.time(run_chunk, reps=20)
                diff = float(np.abs(out.copy_to_host() - ref_out).max())
                record(f"contiguous_chunk{c}", ms, None, diff,
                       f"(splits {fp['n_split']}, raw launches)")
            k_host, v_host = (x.view(np.uint16).copy_to_host().view(dt) for x in (k, v))
            for layout, page in PAGES[(b, seq)]:
                seed = rng.integers(1 << 30)
                kp, table = page_layout(k_host, page, layout, np.random.default_rng(seed))
                vp, _ = page_layout(v_host, page, layout, np.random.default_rng(seed))
                kp, vp = (cuda.to_device(x.view(np.uint16)).view(dt) for x in (kp, vp))
                tab = cuda.to_device(table)
                n_pages = kp.shape[0]
                name = f"paged_{layout}_p{page}"
                pp = DecodePlan(b, h, kv, d, n_pages, seq, page_size=page, layout=layout, **mk)
                plan_row(name, pp, (kp, vp), tab, ref_out)
                if page == 16:
                    ppi = DecodePlan(b, h, kv, d, n_pages, seq, page_size=page,
                                     layout=layout, batch_invariant=True, **mk)
                    plan_row(name + "_invariant", ppi, (kp, vp), tab, inv_out,
                             ref="contiguous_invariant")
                if (layout, page) in PROBES.get((b, seq), ()):
                    p2 = DecodePlan(b, h, kv, d, n_pages, seq, page_size=page, layout=layout,
                                    n_split=2, **mk)
                    plan_row(name + "_split2", p2, (kp, vp), tab, None)
                    kp_o, _ = page_layout(k_host, page, layout, None, shuffle=False)
                    vp_o, tab_o = page_layout(v_host, page, layout, None, shuffle=False)
                    kp_o, vp_o = (cuda.to_device(x.view(np.uint16)).view(dt)
                                  for x in (kp_o, vp_o))
                    plan_row(name + "_ordered", pp, (kp_o, vp_o), cuda.to_device(tab_o),
                             ref_out)
                    del kp_o, vp_o
                del kp, vp, tab, pp
                cuda.current_context().deallocations.clear()
            if torch is not None:
                try:
                    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dname]

                    def as_torch(a):
                        return torch.as_tensor(a.view(np.int16), device="cuda").view(tdt)

                    tk, tv = as_torch(k), as_torch(v)
                    tq = as_torch(q).reshape(b, h, 1, d)
                    sdpa = torch.nn.functional.scaled_dot_product_attention

                    def run_sdpa():
                        sdpa(tq, tk, tv, enable_gqa=True)

                    backend, how = sdpa_backend_of(torch, run_sdpa)
                    ms = TorchTimer(torch).time(run_sdpa, reps=20)
                    record(sdpa_label("torch_sdpa", backend), ms,
                           note=f"(contiguous, enable_gqa; backend from {how})")
                    del tk, tv, tq
                except Exception as exc:
                    log(f"  torch_sdpa {dname}: skipped ({type(exc).__name__}: "
                        f"{str(exc)[:160]})")
            del k, v, q
            cuda.current_context().deallocations.clear()
    return rows


FP8_ROWS = (("contiguous_fp8", "tensor", "auto"), ("contiguous_fp8_fast", "tensor", "fast"),
            ("contiguous_fp8_tok", "token_head", "auto"),
            ("contiguous_fp8_tok_fast", "token_head", "fast"))


def fp8_rows(timer, record, q, lens, shape):
    """The fp8 e4m3 rows (``FP8_ROWS``): random finite codes, q float16, per-tensor
    scales (two [1] float32) or per-(token, kv head) ones ([B, H_kv, L] float32 in
    [0.005, 0.02]), each by ``DecodePlan``'s default method (the tensor-core
    kernel) and by ``method="fast"`` (the CUDA-core one); the fast row's diff is
    against the default's output of the same scales (P rounded to f16 there)."""
    from numba import cuda

    from attention.decode.plan import DecodePlan

    from .run import decode_bytes

    b, h, kv, d, seq = shape
    rng = np.random.default_rng(7)
    k8, v8 = (cuda.to_device((rng.integers(0, 0x7E, (b, kv, seq, d), dtype=np.uint8)
                              | (rng.integers(0, 2, (b, kv, seq, d), dtype=np.uint8) << 7)))
              for _ in range(2))
    scales = {"tensor": tuple(cuda.to_device(np.float32([1.0 / 448])) for _ in range(2)),
              "token_head": tuple(cuda.to_device(rng.uniform(0.005, 0.02, (b, kv, seq))
                                                 .astype(np.float32)) for _ in range(2))}
    ref = {}
    for name, mode, method in FP8_ROWS:
        ks, vs = scales[mode]
        pl = DecodePlan(b, h, kv, d, b, seq, cache_dtype=np.uint8, q_dtype=np.float16,
                        fp8_scales=mode, method=method)

        def run():
            pl.run(q, k8, v8, lens, k_scale=ks, v_scale=vs)

        ms = timer.time(run, reps=20)
        pl.check()
        out = pl.out.copy_to_host()
        diff = None if mode not in ref else float(np.abs(out - ref[mode]).max())
        ref.setdefault(mode, out)
        moved = decode_bytes(b, h, kv, d, seq, 1, 2) + 4 * (ks.size + vs.size)
        record(name, ms, pl, diff, f"({pl.method} kernel, {pl.registers} registers; bytes of "
               f"the fp8 cache and its {mode} scales)", moved=moved)


def _find(rows, kernel, dname, b, seq):
    for r in rows:
        if (r["kernel"] == kernel and r["dtype"] == dname and r["batch"] == b
                and r["seq_len"] == seq):
            return r
    return None


def _mark(ok):
    return "met" if ok else "MISSED"


def summary_lines(rows):
    """The summary's paged section: each target of the paged-cache issue with
    the ratio measured in this run."""
    out = ["", "## Paged caches and batch invariance (`bench/paged.py`)", "",
           "Device time of `DecodePlan.run`, q and cache in the same 16-bit dtype; "
           "`x contiguous` is the contiguous plan's time over the row's; "
           "`diff` the largest difference from the contiguous (invariant rows: "
           "the invariant contiguous) output.", "",
           "| kernel | dtype | B | L | us | GB/s | of copy | x contiguous | splits | diff |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = "" if r["vs_contiguous"] is None else f"{r['vs_contiguous']:.3f}"
        diff = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        out.append(f"| {r['kernel']} | {r['dtype']} | {r['batch']} | {r['seq_len']} | "
                   f"{r['ms'] * 1e3:.1f} | {r['GBps']:.0f} | {r['frac_of_copy']:.3f} | {vs} | "
                   f"{r['n_split'] if r['n_split'] is not None else ''} | {diff} |")
    out += ["", "### Targets", ""]
    for dname in DTYPES:
        b, seq = 32, 4096
        c = _find(rows, "contiguous", dname, b, seq)
        if c is None:
            continue
        for kern, goal in (("paged_HND_p16", "p16"), ("paged_NHD_p16", "p16"),
                           ("paged_HND_p1", "p1"), ("paged_NHD_p1", "p1")):
            r = _find(rows, kern, dname, b, seq)
            if r is not None:
                out.append(f"- {kern} {dname} B 32 / L 4096: x{r['vs_contiguous']:.3f} of "
                           f"contiguous (target >= {TARGETS[goal]}): "
                           f"{_mark(r['vs_contiguous'] >= TARGETS[goal])}")
        sd = [r for r in rows if r["kernel"].startswith("torch_sdpa") and r["dtype"] == dname
              and r["batch"] == b and r["seq_len"] == seq]
        r = _find(rows, "paged_HND_p16", dname, b, seq)
        if sd and r is not None:
            ratio = sd[0]["ms"] / r["ms"]
            out.append(f"- paged_HND_p16 {dname} against {sd[0]['kernel']} (contiguous): "
                       f"x{ratio:.3f} (target >= 1.0): {_mark(ratio >= TARGETS['sdpa'])}")
    for (b, seq, goal) in ((32, 4096, 0.90), (1, 32768, 0.75)):
        c = _find(rows, "contiguous", "float16", b, seq)
        sd = [x for x in rows if x["kernel"].startswith("torch_sdpa") and x["dtype"] == "float16"
              and x["batch"] == b and x["seq_len"] == seq]
        for kern, _, _ in FP8_ROWS:
            r = _find(rows, kern, "float16", b, seq)
            if r is None:
                continue
            extra = "" if c is None else f", x{c['ms'] / r['ms']:.2f} the fp16 plan's speed"
            if sd:
                extra += f", x{sd[0]['ms'] / r['ms']:.2f} {sd[0]['kernel']} fp16's"
            out.append(f"- {kern} B {b} / L {seq}: {r['frac_of_copy']:.3f} of copy (target >= "
                       f"{goal}){extra}: {_mark(r['frac_of_copy'] >= goal)}")
    for dname in DTYPES:
        c = _find(rows, "contiguous", dname, 32, 4096)
        r = _find(rows, "contiguous_t4", dname, 32, 4096)
        if c is not None and r is not None:
            ratio = r["ms"] / c["ms"]
            out.append(f"- T_q 4 {dname} B 32 / L 4096: x{ratio:.2f} the time of T_q 1 "
                       f"(target <= {TARGETS['t4']}): {_mark(ratio <= TARGETS['t4'])}")
    for (b, seq) in ((32, 4096), (1, 32768)):
        for dname in DTYPES:
            for plain, what in (("contiguous", ""), ("contiguous_t4", " (T_q 4, tensor cores)")):
                c = _find(rows, plain, dname, b, seq)
                i = _find(rows, plain + "_invariant", dname, b, seq)
                if c is None or i is None:
                    continue
                cost = i["ms"] / c["ms"] - 1
                out.append(f"- batch-invariant cost{what} {dname} B {b} / L {seq}: "
                           f"{cost * 100:+.1f} % (splits {c['n_split']} -> {i['n_split']}; "
                           f"default if <= 3 % at both shapes): "
                           f"{_mark(cost <= TARGETS['invariant_cost'])}")
    return out
