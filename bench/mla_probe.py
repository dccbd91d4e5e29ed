"""Where the MLA tensor-core decode's time goes (a GPU probe, printed, no report).

    python -m bench.mla_probe

* 16 heads (``bench.mla_mma.MEMORY``: B 64 / L 4096 and B 1 / L 32768, fp16 latent
  cache): the whole prepared call (absorb, attention, combine, decompress), again
  with the weight GEMMs' K split off where the call takes one (``sgemm.k_splits``;
  the outputs compared bit for bit), the absorb and decompress GEMMs alone (every
  way that applies: few-rows kernel, sgemm, sgemm's K split), and the
  attention launch alone over row groups 1 and 2 and split counts None (the plan's
  choice) and ``SPLITS`` (from 1 at B 64; up to 512, chunks of 64 positions, at B
  1). Bytes: the latent rows read, B x L x 576 x 2; the
  ratio is to a device-to-device copy measured in the same run (``bench.gpu``).
* 128 heads (``bench.mla_mma.COMPUTE``): the fp16 cache against the fp8 caches (per
  tensor, per token), the whole call and the attention launch alone; for fp16,
  the whole call again with the weight GEMMs on FMAs (``sgemm``, the ways
  before they went to ``tgemm``; outputs compared: max relative difference)
  and the weight GEMMs alone, every way.
* The weight GEMMs' ways include ``tgemm`` (split-tf32 tensor cores) at each
  of ``tgemm.WEIGHT_PLANS`` the operands take.
"""

from __future__ import annotations

from bench.gpu import Timer, copy_bandwidth
from bench.mla_mma import COMPUTE, MEMORY, _fp8_prepared, _prepared
from bench.run import mla_inputs
from mla import attn_gemm as G
from mla import mma as MM

LATENT = 576  # r + d_rope of the DeepSeek shape the bench cases use
SPLITS = {64: (None, 1, 2, 3, 4, 6, 8, 16), 1: (None, 16, 32, 64, 128, 256, 512)}


def _attention(p, pl, acc, ml):
    n_seq, rows = p["n_seq"], p["s_q"] * p["nh"]
    MM.launch(pl, p["qc"].reshape(n_seq, rows, LATENT), p["latent"], p["lens"], p["table"],
              p["nh"], p["scale"], p["o_lat"].reshape(n_seq, rows, LATENT - 64),
              p["lse"].reshape(n_seq, rows), acc, ml, 0, d_scale=p.get("latent_scale"))


def _weight_gemms(t, p, copy):
    """The absorb and decompress GEMMs alone (no q_pe packing), each way that
    applies: the few-rows kernel (``skinny``, M <= its row limit), ``sgemm`` in
    one launch, and ``sgemm`` with the K split ``k_splits`` gives on this GPU
    (ignoring the few-rows rule, so B 1 shows both); the plan's choice is
    marked. Bytes: the fp32 weights, nh x N x K x 4; the ratio is to the copy
    (GB/s) measured in the same run."""
    from attention.core.device import device_empty
    from attention.gemm import sgemm, skinny, tgemm

    n_q, nh, sms = p["n_q"], p["nh"], sgemm.sm_count()
    for label in G.WEIGHT_GEMMS:
        a, b, _, _, _, n_len, k_len, b_order = G.weight_operands(p, label)
        chosen = p["weight_way"][label]
        ways = [(("tgemm", plan), None) for plan in tgemm.WEIGHT_PLANS
                if tgemm.usable(a, b, a_order="mzk", b_order=b_order, plan=plan)]
        if n_q <= skinny.SKINNY_ROWS and k_len <= skinny.MAX_K:
            ways.append((("skinny", 1), None))
        for k_split in sorted({1, sgemm.k_splits(n_q, n_len, k_len, nh, sms)}):
            ways.append((("sgemm", k_split),
                         device_empty(sgemm.k_scratch_size(nh, k_split, n_q, n_len), "float32")
                         if k_split > 1 else None))
        nbytes = nh * n_len * k_len * 4
        row = []
        for way, scratch in ways:
            us = t.time(lambda: G.weight_gemm(p, label, 0, way=way, k_scratch=scratch),
                        reps=30) * 1e3
            name = way[0] if way[1] == 1 else f"sgemm K split {way[1]}"
            if way[0] == "tgemm":
                name = "tgemm {}x{}".format(*tgemm.tile_shape(way[1]))
            mark = " (the plan's)" if way == chosen else ""
            gbs = nbytes / us / 1e3
            row.append(f"{name} {us:.1f} us, {gbs:.0f} GB/s, {gbs / copy:.3f} of copy{mark}")
        print(f"  {label} M {n_q} N {n_len} K {k_len} x {nh} heads: {'; '.join(row)}",
              flush=True)


def memory_bound(t, copy):
    for c in MEMORY:
        p = _prepared(mla_inputs("float16", c), 0)
        n_seq, rows = p["n_seq"], p["s_q"] * p["nh"]
        nbytes = c["batch"] * c["seq"] * LATENT * 2
        base = p["plan"]
        print(f"B {c['batch']} L {c['seq']}: default rg {base['row_groups']} "
              f"n_split {base['n_split']} chunk {base['chunk']}", flush=True)
        whole = t.time(lambda: MM.launch_prepared(p, 0), reps=30)
        splits = {k: v[0] for k, v in (p.get("k_split") or {}).items()}
        print(f"  whole call {whole:.4f} ms  {nbytes / whole / 1e6:.0f} GB/s "
              f"{nbytes / whole / 1e6 / copy:.3f} of copy; weight GEMMs' K split "
              f"{splits or 'none'}", flush=True)
        if splits:  # the same call with the weight GEMMs in one launch each
            out = p["out"].copy_to_host()
            kept, p["k_split"] = p["k_split"], {}
            one = t.time(lambda: MM.launch_prepared(p, 0), reps=30)
            same = (p["out"].copy_to_host().view("u4") == out.view("u4")).all()
            p["k_split"] = kept
            print(f"  whole call, no K split {one:.4f} ms  "
                  f"{nbytes / one / 1e6 / copy:.3f} of copy; outputs bit-equal: {same}",
                  flush=True)
        _weight_gemms(t, p, copy)
        for rg in (1, 2):
            for ns in SPLITS.get(c["batch"], SPLITS[64]):
                pl = MM.plan(n_seq, rows, LATENT - 64, 64, c["seq"], "f16", row_groups=rg,
                             n_split=ns)
                acc, ml = MM.scratch(pl, n_seq, rows)
                try:
                    ms = t.time(lambda: _attention(p, pl, acc, ml), reps=30)
                except Exception as exc:  # noqa: BLE001 - a plan the kernel refuses
                    print(f"  rg {rg} ns {ns}: {type(exc).__name__} {exc}")
                    continue
                print(f"  attn rg {rg} n_split {pl['n_split']:>2} chunk {pl['chunk']:>5}: "
                      f"{ms:.4f} ms {nbytes / ms / 1e6:.0f} GB/s "
                      f"{nbytes / ms / 1e6 / copy:.3f} of copy", flush=True)


def _fma_weights(t, p):
    """The whole call with the weight GEMMs on FMAs (``weight_gemm_method``
    without ``tensor``; the K split they would take is not set up here, so
    one launch each), timed, and the largest relative difference of its output
    from the call as planned."""
    from attention.gemm import sgemm

    planned = p["out"].copy_to_host()
    kept = dict(p["weight_way"])
    for label in G.WEIGHT_GEMMS:
        n_len, k_len = G.weight_operands(p, label)[5:7]
        way = G.weight_gemm_method(p["n_q"], n_len, k_len, p["nh"], sgemm.sm_count())
        p["weight_way"][label] = way if way[0] == "skinny" else ("sgemm", 1)
    try:
        ms = t.time(lambda: MM.launch_prepared(p, 0), reps=20)
        fma = p["out"].copy_to_host()
    finally:
        p["weight_way"] = kept
    rel = float(abs(fma.astype("f8") - planned).max() / abs(planned).max())
    return ms, rel


def compute_bound(t, copy):
    inputs = mla_inputs("float16", COMPUTE)
    for name in ("f16", "fp8_tensor", "fp8_token"):
        p = _prepared(inputs, 0) if name == "f16" else _fp8_prepared(inputs, name[4:], 0)[0]
        whole = t.time(lambda: MM.launch_prepared(p, 0), reps=20)
        pl = p["plan"]
        ms = t.time(lambda: _attention(p, pl, p["part_acc"], p["part_ml"]), reps=20)
        ways = {k: v[0] for k, v in p["weight_way"].items()}
        print(f"128 heads {name}: whole {whole:.4f} ms, attention {ms:.4f} ms "
              f"(rg {pl['row_groups']} n_split {pl['n_split']}); weight GEMMs {ways}",
              flush=True)
        if name == "f16":
            fma, rel = _fma_weights(t, p)
            print(f"  whole call, weight GEMMs on FMAs {fma:.4f} ms; output's max relative "
                  f"difference from the planned call {rel:.2e}", flush=True)
            _weight_gemms(t, p, copy)


def main():
    t = Timer()
    copy = copy_bandwidth(t)[0]
    print(f"copy {copy:.0f} GB/s", flush=True)
    memory_bound(t, copy)
    compute_bound(t, copy)


if __name__ == "__main__":
    main()
